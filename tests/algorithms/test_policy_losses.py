"""Policy-loss variants (GSPO, CISPO, SAPO, REINFORCE, GMPO, Clip-Cov, KL-Cov) and DAPO's clip-higher:
each formula by hand, against a plain-Python loop of verl's code on random masked inputs, and
micro-batch invariance of every loss in every aggregation mode."""

import math

import pytest
import torch
from tensordict import TensorDict

from rlflow.algorithms import (
    Aggregation,
    LOSS_MODES,
    CISPOLoss,
    ClipCovLoss,
    CovSelection,
    GMPOLoss,
    GSPOLoss,
    KLCovLoss,
    PPOLoss,
    ReinforceLoss,
    SAPOLoss,
)
from rlflow.algorithms import functional as F
from rlflow.algorithms import policy_functional as PF
from rlflow.data import keys as K
from rlflow.module import Chain

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum")
sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731


def grad_of(loss, x):
    return torch.autograd.grad(loss, x)[0]


# ---------------------------------------------------------------- by hand


def test_gspo_by_hand():
    # row 0: A = +1, logp - old = [0.2, -0.4] -> s = exp(-0.1) = 0.904837, inside [0.8, 1.2]: loss -0.904837
    # row 1: A = +1, logp - old = [0.5, 0.5] -> s = exp(0.5) = 1.6487 > 1.2: clipped, loss -1.2, no gradient
    # the third column is masked (its huge ratio must not leak into the sequence ratio)
    old = torch.tensor([[-1.0, -2.0, -1.0], [-1.0, -1.0, -1.0]])
    logp = (old + torch.tensor([[0.2, -0.4, 5.0], [0.5, 0.5, 0.0]])).requires_grad_(True)
    adv, mask = torch.ones(2, 3), torch.tensor([[1, 1, 0], [1, 1, 0]])
    loss, stats = PF.gspo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx((-0.9048374 - 1.2) / 2, rel=1e-6)  # seq-mean-token-mean
    assert stats["pg_clipfrac"].item() == pytest.approx(0.5)
    assert stats["seq_ratio_mean"].item() == pytest.approx((0.9048374 + math.exp(0.5)) / 2, rel=1e-6)
    # d/dlogp_t (-A s_t) = -A s (sequence-level weight on every token); / 2 tokens / 2 sequences
    torch.testing.assert_close(grad_of(loss, logp), torch.tensor([[-0.2262094] * 2 + [0.0], [0.0] * 3]))


def test_gspo_log_ratio_clamped_at_10():
    # log s = 20 is clamped to 10: the loss is -A e^10 and the clamp cuts the gradient (verl)
    logp = torch.tensor([[20.0, 20.0]], requires_grad=True)
    loss, _ = PF.gspo_loss(logp, torch.zeros(1, 2), -torch.ones(1, 2), torch.ones(1, 2))
    assert loss.item() == pytest.approx(math.exp(10), rel=1e-6)
    assert grad_of(loss, logp).abs().sum() == 0


def test_cispo_by_hand():
    # tokens (A, r, logp): (+1, 1.5, -1) -> clip 1.2: -1.2*1*(-1) = 1.2;
    # (-1, 0.5, -2) -> clip 0.8: -0.8*(-1)*(-2) = -1.6; (2, 1.1, -0.5) unclipped: -1.1*2*(-0.5) = 1.1;
    # token-mean = 0.7/3
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = logp.detach() - torch.tensor([[1.5, 0.5, 1.1]]).log()
    adv, mask = torch.tensor([[1.0, -1.0, 2.0]]), torch.ones(1, 3)
    loss, stats = PF.cispo_loss(logp, old, adv, mask)
    assert loss.item() == pytest.approx(0.7 / 3, rel=1e-5)
    assert stats["pg_clipfrac"].item() == pytest.approx(2 / 3)
    # the clipped weight is detached: every token keeps the gradient -clip(r) * A / 3
    torch.testing.assert_close(grad_of(loss, logp), torch.tensor([[-1.2, 0.8, -2.2]]) / 3)


def test_sapo_by_hand():
    # on-policy (r = 1): gate sigmoid(0) * 4 / tau = 2 / tau; A = +1 uses tau_pos = 1 -> loss -2,
    # A = -1 uses tau_neg = 1.05 -> +2/1.05; the gradient is the plain -A (sigmoid' = 1/4 times 4)
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, stats = PF.sapo_loss(logp, logp.detach(), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
    assert loss.item() == pytest.approx((-2 + 2 / 1.05) / 2, abs=1e-6)
    assert stats["gate_mean"].item() == pytest.approx(0.5)
    torch.testing.assert_close(grad_of(loss, logp), torch.tensor([[-0.5, 0.5]]))
    # off-policy, r = e: loss -sigmoid(e - 1) * 4 = -3.39163, gradient -sigmoid'(e - 1) * e * 4 = -1.40220
    logp = torch.tensor([[1.0]], requires_grad=True)
    loss, _ = PF.sapo_loss(logp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1))
    assert loss.item() == pytest.approx(-3.3916296, rel=1e-6)
    assert grad_of(loss, logp).item() == pytest.approx(-1.4022033, rel=1e-5)


def test_reinforce_by_hand():
    # -A * logp: (-1)(1)(-1)... = [1, -2]; token-mean -0.5; gradient -A / 2
    logp = torch.tensor([[-1.0, -2.0, -9.0]], requires_grad=True)
    loss, stats = PF.reinforce_loss(logp, torch.tensor([[1.0, -1.0, 5.0]]), torch.tensor([[1, 1, 0]]))
    assert loss.item() == pytest.approx(-0.5) and stats == {}
    torch.testing.assert_close(grad_of(loss, logp), torch.tensor([[-0.5, 0.5, 0.0]]))


def test_gmpo_by_hand():
    # row 0: A = +1, d = [0.1, 0.6] -> pessimistic clip at +0.4: [0.1, 0.4], rho = exp(0.25), loss -1.284025
    # row 1: A = -1, d = [-0.6, 0.2] -> for A < 0 the low side is clipped: [-0.4, 0.2], rho = exp(-0.1), loss +0.904837
    old = torch.zeros(2, 2)
    logp = torch.tensor([[0.1, 0.6], [-0.6, 0.2]], requires_grad=True)
    adv, mask = torch.tensor([[1.0, 1.0], [-1.0, -1.0]]), torch.ones(2, 2)
    loss, stats = PF.gmpo_loss(logp, old, adv, mask)
    assert loss.item() == pytest.approx(-0.18959400, rel=1e-6)  # mean over the 2 sequences
    assert stats["pg_clipfrac"].item() == pytest.approx(0.25)
    assert stats["pg_clipfrac_lower"].item() == pytest.approx(0.25)
    # unclipped tokens: d(-A rho)/dlogp_t = -A rho / |y|, then / 2 sequences; clipped tokens: 0
    torch.testing.assert_close(grad_of(loss, logp), torch.tensor([[-0.3210064, 0.0], [0.0, 0.2262094]]))


def cov_example():
    # A - mean A = [2, 2, -2, -2]; logp - mean logp = [1.375, 0.375, -1.125, -0.625] -> cov = [2.75, 0.75, 2.25, 1.25]
    adv = torch.tensor([[3.0, 3.0, -1.0, -1.0, 7.0]])
    logp = torch.tensor([[-0.5, -1.5, -3.0, -2.5, 0.0]])
    return adv, logp, torch.tensor([[1, 1, 1, 1, 0]])


def test_token_covariance_by_hand():
    adv, logp, mask = cov_example()
    cov = PF.token_covariance(adv, logp, mask)
    torch.testing.assert_close(cov[:, :4], torch.tensor([[2.75, 0.75, 2.25, 1.25]]))


def test_clip_cov_select_by_hand():
    adv, logp, mask = cov_example()
    # candidates: valid tokens with 1 < cov < 5 -> tokens 0, 2, 3; k = max(int(0.3 * 4), 1) = 1
    picks = set()
    for seed in range(20):
        sel = PF.clip_cov_select(adv, logp, mask, ratio=0.3, generator=torch.Generator().manual_seed(seed))
        assert sel.sum() == 1 and not sel[0, 1] and not sel[0, 4]
        picks.add(int(sel.nonzero()[0, 1]))
    assert picks == {0, 2, 3}  # uniform among the candidates
    assert PF.clip_cov_select(adv, logp, mask, ratio=1e-6).sum() == 1  # int(ratio * N) = 0: still one token
    again = [PF.clip_cov_select(adv, logp, mask, 0.3, generator=torch.Generator().manual_seed(3)) for _ in range(2)]
    assert torch.equal(*again)  # a seeded generator fixes the choice
    # k = int(0.75 * 4) = 3 with cov bounds (2, 5): only tokens 0 and 2 qualify; exclude drops token 0
    sel = PF.clip_cov_select(adv, logp, mask, ratio=0.75, lb=2.0)
    assert sel[0].tolist() == [True, False, True, False, False]
    sel = PF.clip_cov_select(adv, logp, mask, ratio=0.75, lb=2.0, exclude=torch.tensor([[1, 0, 0, 0, 0]]))
    assert sel[0].tolist() == [False, False, True, False, False]


def test_kl_cov_select_by_hand():
    adv, logp, mask = cov_example()
    assert PF.kl_cov_select(adv, logp, mask, 0.25)[0].tolist() == [True, False, False, False, False]  # k = 1
    assert PF.kl_cov_select(adv, logp, mask, 0.5)[0].tolist() == [True, False, True, False, False]  # k = 2
    assert PF.kl_cov_select(adv, logp, mask, 1e-9).sum() == 1  # at least one token
    assert PF.kl_cov_select(adv, logp, torch.zeros_like(mask), 0.5).sum() == 0  # none without valid tokens


def test_clip_cov_loss_by_hand():
    adv, logp, mask = cov_example()
    logp = logp.clone().requires_grad_(True)
    selected = torch.tensor([[True, False, False, False, False]])
    loss, stats = PF.clip_cov_loss(logp, logp.detach(), adv, mask, selected)
    # r = 1: per token -A = [-3, -3, 1, 1], token 0 cut to 0 -> (-3 + 1 + 1) / 4
    assert loss.item() == pytest.approx(-0.25)
    assert stats["cov_clipfrac"].item() == pytest.approx(0.25)
    torch.testing.assert_close(grad_of(loss, logp), torch.tensor([[0.0, -0.75, 0.25, 0.25, 0.0]]))


def test_kl_cov_loss_by_hand():
    adv, logp, mask = cov_example()
    d = torch.tensor([[0.1, -0.2, 0.3, 0.0, 0.0]])
    logp = logp.clone().requires_grad_(True)
    selected = torch.tensor([[True, False, False, False, False]])
    loss, stats = PF.kl_cov_loss(logp, logp.detach() - d, adv, mask, selected, kl_coef=1.0)
    # -A e^d (+ |d| on token 0): -3e^0.1 + 0.1, -3e^-0.2, e^0.3, 1 -> mean -0.8304616 (unclipped: e^0.3 is not cut)
    assert loss.item() == pytest.approx(-0.83046155, rel=1e-6)
    assert stats["ppo_kl_abs"].item() == pytest.approx(0.6 / 4) and stats["kl_cov_frac"].item() == 0.25
    # token 0: (-3 e^0.1 + sign(0.1)) / 4 = -0.5788782
    assert grad_of(loss, logp)[0, 0].item() == pytest.approx(-0.57887819, rel=1e-6)


def test_dapo_clip_higher_by_hand():
    # DAPO's clip-higher: clip_ratio_low 0.2, clip_ratio_high 0.28 (asymmetric), token-mean
    logp = torch.tensor([[0.0, 0.0, 0.0, 0.0]], requires_grad=True)
    ratio = torch.tensor([[1.25, 1.5, 0.75, 0.9]])
    old = logp.detach() - ratio.log()
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    batch = TensorDict({K.LOG_PROBS: logp, K.OLD_LOG_PROBS: old, K.ADVANTAGES: adv, K.RESPONSE_MASK: torch.ones(1, 4)},
                       batch_size=[1])
    out = PPOLoss(clip_ratio_low=0.2, clip_ratio_high=0.28)(batch)
    # 1.25 < 1.28 stays (a symmetric 0.2 clip would cut it at 1.2); 1.5 -> 1.28; 0.75 -> 0.8 (A < 0); 0.9 stays
    assert out.loss.item() == pytest.approx((-1.25 - 1.28 + 0.8 + 0.9) / 4, rel=1e-6)
    assert out.stats["actor/pg_clipfrac"] == pytest.approx(0.5)
    # gradient -A r / 4 on the unclipped tokens 0 and 3 only
    torch.testing.assert_close(grad_of(out.loss, logp), torch.tensor([[-1.25 / 4, 0.0, 0.0, 0.9 / 4]]))
    symmetric = PPOLoss(clip_ratio=0.2)(batch).loss.item()
    assert symmetric == pytest.approx((-1.2 - 1.2 + 0.8 + 0.9) / 4, rel=1e-6)


# ---------------------------------------------------------------- against loops of verl's code


def random_inputs(seed, b=6, r=7):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, r, generator=gen, dtype=torch.float64) * 3
    logp = old + torch.randn(b, r, generator=gen, dtype=torch.float64) * 0.5
    adv = (torch.randn(b, 1, generator=gen, dtype=torch.float64) * 2).expand(b, r).clone()  # per sequence
    adv += torch.randn(b, r, generator=gen, dtype=torch.float64) * 0.3  # and some per-token variation
    mask = (torch.rand(b, r, generator=gen) < 0.8).double()
    mask[1] = 0  # a row without valid tokens
    return logp, old, adv, mask


def rows(mask):
    return [[t for t in range(mask.shape[1]) if mask[i, t]] for i in range(mask.shape[0])]


def seq_mean_token_mean(per_token, mask):
    seqs = [sum(per_token[i][t] for t in ts) / (len(ts) + 1e-8) for i, ts in enumerate(rows(mask)) if ts]  # verl's eps
    return sum(seqs) / len(seqs)


def token_mean(per_token, mask):
    vals = [per_token[i][t] for i, ts in enumerate(rows(mask)) for t in ts]
    return sum(vals) / len(vals)


def loop_gspo(logp, old, adv, mask, lo, hi):
    per = [[0.0] * mask.shape[1] for _ in range(mask.shape[0])]
    for i, ts in enumerate(rows(mask)):
        if not ts:
            continue
        s = math.exp(min(sum(logp[i, t].item() - old[i, t].item() for t in ts) / len(ts), 10.0))
        for t in ts:
            a = adv[i, t].item()
            per[i][t] = max(-a * s, -a * min(max(s, 1 - lo), 1 + hi))
    return seq_mean_token_mean(per, mask)


def loop_token(fn, logp, old, adv, mask):
    per = [[fn(logp[i, t].item(), old[i, t].item(), adv[i, t].item()) for t in range(mask.shape[1])]
           for i in range(mask.shape[0])]
    return per


def loop_gmpo(logp, old, adv, mask, lo, hi):
    """verl's geo_mean: per row exp(sum d' / (len + 1e-8)) and sum A / (len + 1e-8); torch.mean over ALL rows."""
    losses = []
    for i, ts in enumerate(rows(mask)):
        total_d, total_a = 0.0, 0.0
        for t in ts:
            d, a = logp[i, t].item() - old[i, t].item(), adv[i, t].item()
            sg = (a > 0) - (a < 0)
            dc = min(max(d, -lo), hi)
            total_d += sg * min(sg * d, sg * dc)
            total_a += a
        losses.append(-(total_a / (len(ts) + 1e-8)) * math.exp(total_d / (len(ts) + 1e-8)))
    return sum(losses) / len(losses)


def test_losses_match_loops_of_verl():
    for seed in range(3):
        logp, old, adv, mask = random_inputs(seed)
        exp = lambda x: math.exp(max(-20.0, min(20.0, x)))  # noqa: E731
        # GSPO (clip 0.1 / 0.15 so that some sequences clip)
        loss, stats = PF.gspo_loss(logp, old, adv, mask, clip_low=0.1, clip_high=0.15)
        assert loss.item() == pytest.approx(loop_gspo(logp, old, adv, mask, 0.1, 0.15), rel=1e-9)
        # CISPO
        per = loop_token(lambda lp, o, a: -min(max(exp(lp - o), 0.8), 1.28) * a * lp, logp, old, adv, mask)
        loss, _ = PF.cispo_loss(logp, old, adv, mask, 0.2, 0.28)
        assert loss.item() == pytest.approx(token_mean(per, mask), rel=1e-9)

        # SAPO
        def sapo(lp, o, a):
            tau = 1.0 if a > 0 else 1.05
            return -sig(tau * (exp(lp - o) - 1)) * 4 / tau * a

        per = loop_token(sapo, logp, old, adv, mask)
        assert PF.sapo_loss(logp, old, adv, mask)[0].item() == pytest.approx(seq_mean_token_mean(per, mask), rel=1e-9)
        # REINFORCE
        per = loop_token(lambda lp, o, a: -a * lp, logp, old, adv, mask)
        assert PF.reinforce_loss(logp, adv, mask)[0].item() == pytest.approx(token_mean(per, mask), rel=1e-9)
        # GMPO
        # rlflow divides by the rows that have tokens (verl by all rows; row 1 has none), and its
        # seq-mean-token-mean of the per-row constant adds verl's 1e-8 once more: rel 1e-7
        loss, _ = PF.gmpo_loss(logp, old, adv, mask, 0.2, 0.3)
        n_rows, n_valid = mask.shape[0], int((mask.sum(-1) > 0).sum())
        assert n_valid < n_rows
        assert loss.item() == pytest.approx(loop_gmpo(logp, old, adv, mask, 0.2, 0.3) * n_rows / n_valid, rel=1e-7)
        # KL-Cov: top-k over valid tokens by (A - mean A)(logp - mean logp)
        valid = [(i, t) for i, ts in enumerate(rows(mask)) for t in ts]
        ma = sum(adv[i, t].item() for i, t in valid) / len(valid)
        ml = sum(logp[i, t].item() for i, t in valid) / len(valid)
        cov = {(i, t): (adv[i, t].item() - ma) * (logp[i, t].item() - ml) for i, t in valid}
        top = set(sorted(cov, key=cov.get, reverse=True)[:3])
        sel = PF.kl_cov_select(adv, logp, mask, ratio=3 / len(valid) + 1e-9)
        assert {tuple(x) for x in sel.nonzero().tolist()} == top
        per = [[-adv[i, t].item() * math.exp(logp[i, t].item() - old[i, t].item())
                + 0.5 * abs(logp[i, t].item() - old[i, t].item()) * ((i, t) in top)
                for t in range(mask.shape[1])] for i in range(mask.shape[0])]
        loss, _ = PF.kl_cov_loss(logp, old, adv, mask, sel, 0.5)
        assert loss.item() == pytest.approx(token_mean(per, mask), rel=1e-9)
        # Clip-Cov: the candidates are exactly the valid tokens with lb < cov < ub
        cands = {k for k, c in cov.items() if 0.2 < c < 2.0}
        assert cands, "the random data must have candidates"
        sel = PF.clip_cov_select(adv, logp, mask, ratio=1.0, lb=0.2, ub=2.0)
        assert {tuple(x) for x in sel.nonzero().tolist()} == cands
        def ppo_token(i, t):
            a, r = adv[i, t].item(), math.exp(logp[i, t].item() - old[i, t].item())
            return max(-a * r, -a * min(max(r, 0.8), 1.2))

        per = [[0.0 if (i, t) in cands else ppo_token(i, t) for t in range(mask.shape[1])] for i in range(mask.shape[0])]
        assert PF.clip_cov_loss(logp, old, adv, mask, sel)[0].item() == pytest.approx(token_mean(per, mask), rel=1e-9)


# ---------------------------------------------------------------- modules


def batch_of(logp, old, adv, mask):
    return TensorDict({K.LOG_PROBS: logp, K.OLD_LOG_PROBS: old, K.ADVANTAGES: adv, K.RESPONSE_MASK: mask},
                      batch_size=[logp.shape[0]])


def test_modules_call_their_functions_and_keep_ppo_terms():
    logp, old, adv, mask = random_inputs(4)
    batch = batch_of(logp, old, adv, mask)
    assert GSPOLoss().pg_loss(batch)[0].item() == PF.gspo_loss(logp, old, adv, mask, 3e-4, 4e-4)[0].item()
    assert SAPOLoss(2.0, 3.0).pg_loss(batch)[0].item() == PF.sapo_loss(logp, old, adv, mask, 2.0, 3.0)[0].item()
    assert GMPOLoss().pg_loss(batch)[0].item() == PF.gmpo_loss(logp, old, adv, mask, 0.4, 0.4)[0].item()
    cispo = CISPOLoss(clip_ratio_low=1.0).pg_loss(batch)[0].item()
    assert cispo == PF.cispo_loss(logp, old, adv, mask, 1.0, 0.2)[0].item()
    assert ReinforceLoss(agg="seq-mean-token-sum").pg_loss(batch)[0].item() == \
        PF.reinforce_loss(logp, adv, mask, "seq-mean-token-sum")[0].item()
    # the KL term of PPOLoss is added to a variant's policy term
    batch[K.REF_LOG_PROBS] = old
    out = SAPOLoss(kl_coef=0.5, kl_type="k1")(batch)
    kl = F.agg_loss(logp - old, mask, "seq-mean-token-mean")
    assert out.loss.item() == pytest.approx(out.stats["actor/pg_loss"] + 0.5 * kl.item(), rel=1e-9)
    assert "actor/gate_mean" in out.stats and "actor/kl_loss" in out.stats
    assert LOSS_MODES["geo_mean"] is GMPOLoss and LOSS_MODES["gpg"] is ReinforceLoss


# every policy-loss class: verl's loss_mode table and the ones named in the docs
ALL_POLICY_LOSSES = sorted(set(LOSS_MODES.values()) | {ReinforceLoss, ClipCovLoss, KLCovLoss}, key=lambda c: c.__name__)
# their per-token loss depends on the row's other tokens (sequence ratio / geometric mean), so a zero weight on
# one token is no removal of that token: checked on whole rows only. GMPO takes the weights' geometric mean per row
# (verl), so a row with a zero weight is (nearly, 1e-10 ** (1 / |y|)) cut out whole.
ROW_COUPLED = (GSPOLoss, GMPOLoss)


@pytest.mark.parametrize("cls", ALL_POLICY_LOSSES, ids=lambda c: c.__name__)
def test_every_policy_loss_honours_is_weights(cls):
    """is_weights=True multiplies the per-token policy loss by batch["is_weights"], in every aggregation mode."""
    logp, old, adv, mask = random_inputs(8)
    logp = logp.clone().requires_grad_(True)
    batch = batch_of(logp, old, adv, mask)
    batch[K.REF_LOG_PROBS] = old - 0.3
    gen = torch.Generator().manual_seed(0)
    batch[K.COV_SELECTED] = torch.rand(mask.shape, generator=gen) < 0.3  # read by Clip-Cov / KL-Cov only
    assert K.IS_WEIGHTS in cls(is_weights=True).in_keys and K.IS_WEIGHTS not in cls().in_keys

    def weighted(w):
        out = batch.clone(False)
        out[K.IS_WEIGHTS] = w
        return out

    ones, twos = torch.ones_like(old), torch.full_like(old, 2.0)
    for agg in MODES:
        plain = cls(agg=agg).pg_loss(batch)[0]
        assert plain.abs().item() > 1e-3, agg  # not vacuous
        # w = 1 everywhere: the loss of is_weights=False
        assert cls(agg=agg, is_weights=True).pg_loss(weighted(ones))[0].item() == pytest.approx(plain.item(), rel=1e-9)
        # w = 2: the policy term and its gradient double (rel 1e-7: GMPO's geometric mean divides by |y| + 1e-8)
        double = cls(agg=agg, is_weights=True).pg_loss(weighted(twos))[0]
        assert double.item() == pytest.approx(2 * plain.item(), rel=1e-7), agg
        torch.testing.assert_close(grad_of(double, logp), 2 * grad_of(plain, logp))
    # w = 2 in the full loss: only the policy term doubles, not the KL term
    out, out2 = cls(kl_coef=0.1, kl_type="k1")(batch), cls(kl_coef=0.1, kl_type="k1", is_weights=True)(weighted(twos))
    assert out2.stats["actor/pg_loss"] == pytest.approx(2 * out.stats["actor/pg_loss"], rel=1e-7)
    assert out2.stats["actor/kl_loss"] == out.stats["actor/kl_loss"]
    assert out2.loss.item() == pytest.approx(out.loss.item() + out.stats["actor/pg_loss"], rel=1e-7)

    # w = 0 on some tokens (token-mean): their terms leave the numerator, the denominator keeps every valid token
    def removed(keep):
        fewer = batch.clone(False)
        fewer[K.RESPONSE_MASK] = mask * keep
        return cls(agg="token-mean").pg_loss(fewer, Aggregation(num_tokens=mask.sum()))[0].item()

    zero_rows = torch.ones_like(old)
    zero_rows[[0, 3]] = 0.0
    assert mask[[0, 3]].sum() > 0
    zeros = [zero_rows]
    if cls not in ROW_COUPLED:
        zeros.append((torch.rand(mask.shape, generator=gen, dtype=old.dtype) > 0.3).to(old.dtype))
    for w in zeros:
        got = cls(agg="token-mean", is_weights=True).pg_loss(weighted(w))[0].item()
        assert got == pytest.approx(removed(w), rel=1e-9, abs=1e-9)
        assert got != pytest.approx(cls(agg="token-mean").pg_loss(batch)[0].item(), rel=1e-6)


def test_cov_losses_read_the_selection():
    logp, old, adv, mask = random_inputs(6)
    batch = batch_of(logp, old, adv, mask)
    for loss in (ClipCovLoss(clip_cov_ratio=0.2, clip_cov_lb=0.0, clip_cov_ub=10.0), KLCovLoss(kl_cov_ratio=0.2)):
        assert K.COV_SELECTED in loss.in_keys
        with pytest.raises(KeyError, match=K.COV_SELECTED):
            loss(batch)
        sel = loss.selection()
        assert isinstance(sel, CovSelection) and sel.out_keys == (K.COV_SELECTED,)
        chain = Chain(sel)
        assert K.OLD_LOG_PROBS in chain.in_keys  # so the Trainer computes old log-probs for it
        out = chain(batch.clone())
        assert out[K.COV_SELECTED].sum() == max(int(0.2 * mask.sum()), 1)
        assert loss(out).loss.isfinite()
    with pytest.raises(ValueError, match="clip_cov_ratio"):
        ClipCovLoss(clip_cov_ratio=0)
    with pytest.raises(ValueError, match="kl_cov_ratio"):
        KLCovLoss(kl_cov_ratio=-1)


def test_clip_cov_generator_state_is_checkpointed():
    logp, old, adv, mask = random_inputs(7)
    gen = torch.Generator().manual_seed(0)
    loss = ClipCovLoss(clip_cov_ratio=0.05, clip_cov_lb=-10.0, clip_cov_ub=10.0, generator=gen)
    sel = loss.selection()
    state = sel.state_dict()
    first = sel(batch_of(logp, old, adv, mask))[K.COV_SELECTED].clone()
    sel.load_state_dict(state)
    assert torch.equal(sel(batch_of(logp, old, adv, mask))[K.COV_SELECTED], first)


# ---------------------------------------------------------------- micro-batch invariance


def random_batch(gen, b=8, r=6):
    mask = (torch.rand(b, r, generator=gen) < 0.75).long()
    mask *= (torch.arange(r)[None] < torch.randint(1, r + 1, (b,), generator=gen)[:, None]).long()
    mask[2] = 0
    rand = lambda: torch.randn(b, r, generator=gen, dtype=torch.float64)  # noqa: E731
    return TensorDict({"x": rand(), K.OLD_LOG_PROBS: -rand().abs(), K.REF_LOG_PROBS: -rand().abs(),
                       K.ADVANTAGES: rand(), K.RESPONSE_MASK: mask, K.IS_WEIGHTS: rand().abs()}, batch_size=[b])


def with_policy(batch, theta):
    out = batch.clone(False)
    out[K.LOG_PROBS] = batch[K.OLD_LOG_PROBS] + 0.5 * torch.tanh(batch["x"] * theta)
    out[K.ENTROPY] = torch.nn.functional.softplus(batch["x"] * theta)
    return out


LOSSES = {
    "gspo": lambda agg: GSPOLoss(clip_ratio_low=0.05, clip_ratio_high=0.1, agg=agg, kl_coef=0.3, is_weights=True),
    "cispo": lambda agg: CISPOLoss(agg=agg, entropy_coef=0.05),
    "sapo": lambda agg: SAPOLoss(agg=agg, kl_coef=0.1),
    "reinforce": lambda agg: ReinforceLoss(agg=agg, is_weights=True),
    "gmpo": lambda agg: GMPOLoss(0.1, 0.2, agg=agg, is_weights=True),
    "clip_cov": lambda agg: ClipCovLoss(0.1, 0.0, 3.0, agg=agg, generator=torch.Generator().manual_seed(0)),
    "kl_cov": lambda agg: KLCovLoss(0.2, 1.0, agg=agg),
    "dapo": lambda agg: PPOLoss(clip_ratio_low=0.2, clip_ratio_high=0.28, agg=agg),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_reproduce_mini_batch(name, mode):
    """Summed micro-batch losses (mini-batch counts) equal the mini-batch loss and gradient."""
    gen = torch.Generator().manual_seed(11)
    batch = random_batch(gen)
    theta = torch.randn(6, dtype=torch.float64, requires_grad=True)
    loss_fn = LOSSES[name](mode)
    if hasattr(loss_fn, "selection"):  # chosen once on the whole batch, before the split (as in the Trainer)
        batch = loss_fn.selection()(with_policy(batch, theta.detach()))
        assert batch[K.COV_SELECTED].any()
    mask = batch[K.RESPONSE_MASK]
    counts = Aggregation(num_tokens=mask.sum(), num_seqs=(mask.sum(-1) > 0).sum())
    full = loss_fn(with_policy(batch, theta))
    (g_full,) = torch.autograd.grad(full.loss, theta)
    for split in ([3, 1, 4], [1] * 8):
        total, g_sum = 0.0, torch.zeros_like(theta)
        for idx in torch.arange(8).split(split):
            part = loss_fn(with_policy(batch[idx], theta), counts)
            g_sum += torch.autograd.grad(part.loss, theta)[0]
            total += part.loss.item()
        assert total == pytest.approx(full.loss.item(), rel=1e-9, abs=1e-12)
        torch.testing.assert_close(g_sum, g_full)
    assert g_full.abs().sum() > 0  # the comparison is not vacuous
