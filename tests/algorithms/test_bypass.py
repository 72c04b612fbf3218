"""Bypass mode (verl rollout_correction.bypass_mode): the sampler's log-probs as the old policy, the loss
(PPO-clip or REINFORCE) against them, by hand from verl's compute_policy_loss_bypass_mode; the Trainer skips
its old-log-prob pass."""

import copy
import math

import pytest
import torch
from tensordict import TensorDict

from rlflow import GRPO, Batching, FunctionReward, HFRollout, Loop, Optim, Policy, PromptData, RunDir, Trainer
from rlflow.algorithms import (
    Aggregation,
    BypassLoss,
    PPOLoss,
    RejectionSampling,
    RolloutAsOld,
    TruncatedIS,
)
from rlflow.data import keys as K
from rlflow.module import Chain
from tests.trainer.helpers import starts_with_digit

LP = [[-1.0, -0.5, -2.0], [-0.3, -1.2, -0.8]]  # the current policy
ROLLOUT = [[-1.2, -0.5, -1.0], [-0.3, -0.4, -3.0]]  # the sampler: log-ratios 0.2, 0, -1 | 0, -0.8, (2.2)
MASK = [[1, 1, 1], [1, 1, 0]]
ADV = [[1.0] * 3, [-1.0] * 3]
N_TOK, N_SEQ = 5, 2  # the mini-batch's counts, before rejection (verl's global batch info)
AGG = Aggregation(num_tokens=N_TOK, num_seqs=N_SEQ)


def batch():
    lp = torch.tensor(LP, requires_grad=True)
    return lp, TensorDict({K.LOG_PROBS: lp, K.ROLLOUT_LOG_PROBS: torch.tensor(ROLLOUT), K.ADVANTAGES: torch.tensor(ADV),
                           K.RESPONSE_MASK: torch.tensor(MASK)}, batch_size=[2])


def tokens(mask=MASK):
    return [(i, j) for i in range(2) for j in range(3) if mask[i][j]]


def ppo_token(a, r, clip=0.2, clip_c=3.0):
    """verl compute_policy_loss_vanilla for one token: dual-clip PPO."""
    ratio = math.exp(r)
    loss = max(-a * ratio, -a * min(max(ratio, 1 - clip), 1 + clip))
    return min(loss, -a * clip_c) if a < 0 else loss


def test_ppo_clip_is_ppo_against_the_sampler_with_the_rejection_mask():
    _, b = batch()
    rs = RejectionSampling("token_k1", "0.6_1.6")
    out = BypassLoss("ppo_clip", weights=TruncatedIS("token", 2.0), rejection=rs)(b, AGG)
    # token_k1 = -(lp - rollout) kept in [log 0.6, log 1.6]: the -1 and -0.8 log-ratios are rejected
    kept = [(0, 0), (0, 1), (1, 0)]
    want = sum(ppo_token(ADV[i][0], LP[i][j] - ROLLOUT[i][j]) for i, j in kept) / N_TOK
    assert out.loss.item() == pytest.approx(want)
    assert out.stats["actor/ppo_kl"] == pytest.approx(sum(ROLLOUT[i][j] - LP[i][j] for i, j in kept) / 3)
    # the weights are for their metrics only: the ratio is the correction (verl: no double counting)
    _, plain = batch()
    assert BypassLoss("ppo_clip", rejection=rs)(plain, AGG).loss.item() == pytest.approx(want)
    assert out.stats["rollout_corr/rollout_is_max"] == pytest.approx(math.exp(0.2))  # pi / pi_rollout, current
    assert out.stats["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 5)
    # off-policy metrics between the current policy and the sampler, over the unrejected mask
    assert out.stats["rollout_corr/kl"] == pytest.approx(sum(ROLLOUT[i][j] - LP[i][j] for i, j in tokens()) / 5)
    assert out.stats["rollout_corr/k3_kl"] == pytest.approx(
        sum(math.exp(LP[i][j] - ROLLOUT[i][j]) - (LP[i][j] - ROLLOUT[i][j]) - 1 for i, j in tokens()) / 5)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_reinforce_weights_log_prob_by_truncated_is(level):
    lp, b = batch()
    out = BypassLoss("reinforce", weights=TruncatedIS(level, 2.0))(b, AGG)
    r = [[LP[i][j] - ROLLOUT[i][j] for j in range(3)] for i in range(2)]
    if level == "token":
        w = [[min(math.exp(x), 2.0) for x in row] for row in r]
    else:  # one weight per sequence: the summed log-ratio over its valid tokens
        w = [[min(math.exp(sum(x for x, m in zip(row, mrow) if m)), 2.0)] * 3 for row, mrow in zip(r, MASK)]
    want = sum(-ADV[i][j] * w[i][j] * LP[i][j] for i, j in tokens()) / N_TOK
    assert out.loss.item() == pytest.approx(want)
    out.loss.backward()  # -A * sg(w) * logp: the weights are constants
    grad = [[-ADV[i][j] * w[i][j] / N_TOK if MASK[i][j] else 0.0 for j in range(3)] for i in range(2)]
    torch.testing.assert_close(lp.grad, torch.tensor(grad))
    assert out.stats["actor/ppo_kl"] == pytest.approx(sum(ROLLOUT[i][j] - LP[i][j] for i, j in tokens()) / 5)


def test_reinforce_without_weights_is_plain_reinforce_on_the_kept_tokens():
    _, b = batch()
    out = BypassLoss("reinforce", rejection=RejectionSampling("token_k1", "0.6_1.6"))(b, AGG)
    kept = [(0, 0), (0, 1), (1, 0)]
    assert out.loss.item() == pytest.approx(sum(-ADV[i][j] * LP[i][j] for i, j in kept) / N_TOK)


def test_keys_and_bad_arguments():
    loss = BypassLoss()
    assert K.ROLLOUT_LOG_PROBS in loss.in_keys and K.OLD_LOG_PROBS not in loss.in_keys
    with pytest.raises(ValueError, match="loss_type 'ppo'.*ppo_clip, reinforce"):
        BypassLoss("ppo")
    with pytest.raises(ValueError, match="is_weights"):
        BypassLoss(is_weights=True)
    with pytest.raises(TypeError, match="TruncatedIS"):
        BypassLoss(weights=2.0)


def test_trainer_skips_the_old_log_prob_pass(model, tokenizer, addition_rows, tmp_path):
    def trainer(estimator, loss):
        return Trainer(
            Policy(copy.deepcopy(model), tokenizer), HFRollout(n=4, max_new_tokens=4),
            FunctionReward(starts_with_digit), estimator, loss, optim=Optim(lr=1e-3),
            batching=Batching(batch_size=8, mini_batch_size=4, ppo_epochs=2),
            loop=Loop(max_steps=1, seed=0, progress=False), run=RunDir(path=tmp_path, loggers=()),
        )

    t = trainer(Chain(RolloutAsOld(), GRPO()), BypassLoss("reinforce", weights=TruncatedIS("sequence")))
    assert not t.needs_old_log_probs  # two mini-batches, two epochs: verl would recompute old log-probs; bypass not
    [metrics] = t.fit(PromptData(addition_rows[0], seed=0))
    assert "timing_s/old_log_prob" not in metrics and math.isfinite(metrics["actor/pg_loss"])
    assert "rollout_corr/rollout_is_mean" in metrics and "rollout_corr/k3_kl" in metrics  # from the loss
    assert "training/rollout_probs_diff_max" not in metrics  # verl logs these only with an old-log-prob pass
    assert trainer(GRPO(), PPOLoss()).needs_old_log_probs  # without RolloutAsOld: the pass
