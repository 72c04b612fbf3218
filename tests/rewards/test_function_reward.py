import asyncio
import functools
import math
import threading
import time

import numpy as np
import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from rlflow.data.keys import DATA_SOURCE, EXTRA_INFO, GROUND_TRUTH, RESPONSE_MASK, RESPONSE_TEXT, SCORES, TOKEN_REWARDS
from rlflow.rewards import FunctionReward, Reward, RewardError, RewardWarning, default_compute_score


def make_batch(texts, gts=None, sources=None, extras=None, mask=None):
    b = len(texts)
    return TensorDict(
        {
            RESPONSE_TEXT: NonTensorStack(*texts),
            GROUND_TRUTH: NonTensorStack(*(gts if gts is not None else [None] * b)),
            DATA_SOURCE: NonTensorStack(*(sources or ["src"] * b)),
            EXTRA_INFO: NonTensorStack(*(extras or [None] * b)),
            RESPONSE_MASK: mask if mask is not None else torch.ones(b, 3, dtype=torch.int64),
        },
        batch_size=[b],
    )


def exact(response, ground_truth):
    return float(response == ground_truth)


# ---------------------------------------------------------------- forms


def test_verl_form_with_default_compute_score():
    reward = FunctionReward(default_compute_score)
    assert reward.form == "verl"
    batch = make_batch(
        ["#### 72", "#### 71", "\\boxed{0.5}", "Answer: 7", "Answer: 8"],
        gts=["72", "72", "\\frac{1}{2}", "7", "7"],
        sources=["openai/gsm8k", "openai/gsm8k", "lighteval/MATH", "math_dapo", "aime2024"],
    )
    out = reward(batch)
    assert out[SCORES].tolist() == [1.0, 0.0, 1.0, 1.0, -1.0]
    assert out[SCORES].dtype == torch.float32
    assert reward.stats["reward/extra/acc"] == 0.5  # mean over the two DAPO rows that report it
    assert reward.extras["pred"] == [None, None, None, "7", "8"]
    assert "reward/extra/pred" not in reward.stats  # strings are kept, not averaged


def test_verl_form_passes_all_fields():
    seen = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        seen.append((data_source, solution_str, ground_truth, extra_info))
        return extra_info["w"]

    out = FunctionReward(compute_score)(make_batch(["a", "b"], ["x", "y"], ["s1", "s2"], [{"w": 0.25}, {"w": 2}]))
    assert out[SCORES].tolist() == [0.25, 2.0]
    assert sorted(seen) == [("s1", "a", "x", {"w": 0.25}), ("s2", "b", "y", {"w": 2})]


def test_verl_form_without_extra_info_and_positional_names():
    def three(data_source, solution_str, ground_truth):
        return float(data_source == "s" and solution_str == ground_truth)

    def four(ds, text, gt, info):  # other names: detected from arity, called positionally
        return float(ds == "s" and text == gt and info == {"k": 1})

    batch = make_batch(["a", "b"], ["a", "c"], extras=[{"k": 1}, {"k": 1}], sources=["s", "s"])
    assert FunctionReward(three)(batch)[SCORES].tolist() == [1.0, 0.0]
    reward = FunctionReward(four)
    assert reward.form == "verl"
    assert reward(batch)[SCORES].tolist() == [1.0, 0.0]


def test_batch_form():
    calls = []

    def compute_reward(responses, ground_truths):
        calls.append(list(responses))
        return [float(r == g) for r, g in zip(responses, ground_truths)]

    reward = FunctionReward(compute_reward)
    assert reward.form == "batch"
    assert reward(make_batch(["a", "b", "c"], ["a", "x", "c"]))[SCORES].tolist() == [1.0, 0.0, 1.0]
    assert calls == [["a", "b", "c"]]  # one call for the whole batch

    def plural(completions, answers, data_sources=None):
        return [len(c) + (d == "s2") for c, d in zip(completions, data_sources)]

    out = FunctionReward(plural)(make_batch(["ab", "abc"], ["", ""], ["s1", "s2"]))
    assert out[SCORES].tolist() == [2.0, 4.0]


@pytest.mark.parametrize("fn", [exact, lambda solution_str, ground_truth: float(solution_str == ground_truth)])
def test_sample_form(fn):
    reward = FunctionReward(fn)
    assert reward.form == "sample"
    assert reward(make_batch(["a", "b"], ["a", "a"]))[SCORES].tolist() == [1.0, 0.0]


def test_form_override_and_partial():
    reward = FunctionReward(lambda xs, ys: [1.0] * len(xs), form="batch")
    assert reward(make_batch(["a", "b"]))[SCORES].tolist() == [1.0, 1.0]
    bonus = functools.partial(lambda response, ground_truth, bonus: bonus, bonus=3.0)
    assert FunctionReward(bonus)(make_batch(["a"]))[SCORES].tolist() == [3.0]
    with pytest.raises(ValueError, match="form"):
        FunctionReward(exact, form="pairwise")


def test_unusable_signatures_raise_type_error():
    with pytest.raises(TypeError, match="Supported forms"):
        FunctionReward(lambda: 1.0)
    with pytest.raises(TypeError, match="Supported forms"):
        FunctionReward(lambda a, b, c, d, e: 1.0)
    with pytest.raises(TypeError, match="verl"):
        FunctionReward(exact, form="verl")  # two parameters cannot take the verl arguments
    with pytest.raises(TypeError, match="callable"):
        FunctionReward("not a function")


def test_async_functions_are_awaited():
    async def sample(response, ground_truth):
        await asyncio.sleep(0.01)
        return {"score": float(response == ground_truth), "acc": response == ground_truth}

    async def compute_reward(responses, ground_truths):
        return [2.0 for _ in responses]

    batch = make_batch(["a", "b"], ["a", "a"])
    reward = FunctionReward(sample)
    assert reward(batch)[SCORES].tolist() == [1.0, 0.0]
    assert reward.stats["reward/extra/acc"] == 0.5
    assert FunctionReward(compute_reward)(batch)[SCORES].tolist() == [2.0, 2.0]


def test_dict_results_extra_keys_become_stats():
    def fn(response, ground_truth):
        if response == "plain":
            return 0.5  # rows without extras do not count toward the means
        return {"score": 1, "acc": response == ground_truth, "length": len(response), "pred": response,
                "t": torch.tensor(2.0), "np": np.bool_(True), "nan": math.nan if response == "aa" else 1.0}

    reward = FunctionReward(fn)
    out = reward(make_batch(["a", "aa", "aaaa", "plain"], ["a", "x", "aaaa", ""]))
    assert out[SCORES].tolist() == [1.0, 1.0, 1.0, 0.5]
    assert reward.stats["reward/extra/acc"] == pytest.approx(2 / 3)
    assert reward.stats["reward/extra/length"] == pytest.approx(7 / 3)
    assert reward.stats["reward/extra/t"] == 2.0
    assert reward.stats["reward/extra/np"] == 1.0
    assert reward.stats["reward/extra/nan"] == 1.0  # the mean of the finite values
    assert "reward/extra/pred" not in reward.stats
    assert reward.extras["pred"] == ["a", "aa", "aaaa", None]
    assert reward.stats["reward/errors"] == 0 and reward.stats["reward/non_finite"] == 0


def test_constructor_validation():
    with pytest.raises(ValueError, match="on_error"):
        FunctionReward(exact, on_error="ignore")
    with pytest.raises(ValueError, match="max_workers"):
        FunctionReward(exact, max_workers=0)
    with pytest.raises(ValueError, match="timeout_s"):
        FunctionReward(exact, timeout_s=0)
    reward = FunctionReward(exact, timeout_s=None, name="exact-match")
    assert reward(make_batch(["a"], ["a"]))[SCORES].tolist() == [1.0]
    assert "exact-match" in repr(reward)


def test_calls_run_concurrently():
    barrier = threading.Barrier(4, timeout=5)  # breaks unless 4 calls wait at the same time

    def fn(response, ground_truth):
        barrier.wait()
        return 1.0

    reward = FunctionReward(fn, max_workers=4, on_error="raise")
    assert reward(make_batch(["a"] * 4))[SCORES].tolist() == [1.0] * 4


# ---------------------------------------------------------------- failures


def test_raising_function_is_counted_zeroed_and_warned():
    def fn(response, ground_truth):
        if response == "bad":
            raise ValueError("cannot parse")
        return 1.0

    reward = FunctionReward(fn)
    batch = make_batch(["ok", "bad", "ok", "bad"], sources=["s0", "s1", "s2", "s3"])
    with pytest.warns(RewardWarning) as record:
        out = reward(batch)
    assert out[SCORES].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert reward.stats["reward/errors"] == 2
    assert reward.stats["reward/timeouts"] == 0
    message = str(record[0].message)
    assert "row 1" in message and "'s1'" in message and "ValueError: cannot parse" in message and "'fn'" in message
    assert "[1, 3]" in message
    # stats are refreshed on the next call
    reward(make_batch(["ok"]))
    assert reward.stats["reward/errors"] == 0


def test_a_function_that_fails_on_every_sample_stops_with_its_exception_and_the_row():
    """verl stops at a reward function's exception; training on a batch of zeros would only hide it."""
    def fn(response, ground_truth):
        if response == "nan":
            return math.nan
        raise ValueError(f"cannot parse {response!r}")

    reward = FunctionReward(fn)  # on_error="zero": partial failures are scored 0.0 and warned about
    with pytest.raises(RewardError) as info:
        reward(make_batch(["nan", "x", "y"], sources=["s0", "s1", "s2"]))
    message = str(info.value)
    assert "reward function 'fn' failed on every sample of the batch (3 of 3)" in message
    assert "first: row 1 (data_source='s1'): raised ValueError: cannot parse 'x'" in message  # the row that raised
    assert isinstance(info.value.__cause__, ValueError) and str(info.value.__cause__) == "cannot parse 'x'"
    # one row scored: the others are counted and warned about, and the batch goes on
    good = FunctionReward(lambda response, ground_truth: 1.0 if response == "ok" else fn(response, ground_truth))
    with pytest.warns(RewardWarning, match="cannot parse"):
        assert good(make_batch(["x", "ok", "y"]))[SCORES].tolist() == [0.0, 1.0, 0.0]
    assert good.stats["reward/errors"] == 2


def test_on_error_raise_names_row_source_function_and_cause():
    def my_scorer(response, ground_truth):
        if response == "bad":
            raise KeyError("missing")
        return 1.0

    reward = FunctionReward(my_scorer, on_error="raise")
    with pytest.raises(RewardError) as info:
        reward(make_batch(["ok", "ok", "bad"], sources=["a", "b", "openai/gsm8k"]))
    message = str(info.value)
    assert "row 2" in message and "openai/gsm8k" in message and "my_scorer" in message and "KeyError" in message
    assert isinstance(info.value.__cause__, KeyError)


def test_timeout_is_counted_and_does_not_block():
    def slow(response, ground_truth):
        if response == "hang":
            time.sleep(2.0)
        return 1.0

    reward = FunctionReward(slow, timeout_s=0.2, max_workers=2)
    start = time.monotonic()
    with pytest.warns(RewardWarning, match="timed out after 0.2 s"):
        out = reward(make_batch(["a", "hang", "b", "c"]))
    assert time.monotonic() - start < 1.5
    assert out[SCORES].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert reward.stats["reward/timeouts"] == 1 and reward.stats["reward/errors"] == 0


def test_a_batch_of_hanging_calls_gives_up_after_twice_the_timeout_not_a_timeout_per_wave():
    """64 calls of which 60 hang, 4 threads, timeout 0.5 s: waves of time-outs would take 15 x 0.5 = 7.5 s; with
    no call finishing for 2 x 0.5 s the batch gives up on the rest (about 1 s)."""
    release = threading.Event()

    def fn(response, ground_truth):
        if response != "ok":
            release.wait(60)  # hangs (released at the end, so no thread outlives the test for long)
        return 1.0

    reward = FunctionReward(fn, timeout_s=0.5, max_workers=4)
    try:
        start = time.monotonic()
        with pytest.warns(RewardWarning) as caught:
            out = reward(make_batch(["ok"] * 4 + ["hang"] * 60))
        elapsed = time.monotonic() - start
        assert elapsed < 4.0, elapsed
        assert out[SCORES].tolist() == [1.0] * 4 + [0.0] * 60
        assert reward.stats["reward/timeouts"] == 60
        messages = " ".join(str(w.message) for w in caught)
        assert "timed out after 0.5 s" in messages
        assert "not scored: no call of the batch finished for 1.0 s (2 x timeout_s), so the batch gave up" in messages
        # every call hangs: the run stops, saying so, after about 2 x timeout_s
        start = time.monotonic()
        with pytest.raises(RewardError, match=r"failed on every sample of the batch \(64 of 64\).*row 0 \("
                                              r".*timed out after 0.5 s.*the function hangs"):
            reward(make_batch(["hang"] * 64))
        assert time.monotonic() - start < 4.0
    finally:
        release.set()


def test_one_hung_call_on_one_thread_costs_its_timeout_not_the_batch():
    release = threading.Event()

    def fn(response, ground_truth):
        if response == "hang":
            release.wait(60)
        return 1.0

    try:
        reward = FunctionReward(fn, timeout_s=0.3, max_workers=1)
        with pytest.warns(RewardWarning, match="row 0"):
            assert reward(make_batch(["hang", "a", "b", "c"]))[SCORES].tolist() == [0.0, 1.0, 1.0, 1.0]
        assert reward.stats["reward/timeouts"] == 1
    finally:
        release.set()


def test_async_timeout_is_cancelled():
    cancelled = threading.Event()

    async def hang(response, ground_truth):
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    reward = FunctionReward(hang, timeout_s=0.1, on_error="raise")
    with pytest.raises(RewardError, match="row 0.*timed out"):
        reward(make_batch(["a"]))
    assert cancelled.wait(timeout=2.0)  # the coroutine is cancelled, its thread is freed


def test_timeout_counts_from_call_start_not_from_queueing():
    def fn(response, ground_truth):
        time.sleep(0.1)
        return 1.0

    # one worker, three 0.1 s calls: the batch takes 0.3 s, each call well under its 0.25 s limit
    reward = FunctionReward(fn, timeout_s=0.25, max_workers=1, on_error="raise")
    assert reward(make_batch(["a", "b", "c"]))[SCORES].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    ("bad", "counter"),
    [
        (float("nan"), "reward/non_finite"),
        (float("inf"), "reward/non_finite"),
        ({"score": float("-inf")}, "reward/non_finite"),
        ("1.0", "reward/errors"),
        (None, "reward/errors"),
        ([1.0], "reward/errors"),
        ({"acc": 1.0}, "reward/errors"),  # a dict without "score"
    ],
)
def test_bad_results_are_counted(bad, counter):
    reward = FunctionReward(lambda response, ground_truth: bad if response == "x" else True)
    with pytest.warns(RewardWarning, match="row 1"):
        out = reward(make_batch(["ok", "x", "x"]))
    assert out[SCORES].tolist() == [1.0, 0.0, 0.0]
    assert reward.stats[counter] == 2
    assert sum(reward.stats[k] for k in ("reward/errors", "reward/timeouts", "reward/non_finite")) == 2


def test_batch_form_failures():
    def wrong_length(responses, ground_truths):
        return [1.0]

    def broken(responses, ground_truths):
        raise RuntimeError("judge offline")

    batch = make_batch(["a", "b", "c"])
    with pytest.raises(RewardError, match="wrong_length.*returned 1 results for a batch of 3"):
        FunctionReward(wrong_length, on_error="raise")(batch)
    with pytest.raises(RewardError, match="broken.*RuntimeError: judge offline"):
        FunctionReward(broken, on_error="raise")(batch)
    # a failed batch call fails every row: that stops the run even with on_error="zero" (see below)
    with pytest.raises(RewardError, match="broken' failed on every sample of the batch .3 of 3.*the batch call: "
                                          "raised RuntimeError: judge offline") as info:
        FunctionReward(broken)(batch)
    assert isinstance(info.value.__cause__, RuntimeError)
    # a bad item inside a well-formed batch result fails only its row
    reward = FunctionReward(lambda responses, ground_truths: [1.0, math.nan, 0.5])
    with pytest.warns(RewardWarning, match="row 1"):
        assert reward(batch)[SCORES].tolist() == [1.0, 0.0, 0.5]
    assert reward.stats["reward/non_finite"] == 1


# ---------------------------------------------------------------- token rewards and the base


def test_token_rewards_on_last_valid_token():
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 1]])
    scores = [1.0, 2.0, 3.0, 4.0, 5.0]
    reward = FunctionReward(lambda responses, ground_truths: scores)
    out = reward(make_batch(["a"] * 5, mask=mask))
    expected = torch.tensor(
        [[0, 1, 0, 0], [0, 0, 2, 0], [3, 0, 0, 0], [0, 0, 0, 4], [0, 0, 0, 5]], dtype=torch.float32
    )
    assert torch.equal(out[TOKEN_REWARDS], expected)
    assert out[TOKEN_REWARDS].dtype == torch.float32
    assert torch.equal(out[SCORES], torch.tensor(scores))


def test_missing_key_and_base_guard():
    reward = FunctionReward(exact)
    batch = make_batch(["a"])
    del batch[GROUND_TRUTH]
    with pytest.raises(KeyError, match="ground_truth"):
        reward(batch)

    class NanReward(Reward):
        def score(self, batch):
            return torch.tensor([1.0, float("nan")])

    class ShortReward(Reward):
        def score(self, batch):
            return torch.tensor([1.0])

    with pytest.raises(ValueError, match="1 scores for a batch of 2"):
        ShortReward()(make_batch(["a", "b"]))

    nan_reward = NanReward()
    with pytest.warns(RewardWarning, match="row"):
        out = nan_reward(make_batch(["a", "b"]))
    assert out[SCORES].tolist() == [1.0, 0.0]
    assert nan_reward.stats["reward/non_finite"] == 1
