"""DAPO: dynamic sampling (group filtering, more prompt batches, the cap) and overlong reward shaping.

Clip-higher and token-mean are tested in test_policy_losses.py (``test_dapo_clip_higher_by_hand`` and
the micro-batch test of the "dapo" loss)."""

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from rlflow.data import keys as K
from rlflow.module import BatchModule
from rlflow.rewards import FunctionReward, OverlongPenalty
from rlflow.rewards.overlong import overlong_penalty, response_lengths
from rlflow.rollout import DynamicSampling
from rlflow.rollout.dynamic_sampling import first_groups, informative_rows

PAD = 0


class Tok:
    pad_token_id, eos_token_id = PAD, 2


def prompts(kinds, width=3):
    """One prompt per kind: 'easy' (all samples right), 'hard' (all wrong), 'mixed' (every other one right)."""
    p = len(kinds)
    return TensorDict({
        K.PROMPT_IDS: torch.arange(1, p * width + 1).view(p, width),
        K.PROMPT_MASK: torch.ones(p, width, dtype=torch.long),
        K.PROMPT_TEXT: NonTensorStack(*[f"q{i}" for i in range(p)]),
        K.GROUND_TRUTH: NonTensorStack(*kinds),
        K.DATA_SOURCE: NonTensorStack(*["test"] * p),
        K.EXTRA_INFO: NonTensorStack(*[None] * p),
    }, batch_size=[p])


class ScriptedRollout(BatchModule):
    """n samples per prompt without a model; sample j's text is str(j); responses are ``length`` tokens."""

    in_keys = (K.PROMPT_IDS, K.PROMPT_MASK)
    out_keys = (K.RESPONSE_IDS, K.RESPONSE_MASK, K.ROLLOUT_LOG_PROBS, K.GROUP, K.RESPONSE_TEXT)
    temperature, tokenizer = 1.0, Tok()

    def __init__(self, n, lengths=(2, 3, 4), vary=False):
        self.n, self.lengths, self.calls, self.vary = n, list(lengths), 0, vary

    def forward(self, batch):
        length = self.lengths[self.calls % len(self.lengths)]
        self.calls += 1
        p = batch.batch_size[0]
        out = batch.repeat_interleave(self.n, dim=0)
        out[K.RESPONSE_IDS] = torch.full((p * self.n, length), 7)
        out[K.RESPONSE_MASK] = torch.ones(p * self.n, length, dtype=torch.long)
        if self.vary:  # odd samples stop one token earlier
            out[K.RESPONSE_MASK][1::2, -1] = 0
        out[K.ROLLOUT_LOG_PROBS] = torch.full((p * self.n, length), -0.5)
        out[K.GROUP] = torch.arange(p).repeat_interleave(self.n)
        out[K.RESPONSE_TEXT] = NonTensorStack(*[str(j) for _ in range(p) for j in range(self.n)])
        return out


def by_kind(response: str, ground_truth: str) -> float:
    return {"easy": 1.0, "hard": 0.0, "mixed": float(int(response) % 2)}[ground_truth]


def test_informative_rows_and_first_groups():
    metric = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 3.0])
    group = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    rows, kept, total = informative_rows(metric, group)
    # group 0 constant, 1 mixed, 2 constant, 3 a single sample (kept, as verl)
    assert rows.tolist() == [False, False, True, True, False, False, True] and (kept, total) == (2, 4)
    batch = TensorDict({K.GROUP: torch.tensor([5, 5, 9, 9, 4, 4]), "v": torch.arange(6)}, batch_size=[6])
    out = first_groups(batch, 2)
    assert out["v"].tolist() == [0, 1, 2, 3] and out[K.GROUP].tolist() == [0, 0, 1, 1]


def test_dynamic_sampling_filters_and_pulls_more_batches():
    rollout = ScriptedRollout(n=4)
    sampler = DynamicSampling(rollout, FunctionReward(by_kind), metric="score", max_gen_batches=3)
    later = iter([prompts(["mixed", "hard", "mixed", "mixed"], width=5), prompts(["mixed"] * 4)])
    sampler.bind_prompts(later)
    out = sampler(prompts(["easy", "mixed", "hard", "mixed"]))
    # round 1 keeps q1, q3 (2 of 4 groups); round 2 keeps q0, q2, q3: 5 >= 4, cut to the first 4 groups
    assert out.batch_size[0] == 16 and rollout.calls == 2
    assert out[K.GROUP].tolist() == [g for g in range(4) for _ in range(4)]
    assert list(out[K.PROMPT_TEXT])[::4] == ["q1", "q3", "q0", "q2"]
    assert list(out[K.GROUND_TRUTH])[::4] == ["mixed"] * 4
    assert out[K.SCORES].view(4, 4).tolist() == [[0.0, 1.0, 0.0, 1.0]] * 4
    # widths joined: prompts left-padded to 5, responses right-padded to 3 (the round-1 rows had 2 tokens)
    assert out[K.PROMPT_IDS].shape[1] == 5 and out[K.PROMPT_MASK][0].tolist() == [0, 0, 1, 1, 1]
    assert out[K.PROMPT_IDS][0, :2].tolist() == [PAD, PAD]
    assert out[K.RESPONSE_MASK][0].tolist() == [1, 1, 0] and out[K.RESPONSE_MASK][-1].tolist() == [1, 1, 1]
    assert out[K.RESPONSE_IDS][0].tolist() == [7, 7, PAD] and out[K.TOKEN_REWARDS][1].tolist() == [0.0, 1.0, 0.0]
    assert sampler.stats["dapo/num_gen_batches"] == 2.0
    assert sampler.stats["dapo/kept_group_frac"] == pytest.approx(5 / 8)
    # 32 generated samples: round 1 scores 4 + 0 + 2 + 2, round 2 2 + 0 + 2 + 2 -> 14 / 32
    assert sampler.stats["dapo/gen_score_mean"] == pytest.approx(14 / 32)
    assert sampler.stats["reward/errors"] == 0.0


def test_dynamic_sampling_keeps_groups_apart_across_rounds():
    # both rounds keep their prompt 0: the two groups must stay two groups (ids are offset per round)
    sampler = DynamicSampling(ScriptedRollout(n=2), FunctionReward(by_kind))
    sampler.bind_prompts(iter([prompts(["mixed", "easy"])]))
    out = sampler(prompts(["mixed", "hard"]))
    assert out[K.GROUP].tolist() == [0, 0, 1, 1] and sampler.stats["dapo/num_gen_batches"] == 2


def test_dynamic_sampling_one_round_when_enough():
    sampler = DynamicSampling(ScriptedRollout(n=2), FunctionReward(by_kind))
    out = sampler(prompts(["mixed", "mixed"]))  # no loader bound: not needed
    assert out.batch_size[0] == 4 and sampler.stats["dapo/num_gen_batches"] == 1.0


def test_dynamic_sampling_cap_and_missing_loader():
    sampler = DynamicSampling(ScriptedRollout(n=2), FunctionReward(by_kind), max_gen_batches=3)
    with pytest.raises(RuntimeError, match="bind_prompts"):
        sampler(prompts(["easy", "mixed"]))
    sampler.bind_prompts(iter([prompts(["hard", "easy"]), prompts(["easy", "hard"])]))
    cap = r"3 generation batches \(max_gen_batches\) gave only 1 .* out of 6 .* 2 are needed"
    with pytest.raises(RuntimeError, match=cap):
        sampler(prompts(["easy", "mixed"]))
    with pytest.raises(ValueError, match="max_gen_batches"):
        DynamicSampling(ScriptedRollout(n=2), FunctionReward(by_kind), max_gen_batches=0)


def test_dynamic_sampling_metric_from_extras():
    # an all-correct group whose samples have lengths 4 and 3: shaped scores 1 - 1 = 0 and 1 - 0.5 = 0.5
    # differ, so metric="score" keeps it; its "acc" (the unshaped score, verl's DAPO choice) is constant
    reward = OverlongPenalty(FunctionReward(by_kind), max_response_length=4, buffer_len=2)
    rollout = ScriptedRollout(n=2, lengths=(4,), vary=True)
    out = DynamicSampling(rollout, reward, metric="score")(prompts(["easy"]))
    assert out[K.SCORES].tolist() == [0.0, 0.5]
    sampler = DynamicSampling(rollout, reward, metric="acc")
    sampler.bind_prompts(iter([prompts(["mixed"])]))
    out = sampler(prompts(["easy"]))
    assert list(out[K.GROUND_TRUTH]) == ["mixed", "mixed"] and sampler.stats["dapo/num_gen_batches"] == 2
    sampler = DynamicSampling(rollout, reward, metric="nope")
    with pytest.raises(KeyError, match="nope"):
        sampler(prompts(["mixed"]))


def test_dynamic_sampling_delegates_to_the_rollout():
    rollout, reward = ScriptedRollout(n=2), FunctionReward(by_kind)
    sampler = DynamicSampling(rollout, reward)
    assert sampler.temperature == 1.0 and sampler.n == 2 and sampler.tokenizer is rollout.tokenizer
    assert set(sampler.out_keys) >= {K.SCORES, K.TOKEN_REWARDS, K.GROUP}


# ---------------------------------------------------------------- overlong shaping


def test_overlong_penalty_by_hand():
    # max_len 6, buffer 2: expected length 4; no penalty up to 4, -0.5 * factor at 5, -factor at 6
    lengths = torch.tensor([1, 3, 4, 5, 6, 8])
    torch.testing.assert_close(overlong_penalty(lengths, 6, 2, 1.0), torch.tensor([0.0, 0.0, 0.0, -0.5, -1.0, -1.0]))
    torch.testing.assert_close(overlong_penalty(lengths, 6, 2, 0.5), torch.tensor([0.0, 0.0, 0.0, -0.25, -0.5, -0.5]))
    # buffer 4 of max 8: expected 4; L = 7 -> -(7 - 4) / 4 = -0.75
    assert overlong_penalty(torch.tensor([7]), 8, 4).item() == pytest.approx(-0.75)


def test_response_lengths_count_inner_masked_tokens():
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]])
    assert response_lengths(mask).tolist() == [2, 4, 0, 4]  # row 1: a tool span inside still counts


def test_overlong_penalty_reward():
    batch = ScriptedRollout(n=2, lengths=(5,))(prompts(["easy", "hard"]))
    batch[K.RESPONSE_MASK][1, 3:] = 0  # sample 1 of q0 stops after 3 tokens
    reward = OverlongPenalty(FunctionReward(by_kind), max_response_length=6, buffer_len=2, penalty_factor=1.0)
    out = reward(batch)
    # lengths [5, 3, 5, 5]: penalties [-0.5, 0, -0.5, -0.5] added to scores [1, 1, 0, 0]
    torch.testing.assert_close(out[K.SCORES], torch.tensor([0.5, 1.0, -0.5, -0.5]))
    assert out[K.TOKEN_REWARDS][1].tolist() == [0.0, 0.0, 1.0, 0.0, 0.0]  # on the last valid token
    assert reward.extras["acc"] == [1.0, 1.0, 0.0, 0.0]
    assert reward.extras["overlong_reward"] == [-0.5, 0.0, -0.5, -0.5]
    assert reward.stats["reward/overlong_frac"] == 0.75
    assert reward.stats["reward/extra/acc"] == 0.5
    with pytest.raises(ValueError, match="buffer_len"):
        OverlongPenalty(FunctionReward(by_kind), max_response_length=4, buffer_len=5)
