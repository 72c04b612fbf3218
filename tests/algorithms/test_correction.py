"""Truncated importance sampling: weights and metrics by hand and against a loop, edge cases,
the weighted PPO loss, and the chain check that catches a loss wanting weights nobody writes."""

import math

import pytest
import torch
from tensordict import TensorDict

from rlflow.algorithms import GRPO, PPOLoss, TruncatedIS
from rlflow.algorithms import functional as F
from rlflow.algorithms.correction import parse_is_threshold, truncated_is_weights
from rlflow.data import keys as K
from rlflow.module import Chain, MissingKeyError
from tests.trainer.helpers import make_trainer


def test_token_level_by_hand():
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    rollout = torch.tensor([[-1.5, -1.0, -0.5, -9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    w, stats = truncated_is_weights(old, rollout, mask, "token", threshold=1.5)
    # log-ratios 0.5, -1, 0 (the padding's 6 is masked): e^0.5 = 1.6487 truncated to 1.5, e^-1, 1
    torch.testing.assert_close(w, torch.tensor([[1.5, math.exp(-1), 1.0, 0.0]]))
    raw = [math.exp(0.5), math.exp(-1), 1.0]  # stats are before truncation (verl)
    torch.testing.assert_close(stats["rollout_is_mean"].item(), sum(raw) / 3)
    torch.testing.assert_close(stats["rollout_is_max"].item(), math.exp(0.5))
    torch.testing.assert_close(stats["rollout_is_min"].item(), math.exp(-1))
    torch.testing.assert_close(stats["rollout_is_ratio_fraction_high"].item(), 1 / 3)  # truncated
    torch.testing.assert_close(stats["rollout_is_ratio_fraction_low"].item(), 1 / 3)  # e^-1 < 1/1.5


def test_sequence_level_by_hand():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]])
    rollout = torch.tensor([[-1.5, -1.0, -4.0], [-1.3, -1.4, -1.2]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    w, stats = truncated_is_weights(old, rollout, mask, "sequence", threshold=2.0)
    # row 0: 0.5 - 1 = -0.5 (the masked 3.5 ignored) -> e^-0.5 on both valid tokens
    # row 1: 0.3 + 0.4 + 0.2 = 0.9 -> e^0.9 = 2.46, truncated to 2
    a, b = math.exp(-0.5), math.exp(0.9)
    torch.testing.assert_close(w, torch.tensor([[a, a, 0.0], [2.0, 2.0, 2.0]]))
    torch.testing.assert_close(stats["rollout_is_mean"].item(), (2 * a + 3 * b) / 5)  # over tokens
    torch.testing.assert_close(stats["rollout_is_max"].item(), b)
    torch.testing.assert_close(stats["rollout_is_min"].item(), a)
    torch.testing.assert_close(stats["rollout_is_ratio_fraction_high"].item(), 0.5)  # of sequences
    torch.testing.assert_close(stats["rollout_is_ratio_fraction_low"].item(), 0.0)  # e^-0.5 > 1/2


def test_log_ratio_is_clamped_at_20():
    old, rollout, mask = torch.tensor([[0.0, 0.0]]), torch.tensor([[-30.0, 30.0]]), torch.ones(1, 2)
    w, stats = truncated_is_weights(old, rollout, mask, "token", threshold=5.0)
    torch.testing.assert_close(w, torch.tensor([[5.0, math.exp(-20)]]))
    torch.testing.assert_close(stats["rollout_is_max"], torch.tensor(math.exp(20)))
    w, _ = truncated_is_weights(old, torch.tensor([[-30.0, 5.0]]), mask, "sequence", threshold=1e9)
    torch.testing.assert_close(w, torch.full((1, 2), math.exp(20)))  # sum 25 clamped to 20


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_matches_loop(level):
    gen = torch.Generator().manual_seed(0)
    b, r, c = 7, 6, 1.3
    old = torch.randn(b, r, generator=gen, dtype=torch.float64) * 0.3
    rollout = old + torch.randn(b, r, generator=gen, dtype=torch.float64) * 0.3
    mask = (torch.rand(b, r, generator=gen) < 0.7).double()
    mask[1] = 0
    w, stats = truncated_is_weights(old, rollout, mask, level, threshold=c)
    units, token_raw = [], []
    for i in range(b):
        valid = [t for t in range(r) if mask[i, t]]
        seq = math.exp(sum(old[i, t].item() - rollout[i, t].item() for t in valid))
        for t in range(r):
            raw = math.exp(old[i, t].item() - rollout[i, t].item()) if level == "token" else seq
            torch.testing.assert_close(w[i, t].item(), min(raw, c) if mask[i, t] else 0.0)
            if mask[i, t]:
                token_raw.append(raw)
                if level == "token":
                    units.append(raw)
        if level == "sequence" and valid:
            units.append(seq)
    torch.testing.assert_close(stats["rollout_is_mean"].item(), sum(token_raw) / len(token_raw))
    torch.testing.assert_close(stats["rollout_is_max"].item(), max(units))
    torch.testing.assert_close(stats["rollout_is_min"].item(), min(units))
    torch.testing.assert_close(stats["rollout_is_ratio_fraction_high"].item(), sum(u > c for u in units) / len(units))
    torch.testing.assert_close(stats["rollout_is_ratio_fraction_low"].item(), sum(u < 1 / c for u in units) / len(units))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_empty_mask_gives_zero_weights_and_stats(level):
    w, stats = truncated_is_weights(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3), level)
    assert torch.equal(w, torch.zeros(2, 3))
    assert all(v.item() == 0.0 for v in stats.values()), stats


def test_weights_are_detached():
    old = torch.randn(2, 3, requires_grad=True)
    w, _ = truncated_is_weights(old, torch.zeros(2, 3), torch.ones(2, 3), "token")
    assert not w.requires_grad


def test_module_writes_weights_and_rollout_corr_stats():
    old, rollout = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    batch = TensorDict({K.OLD_LOG_PROBS: old, K.ROLLOUT_LOG_PROBS: rollout, K.RESPONSE_MASK: torch.ones(1, 2)}, [1])
    module = TruncatedIS(level="token", threshold=1.5)
    assert set(module.in_keys) == {K.OLD_LOG_PROBS, K.ROLLOUT_LOG_PROBS, K.RESPONSE_MASK}
    assert module.out_keys == (K.IS_WEIGHTS,) and K.IS_WEIGHTS == "is_weights"
    out = module(batch)
    torch.testing.assert_close(out[K.IS_WEIGHTS], torch.tensor([[1.5, math.exp(-1)]]))
    assert module.stats["rollout_corr/rollout_is_max"] == pytest.approx(math.exp(0.5))
    assert module.stats["rollout_corr/rollout_is_ratio_fraction_high"] == 0.5
    assert set(module.stats) == {f"rollout_corr/rollout_is_{k}" for k in
                                 ("mean", "max", "min", "ratio_fraction_high", "ratio_fraction_low")}
    with pytest.raises(ValueError, match="unknown IS level"):
        TruncatedIS(level="geometric")
    with pytest.raises(ValueError, match="threshold"):
        TruncatedIS(threshold=0.0)


# ---------------------------------------------------------------- verl's 'lower_upper' threshold and batch normalisation

@pytest.mark.parametrize("spec, want", [(2.0, (2.0, None)), (3, (3.0, None)), ("4", (4.0, None)),
                                        ("0.5_4.0", (4.0, 0.5)), (" 0.25_2 ", (2.0, 0.25))])
def test_threshold_forms_as_verl_parses_them(spec, want):
    assert parse_is_threshold(spec) == want


@pytest.mark.parametrize("spec, message", [("abc", "cannot read"), ("4_0.5", "lower bound"), ("0_2", "lower bound"),
                                           (-1.0, "must be > 0"), (True, "number")])
def test_bad_thresholds_are_refused(spec, message):
    with pytest.raises((ValueError, TypeError), match=message):
        TruncatedIS(threshold=spec)


def test_lower_upper_zeroes_weights_outside_the_band():
    """IcePop (verl's '0.5_4.0'): a weight in [lower, upper] stays as it is, one outside becomes 0 (not clamped)."""
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0]])
    rollout = torch.tensor([[math.log(2.0), -math.log(3.0), math.log(4.0), -math.log(5.0), 0.0]])  # w = 1/2, 3, 1/4, 5, 1
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    module = TruncatedIS(level="token", threshold="0.5_4.0")
    assert (module.threshold, module.lower) == (4.0, 0.5)
    batch = TensorDict({K.OLD_LOG_PROBS: old, K.ROLLOUT_LOG_PROBS: rollout, K.RESPONSE_MASK: mask}, [1])
    torch.testing.assert_close(module(batch)[K.IS_WEIGHTS], torch.tensor([[0.5, 3.0, 0.0, 0.0, 0.0]]))
    assert module.stats["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(0.5)  # 1/4 and 5 of 4 tokens
    assert module.stats["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(0.25)  # below 0.5, not 1/4
    upper_only, _ = truncated_is_weights(old, rollout, mask, "token", threshold=4.0)
    torch.testing.assert_close(upper_only, torch.tensor([[0.5, 3.0, 0.25, 4.0, 0.0]]))  # truncation keeps them


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_normalize_gives_mean_one_as_verl(level):
    gen = torch.Generator().manual_seed(3)
    old = torch.randn(4, 5, generator=gen, dtype=torch.float64) * 0.4
    rollout = old + torch.randn(4, 5, generator=gen, dtype=torch.float64) * 0.4
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.float64)
    plain, _ = truncated_is_weights(old, rollout, mask, level, threshold=1.5)
    w, stats = truncated_is_weights(old, rollout, mask, level, threshold=1.5, batch_normalize=True)
    # verl: token level divides by the mean over valid tokens; sequence level by the mean over sequences of each
    # sequence's (constant) weight
    rows = [[plain[i, t].item() for t in range(5) if mask[i, t]] for i in range(4)]
    mean = (sum(map(sum, rows)) / sum(map(len, rows)) if level == "token" else
            sum(r[0] for r in rows) / len(rows))
    torch.testing.assert_close(w, plain / mean)
    assert stats["rollout_is_batch_norm_factor"].item() == pytest.approx(mean)
    assert mean != pytest.approx(1.0, abs=1e-3)  # so the test sees the normalisation
    units = w[mask.bool()] if level == "token" else w[:, 0]
    assert units.mean().item() == pytest.approx(1.0)


# ---------------------------------------------------------------- the loss


def test_ppo_clip_loss_multiplies_per_token_loss_by_weights():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w = torch.tensor([[2.0, 0.5, 7.0]])
    loss, stats = F.ppo_clip_loss(logp, logp.detach(), adv, mask, weights=w)
    # ratio 1: per-token -A = [-1, 2, -0.5]; weighted [-2, 1, (masked)]; token-mean over 2 tokens
    torch.testing.assert_close(loss, torch.tensor(-0.5))
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, 0.5, 0.0]]))  # -A w / 2 on valid tokens
    plain, plain_stats = F.ppo_clip_loss(logp, logp.detach(), adv, mask)
    torch.testing.assert_close(plain, torch.tensor(0.5))
    assert stats == plain_stats  # the stats ignore the weights


def test_ppo_clip_loss_weights_apply_after_the_dual_clip():
    logp, old = torch.tensor([[2.0]]), torch.tensor([[0.0]])  # ratio e^2 = 7.39
    adv = torch.tensor([[-1.0]])
    loss, _ = F.ppo_clip_loss(logp, old, adv, torch.ones(1, 1), clip_c=3.0, weights=torch.tensor([[0.5]]))
    torch.testing.assert_close(loss, torch.tensor(1.5))  # dual clip caps -A * ratio at 3, then * 0.5


def test_ppo_loss_is_weights_is_opt_in():
    assert K.IS_WEIGHTS not in PPOLoss().in_keys
    loss = PPOLoss(is_weights=True)
    assert K.IS_WEIGHTS in loss.in_keys
    logp = torch.tensor([[-1.0, -2.0]])
    batch = TensorDict({K.LOG_PROBS: logp, K.OLD_LOG_PROBS: logp, K.ADVANTAGES: torch.tensor([[1.0, 1.0]]),
                        K.RESPONSE_MASK: torch.ones(1, 2)}, [1])
    with pytest.raises(KeyError, match=K.IS_WEIGHTS):
        loss(batch)
    batch[K.IS_WEIGHTS] = torch.tensor([[0.5, 1.5]])
    assert loss(batch).stats["actor/pg_loss"] == pytest.approx(-1.0)  # -(0.5 + 1.5) / 2
    assert PPOLoss()(batch).stats["actor/pg_loss"] == pytest.approx(-1.0)
    batch[K.IS_WEIGHTS] = torch.tensor([[0.5, 0.5]])
    assert loss(batch).stats["actor/pg_loss"] == pytest.approx(-0.5)
    assert PPOLoss()(batch).stats["actor/pg_loss"] == pytest.approx(-1.0)  # without the flag: unweighted


def test_trainer_chain_check_and_on_policy_weights(model, tokenizer, addition_rows, tmp_path):
    with pytest.raises(MissingKeyError, match="is_weights"):
        make_trainer(model, tokenizer, addition_rows, tmp_path / "a", loss=PPOLoss(is_weights=True))
    correction = TruncatedIS(level="sequence")
    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path / "b", max_steps=1,
                                 estimator=Chain(correction, GRPO()), loss=PPOLoss(is_weights=True))
    assert trainer.needs_old_log_probs  # TruncatedIS reads old_log_probs
    [metrics] = trainer.fit(data)
    # sampler and trainer are the same fp32 model here: every weight is 1 up to rounding
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-4)  # logged with the step
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0
