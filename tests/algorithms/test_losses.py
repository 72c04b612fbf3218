"""Policy and value losses: the functional core by hand and by loop, then PPOLoss / ValueLoss
(totals, statistics, declared keys, variants, Dr.GRPO's loss_scale_factor, micro-batching)."""

import math

import pytest
import torch
from tensordict import TensorDict

from rlflow.algorithms import LOSS_MODES, Aggregation, LossOutput, PPOLoss, ValueLoss
from rlflow.algorithms import functional as F
from rlflow.data import keys as K

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum")

# ---------------------------------------------------------------- PPO clip loss


def ppo_example():
    # tokens: (A, ratio) = (+1, 1.5) clipped at 1.2; (+1, 0.5) unclipped; (-1, 0.5) clipped at 0.8;
    # (-1, 5.0) dual-clipped at 3; (-2, 1.0) masked out
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -2.0]])
    ratio = torch.tensor([[1.5, 0.5, 0.5, 5.0, 1.0]])
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -1.0]])
    logp = (old + ratio.log()).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    return logp, old, adv, mask


def test_ppo_clip_loss_by_hand():
    logp, old, adv, mask = ppo_example()
    loss, stats = F.ppo_clip_loss(logp, old, adv, mask)
    # per token max(-A r, -A clip(r)): -1.2, -0.5, 0.8, 5 -> dual clip min(5, 3) = 3
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 3.0) / 4, rel=1e-5)
    assert stats["pg_clipfrac"].item() == pytest.approx(0.5)  # tokens 1 and 3
    assert stats["pg_clipfrac_lower"].item() == pytest.approx(0.25)  # token 4
    assert stats["ppo_kl"].item() == pytest.approx(-sum(map(math.log, (1.5, 0.5, 0.5, 5.0))) / 4, rel=1e-5)
    assert all(not v.requires_grad and v.dim() == 0 for v in stats.values())
    (grad,) = torch.autograd.grad(loss, logp)
    # only the unclipped token has a gradient: d(-A r)/dlogp = -A r = -0.5, over 4 tokens
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.125, 0.0, 0.0, 0.0]]))


def test_ppo_clip_loss_without_dual_clip_and_asymmetric():
    logp, old, adv, mask = ppo_example()
    loss, stats = F.ppo_clip_loss(logp, old, adv, mask, clip_c=None)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 5.0) / 4, rel=1e-5)
    assert stats["pg_clipfrac_lower"].item() == 0.0
    loss, _ = F.ppo_clip_loss(logp, old, adv, mask, clip_low=0.1, clip_high=0.28)
    # token 1 clipped at 1.28; token 3 clipped at 0.9
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.9 + 3.0) / 4, rel=1e-5)
    with pytest.raises(ValueError, match="clip_c"):
        F.ppo_clip_loss(logp, old, adv, mask, clip_c=1.0)


def test_ppo_clip_loss_ratio_clamp():
    logp = torch.tensor([[100.0]])
    old = torch.tensor([[0.0]])  # exp(100) overflows float32; the +-20 clamp keeps it finite
    loss, stats = F.ppo_clip_loss(logp, old, torch.tensor([[-1.0]]), torch.ones(1, 1), clip_c=None)
    assert loss.item() == pytest.approx(math.exp(20), rel=1e-5)
    assert stats["ppo_kl"].item() == -20.0


def ppo_loop(logp, old, adv, mask, lo, hi, c):
    """verl's vanilla loss per token in plain Python floats, token-mean."""
    total, n, clipped, lower = 0.0, 0, 0, 0
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if mask[i, t] == 0:
                continue
            a, r = adv[i, t].item(), math.exp(max(-20.0, min(20.0, logp[i, t].item() - old[i, t].item())))
            l1, l2 = -a * r, -a * min(max(r, 1 - lo), 1 + hi)
            per = max(l1, l2)
            clipped += l2 > l1
            if a < 0:
                lower += per > -a * c
                per = min(per, -a * c)
            total, n = total + per, n + 1
    return total / n, clipped / n, lower / n


def test_ppo_clip_loss_matches_loop():
    gen = torch.Generator().manual_seed(5)
    old = -torch.rand(6, 8, generator=gen, dtype=torch.float64) * 3
    logp = old + torch.randn(6, 8, generator=gen, dtype=torch.float64) * 0.6
    adv = torch.randn(6, 8, generator=gen, dtype=torch.float64) * 2
    mask = (torch.rand(6, 8, generator=gen) < 0.8).double()
    loss, stats = F.ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, clip_c=2.0)
    ref_loss, ref_clip, ref_lower = ppo_loop(logp, old, adv, mask, 0.2, 0.28, 2.0)
    assert ref_clip > 0 and ref_lower > 0  # the random data exercises both clips
    assert loss.item() == pytest.approx(ref_loss, rel=1e-9)
    assert stats["pg_clipfrac"].item() == pytest.approx(ref_clip)
    assert stats["pg_clipfrac_lower"].item() == pytest.approx(ref_lower)


# ---------------------------------------------------------------- value loss


def value_example():
    values = torch.tensor([[1.0, 2.0, 0.0]], requires_grad=True)
    return values, torch.tensor([[0.0, 1.8, 0.0]]), torch.tensor([[2.0, 0.0, 5.0]]), torch.tensor([[1, 1, 0]])


def test_value_loss_functional_by_hand():
    values, old, returns, mask = value_example()
    loss, stats = F.value_loss(values, old, returns, mask)
    # token 1: clip(1, -0.5, 0.5) = 0.5: max((1-2)^2, (0.5-2)^2) = 2.25 (clipped wins)
    # token 2: inside [1.3, 2.3]: both (2-0)^2 = 4 (not counted as clipped); loss 0.5 * 6.25 / 2
    assert loss.item() == pytest.approx(1.5625)
    assert stats["vf_clipfrac"].item() == pytest.approx(0.5)
    (grad,) = torch.autograd.grad(loss, values)
    # token 1's winning term is constant in v; token 2: 0.5 * 2 (v - R) / 2 tokens = 2 * 0.5 = 1
    torch.testing.assert_close(grad, torch.tensor([[0.0, 1.0, 0.0]]))
    loss, stats = F.value_loss(values, old, returns, mask, clip_range=None)
    assert loss.item() == pytest.approx(0.5 * (1.0 + 4.0) / 2) and stats["vf_clipfrac"].item() == 0.0


# ---------------------------------------------------------------- PPOLoss, ValueLoss


def hand_batch():
    # ppo_example's tokens (pg_loss 0.525), with a reference and an entropy
    logp, old, adv, mask = ppo_example()
    return TensorDict(
        {
            K.LOG_PROBS: logp,
            K.OLD_LOG_PROBS: old,
            K.ADVANTAGES: adv,
            K.RESPONSE_MASK: mask,
            K.REF_LOG_PROBS: logp.detach() + torch.tensor([[0.0, 0.5, -0.5, 1.0, 7.0]]),
            K.ENTROPY: torch.tensor([[1.0, 2.0, 3.0, 6.0, 100.0]]),
        },
        batch_size=[1],
    )


def test_ppo_loss_plain_by_hand():
    out = PPOLoss()(hand_batch())
    assert isinstance(out, LossOutput)
    assert out.loss.item() == pytest.approx(0.525, rel=1e-5)
    assert set(out.stats) == {"actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl",
                              "actor/entropy"}
    assert all(type(v) is float for v in out.stats.values())
    assert out.stats["actor/pg_loss"] == pytest.approx(0.525, rel=1e-5)
    assert out.stats["actor/pg_clipfrac"] == pytest.approx(0.5)
    assert out.stats["actor/pg_clipfrac_lower"] == pytest.approx(0.25)
    assert out.stats["actor/entropy"] == pytest.approx(3.0)  # (1 + 2 + 3 + 6) / 4, reported at coef 0


def test_ppo_loss_with_kl_and_entropy_by_hand():
    batch = hand_batch()
    out = PPOLoss(kl_coef=0.1, kl_type="k1", entropy_coef=0.01)(batch)
    # k1 = logp - ref = [0, -0.5, 0.5, -1] -> mean -0.25; entropy mean 3
    assert out.stats["actor/kl_loss"] == pytest.approx(-0.25, rel=1e-5)
    assert out.stats["actor/kl_coef"] == pytest.approx(0.1)
    assert out.loss.item() == pytest.approx(0.525 - 0.01 * 3.0 + 0.1 * -0.25, rel=1e-5)
    (grad,) = torch.autograd.grad(out.loss, batch[K.LOG_PROBS])
    # pg: only token 2 (-0.5 / 4); k1 adds kl_coef / 4 on each valid token
    torch.testing.assert_close(grad, torch.tensor([[0.025, -0.1, 0.025, 0.025, 0.0]]))


def test_ppo_loss_low_var_kl_default_type():
    out = PPOLoss(kl_coef=1.0)(hand_batch())
    d = [0.0, 0.5, -0.5, 1.0]  # ref - logp
    expected = sum(math.exp(x) - x - 1 for x in d) / 4
    assert out.stats["actor/kl_loss"] == pytest.approx(expected, rel=1e-5)


def test_entropy_only_differentiated_with_a_coefficient():
    batch = hand_batch()
    batch[K.ENTROPY] = batch[K.ENTROPY].clone().requires_grad_(True)
    loss = PPOLoss()(batch).loss
    assert torch.autograd.grad(loss, batch[K.ENTROPY], allow_unused=True)[0] is None
    loss = PPOLoss(entropy_coef=0.5)(batch).loss
    (grad,) = torch.autograd.grad(loss, batch[K.ENTROPY])
    torch.testing.assert_close(grad, torch.tensor([[-0.125] * 4 + [0.0]]))  # -coef / 4 tokens


def test_in_keys_follow_coefficients():
    base = (K.LOG_PROBS, K.OLD_LOG_PROBS, K.ADVANTAGES, K.RESPONSE_MASK)
    assert PPOLoss().in_keys == base
    assert PPOLoss(kl_coef=1e-3).in_keys == base + (K.REF_LOG_PROBS,)
    assert PPOLoss(entropy_coef=-0.01).in_keys == base + (K.ENTROPY,)
    assert PPOLoss(kl_coef=1e-3, entropy_coef=1e-3).in_keys == base + (K.REF_LOG_PROBS, K.ENTROPY)
    assert PPOLoss().out_keys == () and ValueLoss().out_keys == ()
    batch = hand_batch().exclude(K.REF_LOG_PROBS)
    PPOLoss()(batch)  # fine without a reference
    with pytest.raises(KeyError, match=K.REF_LOG_PROBS):
        PPOLoss(kl_coef=0.1)(batch)


def test_clip_ratios_and_validation():
    loss = PPOLoss(clip_ratio=0.3, clip_ratio_high=0.28)
    assert (loss.clip_low, loss.clip_high) == (0.3, 0.28)
    out = loss(hand_batch())
    # token 1 clipped at 1.28; token 3 clipped at 1 - 0.3 = 0.7
    assert out.loss.item() == pytest.approx((-1.28 - 0.5 + 0.7 + 3.0) / 4, rel=1e-5)
    out = PPOLoss(clip_ratio_c=None)(hand_batch())
    assert out.loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 5.0) / 4, rel=1e-5)
    with pytest.raises(ValueError, match="low_var_kl"):
        PPOLoss(kl_type="k9")
    with pytest.raises(ValueError, match="token-mean"):
        PPOLoss(agg="sum")
    with pytest.raises(ValueError, match="clip_ratio_c"):
        PPOLoss(clip_ratio_c=0.5)
    with pytest.raises(ValueError, match="token-mean"):
        ValueLoss(agg="sum")


class HandCISPO(PPOLoss):
    """-sg(clip(ratio)) * A * logp (MiniMax-M1): one per-token method; PPOLoss weighs, aggregates, adds KL."""

    def objective(self, batch):
        logp, mask = batch[K.LOG_PROBS], batch[K.RESPONSE_MASK]
        ratio = torch.exp(logp - batch[K.OLD_LOG_PROBS]).clamp(1 - self.clip_low, 1 + self.clip_high)
        return -ratio.detach() * batch[K.ADVANTAGES] * logp, {"is_weight_mean": F.masked_mean(ratio, mask).detach()}


class LegacyCISPO(PPOLoss):
    """The same loss written for the earlier contract: pg_loss(batch, num_tokens, num_seqs) -> (loss, stats)."""

    def pg_loss(self, batch, num_tokens=None, num_seqs=None):
        per_token, stats = HandCISPO.objective(self, batch)
        return F.agg_loss(per_token, batch[K.RESPONSE_MASK], self.agg, num_tokens, num_seqs), stats


def test_variant_overrides_objective_only():
    batch = hand_batch()
    out = HandCISPO(kl_coef=0.1, kl_type="k1")(batch)
    (grad,) = torch.autograd.grad(out.loss, batch[K.LOG_PROBS])
    # d/dlogp = -clip(r) * A / 4 + 0.1 / 4: clip(r) = [1.2, 0.8, 0.8, 1.2], A = [1, 1, -1, -1]
    expected = [(-c * a + 0.1) / 4 for c, a in zip((1.2, 0.8, 0.8, 1.2), (1, 1, -1, -1))] + [0.0]
    torch.testing.assert_close(grad, torch.tensor([expected]))
    assert out.stats["actor/is_weight_mean"] == pytest.approx(1.0)  # (1.2 + 0.8 + 0.8 + 1.2) / 4
    assert "actor/kl_loss" in out.stats and "actor/pg_clipfrac" not in out.stats
    assert out.summed == {"actor/pg_loss", "actor/kl_loss", "actor/entropy"}  # shares; is_weight_mean: a mean
    # the shell applies the IS weights: w = 2 on every token doubles the policy term, not the KL term
    weighted = hand_batch()
    weighted[K.IS_WEIGHTS] = torch.full_like(weighted[K.LOG_PROBS], 2.0).detach()
    out2 = HandCISPO(kl_coef=0.1, kl_type="k1", is_weights=True)(weighted)
    assert out2.stats["actor/pg_loss"] == pytest.approx(2 * out.stats["actor/pg_loss"], rel=1e-7)
    assert out2.stats["actor/kl_loss"] == out.stats["actor/kl_loss"]


def test_a_pg_loss_override_still_works_with_a_warning():
    """A variant written for the earlier contract (pg_loss(batch, num_tokens, num_seqs)) gets the same counts."""
    batch, counts = hand_batch(), Aggregation(num_tokens=torch.tensor(8.0), num_seqs=torch.tensor(2.0))
    with pytest.warns(DeprecationWarning, match="override objective"):
        old = LegacyCISPO(kl_coef=0.1, kl_type="k1")(batch, counts)
    new = HandCISPO(kl_coef=0.1, kl_type="k1")(hand_batch(), counts)
    assert old.loss.item() == new.loss.item() and old.stats == new.stats
    assert old.stats["actor/pg_loss"] == pytest.approx(new.stats["actor/pg_loss"])
    # the counts as loose keywords: the earlier call, deprecated
    with pytest.warns(DeprecationWarning, match=r"pass Aggregation\(num_tokens"):
        loose = HandCISPO(kl_coef=0.1, kl_type="k1")(hand_batch(), num_tokens=8.0, num_seqs=2.0)
    assert loose.loss.item() == pytest.approx(new.loss.item(), rel=1e-7)
    with pytest.raises(TypeError, match="aggregation must be an rlflow.algorithms.aggregate.Aggregation, got float"):
        PPOLoss()(hand_batch(), 8.0)


def test_loss_output_declares_what_sums_over_micro_batches():
    out = LossOutput(torch.zeros(()), {"actor/pg_loss": 1.0, "actor/pg_clipfrac": 0.5})
    assert out.summed == {"actor/pg_loss"}  # default: the loss terms verl logs
    mine = LossOutput(torch.zeros(()), {"actor/my_term": 1.0, "actor/my_frac": 0.5}, summed={"actor/my_term"})
    assert mine.summed == frozenset({"actor/my_term"})
    with pytest.raises(ValueError, match=r"LossOutput.summed names \['actor/missing'\], which are not in its stats"):
        LossOutput(torch.zeros(()), {"actor/pg_loss": 1.0}, summed={"actor/missing"})
    values, old, returns, mask = value_example()
    batch = TensorDict({K.VALUES: values, K.OLD_VALUES: old, K.RETURNS: returns, K.RESPONSE_MASK: mask}, [1])
    assert ValueLoss()(batch).summed == {"critic/vf_loss"}


def test_loss_scale_factor_is_the_sum_norm_constant_by_hand():
    # verl actor.loss_scale_factor: seq-mean-token-sum-norm divides the token sum by it instead of R (= 5 here),
    # in the policy, KL and entropy terms alike. Per-token pg loss [-1.2, -0.5, 0.8, 3.0] (sum 2.1),
    # k1 = [0, -0.5, 0.5, -1] (sum -1), entropy [1, 2, 3, 6] (sum 12).
    batch = hand_batch()
    kw = dict(agg="seq-mean-token-sum-norm", kl_coef=0.1, kl_type="k1", entropy_coef=0.01)
    out = PPOLoss(loss_scale_factor=512, **kw)(batch)
    assert out.stats["actor/pg_loss"] == pytest.approx(2.1 / 512, rel=1e-5)
    assert out.stats["actor/kl_loss"] == pytest.approx(-1.0 / 512, rel=1e-5)
    assert out.stats["actor/entropy"] == pytest.approx(12.0 / 512, rel=1e-5)
    assert out.loss.item() == pytest.approx((2.1 - 0.01 * 12.0 + 0.1 * -1.0) / 512, rel=1e-5)
    (grad,) = torch.autograd.grad(out.loss, batch[K.LOG_PROBS])
    # pg: only token 1 is unclipped (-A r = -0.5); k1 adds kl_coef on each valid token; all / 512
    torch.testing.assert_close(grad, torch.tensor([[0.1, -0.4, 0.1, 0.1, 0.0]]) / 512)
    default = PPOLoss(**kw)(batch)  # None: the padded response length R = 5
    assert default.loss.item() == pytest.approx((2.1 - 0.01 * 12.0 + 0.1 * -1.0) / 5, rel=1e-5)
    # like verl, the other modes ignore it (rlflow warns when the loss is built)
    with pytest.warns(UserWarning, match="loss_scale_factor=512 only applies to agg='seq-mean-token-sum-norm'"):
        ignored = PPOLoss(loss_scale_factor=512)
    assert ignored(batch).loss.item() == PPOLoss()(batch).loss.item()
    with pytest.raises(ValueError, match="loss_scale_factor must be > 0"):
        PPOLoss(agg="seq-mean-token-sum-norm", loss_scale_factor=0)


@pytest.mark.parametrize("name", sorted(LOSS_MODES))
def test_loss_scale_factor_reaches_every_policy_loss(name):
    """Each verl loss_mode's class divides its policy term by loss_scale_factor instead of R."""
    gen = torch.Generator().manual_seed(3)
    batch = with_model_outputs(random_batch(gen), torch.randn(6, dtype=torch.float64))
    batch[K.COV_SELECTED] = torch.rand(batch[K.RESPONSE_MASK].shape, generator=gen) < 0.2  # Clip-Cov / KL-Cov
    r = batch[K.RESPONSE_MASK].shape[-1]
    kw = dict(agg="seq-mean-token-sum-norm", kl_coef=0.3, entropy_coef=0.05)
    by_r = LOSS_MODES[name](**kw)(batch)
    by_512 = LOSS_MODES[name](loss_scale_factor=512, **kw)(batch)
    assert by_r.stats["actor/pg_loss"] != 0
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy"):
        assert by_512.stats[key] == pytest.approx(by_r.stats[key] * r / 512, rel=1e-9), key
    assert by_512.loss.item() == pytest.approx(by_r.loss.item() * r / 512, rel=1e-9)


def test_value_loss_by_hand():
    values, old, returns, mask = value_example()
    data = {K.VALUES: values, K.OLD_VALUES: old, K.RETURNS: returns, K.RESPONSE_MASK: mask}
    batch = TensorDict(data, batch_size=[1])
    out = ValueLoss()(batch)
    # see test_value_loss_functional_by_hand: 0.5 * (2.25 + 4) / 2
    assert out.loss.item() == pytest.approx(1.5625)
    assert out.stats == pytest.approx({"critic/vf_loss": 1.5625, "critic/vf_clipfrac": 0.5, "critic/vpred_mean": 1.5})
    assert ValueLoss().in_keys == (K.VALUES, K.OLD_VALUES, K.RETURNS, K.RESPONSE_MASK)
    with pytest.raises(KeyError, match=K.OLD_VALUES):
        ValueLoss()(batch.exclude(K.OLD_VALUES))


def random_batch(gen, b=8, r=6):
    mask = (torch.rand(b, r, generator=gen) < 0.75).long()
    mask *= (torch.arange(r)[None] < torch.randint(1, r + 1, (b,), generator=gen)[:, None]).long()
    mask[2] = 0  # one sample with no valid token
    rand = lambda: torch.randn(b, r, generator=gen, dtype=torch.float64)  # noqa: E731
    return TensorDict(
        {"x": rand(), K.OLD_LOG_PROBS: -rand().abs(), K.REF_LOG_PROBS: -rand().abs(), K.ADVANTAGES: rand(),
         K.RESPONSE_MASK: mask, K.OLD_VALUES: rand(), K.RETURNS: rand()},
        batch_size=[b],
    )


def with_model_outputs(batch, theta):
    """A stand-in policy/critic: outputs that depend on theta, so gradients can be compared."""
    x = batch["x"]
    out = batch.clone(False)
    out[K.LOG_PROBS] = batch[K.OLD_LOG_PROBS] + 0.5 * torch.tanh(x * theta)
    out[K.ENTROPY] = torch.nn.functional.softplus(x * theta)
    out[K.VALUES] = batch[K.OLD_VALUES] + torch.sin(x * theta)
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("split", [[3, 1, 4], [1] * 8])
def test_micro_batches_reproduce_mini_batch(mode, split):
    """Summed micro-batch losses (mini-batch counts) equal the mini-batch loss and gradient."""
    gen = torch.Generator().manual_seed(7)
    batch = random_batch(gen)
    theta = torch.randn(6, dtype=torch.float64, requires_grad=True)
    mask = batch[K.RESPONSE_MASK]
    counts = Aggregation(num_tokens=mask.sum(), num_seqs=(mask.sum(-1) > 0).sum())
    for loss_fn in (PPOLoss(clip_ratio=0.1, kl_coef=0.3, entropy_coef=0.05, agg=mode), ValueLoss(0.2, agg=mode)):
        full = loss_fn(with_model_outputs(batch, theta))
        (g_full,) = torch.autograd.grad(full.loss, theta)
        total, g_sum, stat_sum = 0.0, torch.zeros_like(theta), 0.0
        for idx in torch.arange(8).split(split):
            part = loss_fn(with_model_outputs(batch[idx], theta), counts)
            g_sum += torch.autograd.grad(part.loss, theta)[0]
            total += part.loss.item()
            stat_sum += part.stats.get("actor/pg_loss", part.stats.get("critic/vf_loss"))
        assert total == pytest.approx(full.loss.item(), rel=1e-9)
        assert stat_sum == pytest.approx(full.stats.get("actor/pg_loss", full.stats.get("critic/vf_loss")), rel=1e-9)
        torch.testing.assert_close(g_sum, g_full)
        assert g_full.abs().sum() > 0  # the comparison is not vacuous
