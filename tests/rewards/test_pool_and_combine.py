"""Scoring in worker processes (hung and crashing scorers cost their samples, never the run), TRL-style
reward functions, and weighted combinations of rewards logged part by part."""

import os
import time

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from rlflow.data import keys as K
from rlflow.rewards import CombinedReward, FunctionReward, Reward, RewardError, RewardWarning
from rlflow.rewards.pool import GAVE_UP, WorkerDied, WorkerPool


def make_batch(texts, gts=None, prompts=None, extras=None):
    b = len(texts)
    ids = torch.tensor([[ord(c) for c in t.ljust(4)[:4]] for t in texts])
    mask = torch.tensor([[1] * min(len(t), 4) + [0] * (4 - min(len(t), 4)) for t in texts])
    return TensorDict({
        K.RESPONSE_TEXT: NonTensorStack(*texts), K.RESPONSE_IDS: ids, K.RESPONSE_MASK: mask,
        K.GROUND_TRUTH: NonTensorStack(*(gts or ["x"] * b)), K.DATA_SOURCE: NonTensorStack(*["src"] * b),
        K.EXTRA_INFO: NonTensorStack(*(extras or [None] * b)),
        K.PROMPT_TEXT: NonTensorStack(*(prompts or ["p"] * b)),
    }, batch_size=[b])


def slow_or_crash(response, ground_truth):
    if response == "hang":
        time.sleep(60)
    if response == "die":
        os._exit(3)
    if response == "raise":
        raise ValueError("bad row")
    return float(len(response))


# ---------------------------------------------------------------- worker pool


def test_pool_kills_hung_calls_and_replaces_crashed_workers():
    pool = WorkerPool(slow_or_crash, 2)
    try:
        start = time.monotonic()
        calls = [(("ab", "x"), {}), (("hang", "x"), {}), (("die", "x"), {}), (("raise", "x"), {}), (("abcd", "x"), {})]
        results = pool.map(calls, timeout_s=0.5)
        elapsed = time.monotonic() - start
        assert [s for s, _ in results] == ["ok", "timeout", "error", "error", "ok"]
        assert results[0][1] == 2.0 and results[4][1] == 4.0
        assert isinstance(results[2][1], WorkerDied) and "exit code 3" in str(results[2][1])
        assert isinstance(results[3][1], ValueError)
        assert elapsed < 5  # the hung call cost its time-out, not 60 s
        assert pool.restarts == 2
        assert pool.map([(("abc", "x"), {})], timeout_s=1) == [("ok", 3.0)]  # the pool still works
    finally:
        pool.close()
    assert all(not w.process.is_alive() for w in pool.workers)


def test_pool_runs_closures_and_coroutines():
    offset = 10.0

    async def add(x):
        return x + offset

    pool = WorkerPool(add, 2)
    try:
        assert pool.map([((1,), {}), ((2,), {})], timeout_s=5) == [("ok", 11.0), ("ok", 12.0)]
    finally:
        pool.close()


def test_function_reward_in_processes_counts_timeouts_and_goes_on():
    reward = FunctionReward(slow_or_crash, processes=2, timeout_s=0.5)
    try:
        with pytest.warns(RewardWarning) as caught:
            out = reward(make_batch(["ab", "hang", "die", "abc"]))
        assert out[K.SCORES].tolist() == [2.0, 0.0, 0.0, 3.0]
        assert reward.stats["reward/timeouts"] == 1 and reward.stats["reward/errors"] == 1
        assert any("timed out after 0.5 s" in str(w.message) and "row 1" in str(w.message) for w in caught)
        assert any("worker process ended" in str(w.message) and "row 2" in str(w.message) for w in caught)
    finally:
        reward.close()


def test_function_reward_in_processes_gives_up_on_a_batch_that_only_hangs():
    """16 hanging calls on 2 processes, timeout 0.5 s: timing out in waves would kill and replace the two workers
    8 times (16 restarts); the batch gives up when no call has answered for 2 x 0.5 s, after two waves (4 restarts),
    and the run stops, saying why. Counted, not timed: a wall-clock bound failed on a loaded machine."""
    reward = FunctionReward(slow_or_crash, processes=2, timeout_s=0.5)
    try:
        reward(make_batch(["ab"]))  # the workers are started
        with pytest.raises(RewardError, match=r"every sample of the batch \(16 of 16\).*timed out after 0.5 s"):
            reward(make_batch(["hang"] * 16))
        assert reward._pool.restarts == 4  # two waves of two hung workers, killed and replaced (not 8 waves)
        assert reward(make_batch(["abc"]))[K.SCORES].tolist() == [3.0]  # the pool still works
    finally:
        reward.close()
    pool = WorkerPool(slow_or_crash, 2)
    try:  # the calls that never started come back as given up
        assert pool.map([(("hang", "x"), {})] * 3, timeout_s=0.3, give_up_s=0.5) == [
            ("timeout", None), ("timeout", None), ("timeout", GAVE_UP)]
    finally:
        pool.close()


def test_a_hung_verl_reward_function_does_not_hang_the_trainer_step(tokenizer, model, addition_rows, tmp_path):
    """Issue 10: a reward that never returns: the default time-out scores it 0, counts it, warns, goes on."""
    from tests.trainer.helpers import make_trainer

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str[:1] in "0123":
            time.sleep(3600)
        return 1.0

    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path, max_steps=1, loggers=())
    trainer.reward = FunctionReward(compute_score, timeout_s=0.3)
    with pytest.warns(RewardWarning, match="timed out"):
        history = trainer.fit(data)
    assert history[-1]["reward/timeouts"] > 0
    assert history[-1]["timing_s/reward"] < 5


# ---------------------------------------------------------------- TRL form


def test_trl_form_gets_prompts_completions_and_columns():
    seen = {}

    def length_reward(prompts, completions, completion_ids, ground_truth, **kwargs):
        seen.update(prompts=prompts, ids=completion_ids, gt=ground_truth, kwargs=sorted(kwargs))
        return [None if c == "skip" else float(len(c)) for c in completions]

    reward = FunctionReward(length_reward)
    assert reward.form == "trl"
    out = reward(make_batch(["ab", "skip", "abc"], gts=["1", "2", "3"], prompts=["p1", "p2", "p3"],
                            extras=[{"solution": "s1"}, {"solution": "s2"}, {"solution": "s3"}]))
    assert out[K.SCORES].tolist() == [2.0, 0.0, 3.0]
    assert reward.stats["reward/not_applicable"] == 1 and reward.stats["reward/errors"] == 0
    assert seen["prompts"] == ["p1", "p2", "p3"] and seen["gt"] == ["1", "2", "3"]
    assert seen["ids"][0] == [ord("a"), ord("b")]
    assert seen["kwargs"] == ["data_source", "extra_info", "solution"]  # extra_info keys arrive as columns


def test_trl_form_only_completions_and_kwargs():
    reward = FunctionReward(lambda completions, **kw: [float("b" in c) for c in completions])
    assert reward.form == "trl"
    assert reward(make_batch(["ab", "cd"]))[K.SCORES].tolist() == [1.0, 0.0]


# ---------------------------------------------------------------- combinations


class Constant(Reward):
    thread_safe = False

    def __init__(self, value, name):
        super().__init__()
        self.value, self.name = value, name

    def score(self, batch):
        self.stats["reward/errors"] += 1
        return torch.full((batch.batch_size[0],), self.value)


def test_weighted_sum_logs_each_part_under_its_name():
    def correct(response, ground_truth):
        return {"score": float(response == ground_truth), "acc": response == ground_truth}

    def short(completions, **kwargs):
        return [-len(c) / 10 for c in completions]

    reward = CombinedReward([correct, short, Constant(0.5, "bonus")], weights=[1.0, 2.0, -1.0])
    assert reward.names == ["correct", "short", "bonus"]
    batch = make_batch(["ab", "xyz"], gts=["ab", "b"])
    out = reward(batch)
    # independently: 1*correct + 2*short - 1*0.5
    expected = [1.0 + 2 * -0.2 - 0.5, 0.0 + 2 * -0.3 - 0.5]
    assert out[K.SCORES].tolist() == pytest.approx(expected)
    assert out[K.TOKEN_REWARDS][0, 1].item() == pytest.approx(expected[0])  # on the last response token
    stats = reward.stats
    assert stats["reward/correct/mean"] == 0.5 and stats["reward/short/mean"] == pytest.approx(-0.25)
    assert stats["reward/bonus/max"] == 0.5 and stats["reward/bonus/errors"] == 1
    assert stats["reward/errors"] == 1  # summed over parts
    assert stats["reward/correct/extra/acc"] == 0.5
    assert reward.extras["acc"] == [True, False]  # one part has acc: validation and dynamic sampling read it
    assert reward.extras["short"] == pytest.approx([-0.2, -0.3])


def test_named_parts_weights_by_name_and_errors():
    reward = CombinedReward({"a": Constant(1.0, "x"), "b": Constant(3.0, "y")}, weights={"b": 0.5})
    assert reward(make_batch(["q"]))[K.SCORES].tolist() == [2.5]
    with pytest.raises(ValueError, match="unknown reward"):
        CombinedReward({"a": Constant(1.0, "x")}, weights={"c": 1.0})
    with pytest.raises(ValueError, match="2 weights for 1 rewards"):
        CombinedReward([Constant(1.0, "x")], weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="finite"):
        CombinedReward([Constant(1.0, "x")], weights=[float("nan")])
    assert CombinedReward([Constant(1.0, "x"), Constant(1.0, "x")]).names == ["x", "x_2"]
