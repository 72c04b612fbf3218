"""GDPO (estimator) and DPPO (dppo_tv / dppo_kl losses) against values worked out from verl 0.9.1's formulas
(``verl/trainer/ppo/core_algos.py``: compute_gdpo_outcome_advantage, compute_policy_loss_dppo_tv / _kl)."""

import math

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from rlflow.algorithms import GDPO, DPPOKLLoss, DPPOTVLoss, PPOLoss
from rlflow.data.keys import (ADVANTAGES, DATA_SOURCE, EXTRA_INFO, GROUND_TRUTH, GROUP, LOG_PROBS, OLD_LOG_PROBS,
                              REWARD_COLUMN, RESPONSE_MASK, RESPONSE_TEXT)
from rlflow.registry import ESTIMATORS, POLICY_LOSSES
from rlflow.rewards import FunctionReward


def gdpo_batch(fmt, acc, group, mask):
    return TensorDict({REWARD_COLUMN + "format_reward": torch.tensor(fmt), REWARD_COLUMN + "accuracy_reward":
                       torch.tensor(acc), GROUP: torch.tensor(group), RESPONSE_MASK: mask}, batch_size=[len(fmt)])


def test_gdpo_normalises_each_key_in_its_group_then_whitens_the_sum():
    # two groups of two; format separates group 0, accuracy separates group 1
    mask = torch.tensor([[1., 1., 0.], [1., 0., 0.], [1., 1., 1.], [1., 1., 0.]])
    batch = gdpo_batch([1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 3.0, -3.0], [0, 0, 1, 1], mask)
    out = GDPO(["format_reward", "accuracy_reward"], reward_weights=[1.0, 2.0])(batch)[ADVANTAGES]
    # by hand: group std of (1, 0) is sqrt(0.5); of (3, -3) sqrt(18); identical values give 0
    e = 1e-6
    fmt = [0.5 / (math.sqrt(0.5) + e), -0.5 / (math.sqrt(0.5) + e), 0.0, 0.0]
    acc = [0.0, 0.0, 3 / (math.sqrt(18) + e), -3 / (math.sqrt(18) + e)]
    summed = [f + 2 * a for f, a in zip(fmt, acc)]
    tokens = [summed[i] for i in range(4) for t in range(3) if mask[i, t]]
    mean = sum(tokens) / len(tokens)
    var = sum((x - mean) ** 2 for x in tokens) / (len(tokens) - 1)
    expected = torch.tensor([[(summed[i] - mean) / math.sqrt(var + 1e-8) * mask[i, t].item() for t in range(3)]
                             for i in range(4)])
    torch.testing.assert_close(out, expected)
    # not GRPO of the summed score: that would give group 1's rows +-1 and group 0's +-1 before whitening
    assert ESTIMATORS.resolve("gdpo") is GDPO


def test_gdpo_needs_its_keys_and_matching_weights():
    with pytest.raises(ValueError, match="gdpo_reward_keys"):
        GDPO(None)
    with pytest.raises(ValueError, match="gdpo_reward_weights"):
        GDPO(["a", "b"], reward_weights=[1.0])


def rlla_like(data_source, solution_str, ground_truth, extra_info=None):
    fmt = float(solution_str.startswith("<"))
    return {"score": fmt + float(solution_str.endswith(ground_truth)), "format_reward": fmt,
            "accuracy_reward": float(solution_str.endswith(ground_truth))}


def reward_batch(texts):
    b = len(texts)
    return TensorDict({RESPONSE_TEXT: NonTensorStack(*texts), GROUND_TRUTH: NonTensorStack(*["7"] * b),
                       DATA_SOURCE: NonTensorStack(*["s"] * b), EXTRA_INFO: NonTensorStack(*[None] * b),
                       RESPONSE_MASK: torch.ones(b, 2), GROUP: torch.tensor([0, 0, 1, 1])}, batch_size=[b])


def test_reward_columns_carry_the_scorer_keys_to_gdpo():
    reward = FunctionReward(rlla_like)
    reward.columns = ("format_reward", "accuracy_reward")
    batch = reward(reward_batch(["<a 7", "b 7", "<c 1", "<d 7"]))
    assert batch[REWARD_COLUMN + "format_reward"].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert batch[REWARD_COLUMN + "accuracy_reward"].tolist() == [1.0, 1.0, 0.0, 1.0]
    adv = GDPO(["format_reward", "accuracy_reward"])(batch)[ADVANTAGES]
    assert adv[0, 0] > 0 > adv[1, 0] and adv[3, 0] > 0 > adv[2, 0]
    reward.columns = ("missing",)
    with pytest.raises(KeyError, match="'missing'.*format_reward"):
        reward(reward_batch(["<a 7", "b 7", "<c 1", "<d 7"]))


def loss_batch(logp, old, adv):
    logp = torch.tensor([logp], requires_grad=True)
    return TensorDict({LOG_PROBS: logp, OLD_LOG_PROBS: torch.tensor([old]), ADVANTAGES: torch.tensor([adv]),
                       RESPONSE_MASK: torch.ones(1, len(adv))}, batch_size=[1]), logp


LOGP = [math.log(0.5), math.log(0.9), math.log(0.2), math.log(0.3)]
OLD = [math.log(0.3), math.log(0.85), math.log(0.6), math.log(0.31)]
ADV = [1.0, 1.0, -1.0, -2.0]


def test_dppo_tv_masks_tokens_past_the_probability_change():
    batch, logp = loss_batch(LOGP, OLD, ADV)
    out = DPPOTVLoss(clip_ratio=0.15, clip_ratio_c=10.0)(batch)
    # p - q: +0.2 (A>0: past 0.15, masked), +0.05 (kept), -0.4 (A<0: past -0.15, masked), -0.01 (kept)
    ratios = [0.9 / 0.85, 0.3 / 0.31]
    expected = -(1.0 * ratios[0] * LOGP[1] + -2.0 * ratios[1] * LOGP[3]) / 4
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    assert out.stats["actor/pg_clipfrac"] == pytest.approx(0.5)
    out.loss.backward()  # gradient -A * sg(r) / N on kept tokens only
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -ratios[0] / 4, 0.0, 2 * ratios[1] / 4]]))
    assert POLICY_LOSSES.resolve("dppo_tv") is DPPOTVLoss


def binary_kl(q, p):
    return q * math.log(q / p) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))


def test_dppo_kl_masks_by_binary_kl_in_the_advantage_direction():
    batch, _ = loss_batch(LOGP, OLD, ADV)
    out = DPPOKLLoss(clip_ratio=0.05, clip_ratio_c=10.0)(batch)
    probs, olds = [0.5, 0.9, 0.2, 0.3], [0.3, 0.85, 0.6, 0.31]
    kept = []
    for p, q, a in zip(probs, olds, ADV):
        kl = binary_kl(q, p)
        kept.append((kl <= 0.05 or p <= q) if a > 0 else (kl <= 0.05 or p >= q))
    assert kept == [False, True, False, True]  # kl: 0.174, 0.0083, 0.376, 0.0005
    expected = -sum(a * min(p / q, 10.0) * lp for a, p, q, lp, k in zip(ADV, probs, olds, LOGP, kept) if k) / 4
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)


def test_dppo_truncates_the_ratio_at_clip_ratio_c():
    batch, _ = loss_batch([math.log(0.12)], [math.log(0.04)], [1.0])  # r = 3, p - q = 0.08 (kept)
    assert DPPOTVLoss(clip_ratio_c=2.0)(batch).loss.item() == pytest.approx(-2.0 * math.log(0.12), rel=1e-5)
    assert DPPOTVLoss(clip_ratio_c=10.0)(batch).loss.item() == pytest.approx(-3.0 * math.log(0.12), rel=1e-5)
    # vanilla PPO clips this token instead
    assert PPOLoss()(batch).loss.item() == pytest.approx(-1.2, rel=1e-5)
