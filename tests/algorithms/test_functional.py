"""functional: masked statistics, group statistics, KL estimators and loss aggregation,
against hand-worked numbers and straightforward loops (GRPO/GAE: test_estimators; PPO/value: test_losses)."""

import math

import pytest
import torch

from rlflow.algorithms import functional as F
from rlflow.algorithms.aggregate import Aggregation

ALL_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum")


def random_mask(b, r, gen, empty_rows=(0,)):
    """Right-padded masks with holes (tool tokens) and some all-zero rows."""
    mask = (torch.rand(b, r, generator=gen) < 0.7).double()
    mask *= (torch.arange(r)[None, :] < torch.randint(1, r + 1, (b,), generator=gen)[:, None]).double()
    mask[list(empty_rows)] = 0
    return mask


# ---------------------------------------------------------------- masked helpers


def test_masked_mean_sum_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1, 1, 0], [0, 1, 0]])
    assert F.masked_sum(x, m).item() == pytest.approx(8.0)  # 1 + 2 + 5
    assert F.masked_mean(x, m).item() == pytest.approx(8 / 3)
    torch.testing.assert_close(F.masked_mean(x, m, dim=-1), torch.tensor([1.5, 5.0]))  # (1+2)/2, 5/1
    torch.testing.assert_close(F.masked_sum(x, m, dim=0), torch.tensor([1.0, 7.0, 0.0]))


def test_masked_mean_empty_is_zero():
    x = torch.randn(2, 3)
    m = torch.zeros(2, 3)
    assert F.masked_mean(x, m).item() == 0.0
    m[0, 1] = 1
    out = F.masked_mean(x, m, dim=-1)
    assert torch.isfinite(out).all() and out[1].item() == 0.0
    assert out[0].item() == pytest.approx(x[0, 1].item(), rel=1e-6)


def test_masked_var_by_hand():
    x = torch.tensor([[1.0, 2.0, 100.0], [-7.0, 5.0, 100.0]])
    m = torch.tensor([[1, 1, 0], [0, 1, 0]])
    # valid 1, 2, 5; mean 8/3; squared deviations 25/9 + 4/9 + 49/9 = 78/9
    assert F.masked_var(x, m).item() == pytest.approx(78 / 9 / 2, rel=1e-5)  # unbiased: / (n-1)
    assert F.masked_var(x, m, unbiased=False).item() == pytest.approx(78 / 9 / 3, rel=1e-5)


@pytest.mark.parametrize("n_valid", [0, 1])
def test_masked_var_and_whiten_with_too_few_entries(n_valid):
    x = torch.tensor([[3.0, 4.0, 5.0]])
    m = torch.tensor([[0, 1, 0]]) if n_valid else torch.zeros(1, 3)
    assert F.masked_var(x, m).item() == 0.0
    w = F.masked_whiten(x, m)
    assert torch.isfinite(w).all()
    # only centred: mean is 4 (one entry) or 0 (none); the single valid entry becomes 0
    expected = x - 4.0 if n_valid else x
    torch.testing.assert_close(w, expected)


def test_masked_whiten_by_hand():
    x = torch.tensor([[1.0, 3.0, 50.0]])
    m = torch.tensor([[1, 1, 0]])
    # mean 2, unbiased var ((1-2)^2 + (3-2)^2) / 1 = 2
    expected = (x - 2.0) / math.sqrt(2.0 + 1e-8)
    torch.testing.assert_close(F.masked_whiten(x, m), expected)  # padding is not re-masked (verl)
    torch.testing.assert_close(F.masked_whiten(x, m, shift_mean=False), expected + 2.0)


# ---------------------------------------------------------------- group statistics


def test_group_stats_by_hand_arbitrary_ids():
    scores = torch.tensor([1.0, 2.0, 3.0, 10.0, 5.0])
    group = torch.tensor([7, -3, 7, 100, -3])
    mean, std, count = F.group_stats(scores, group)
    # group 7: {1, 3} mean 2, std sqrt(2); group -3: {2, 5} mean 3.5, std sqrt(4.5); group 100: {10}
    torch.testing.assert_close(mean, torch.tensor([2.0, 3.5, 2.0, 10.0, 3.5]))
    s2, s45 = math.sqrt(2), math.sqrt(4.5)
    torch.testing.assert_close(std, torch.tensor([s2, s45, s2, 0.0, s45]))
    assert count.tolist() == [2, 2, 2, 1, 2]


def test_group_stats_matches_loop():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(40, generator=gen, dtype=torch.float64)
    group = torch.randint(-5, 1000, (13,), generator=gen)[torch.randint(0, 13, (40,), generator=gen)]
    mean, std, count = F.group_stats(scores, group)
    for i in range(40):
        members = scores[group == group[i]]
        assert count[i].item() == len(members)
        assert mean[i].item() == pytest.approx(members.mean().item())
        assert std[i].item() == pytest.approx(members.std().item() if len(members) > 1 else 0.0, abs=1e-12)


# ---------------------------------------------------------------- KL


def test_kl_kinds_by_hand():
    logp = torch.tensor([-1.0, -2.0, -1.0])
    ref = torch.tensor([-1.5, -1.0, -6.0])  # logp - ref = [0.5, -1, 5]
    expect = {
        "kl": [0.5, -1.0, 5.0],
        "abs": [0.5, 1.0, 5.0],
        "mse": [0.125, 0.5, 12.5],
        # d = ref - logp = [-0.5, 1, -5]: exp(d) - d - 1
        "low_var_kl": [math.exp(-0.5) - 0.5, math.exp(1) - 2, math.exp(-5) + 4],
    }
    aliases = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}
    for kind in list(expect) + list(aliases):
        got = F.kl_penalty(logp, ref, kind)
        torch.testing.assert_close(got, torch.tensor(expect[aliases.get(kind, kind)]), msg=kind)
    assert F.kl_penalty(logp, ref).equal(F.kl_penalty(logp, ref, "low_var_kl"))  # the default


def test_low_var_kl_clamps():
    logp = torch.tensor([0.0, -100.0, 0.0])
    ref = torch.tensor([-30.0, 0.0, -12.0])
    # d = -30 -> clamp -20: exp(-20) + 19 -> clamp 10; d = 100 -> clamp 20: exp(20) - 21 -> clamp 10;
    # d = -12: exp(-12) + 11 -> 10 (the outer clamp)
    got = F.kl_penalty(logp, ref, "k3")
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, torch.tensor([10.0, 10.0, 10.0]))
    small = F.kl_penalty(torch.tensor([0.0]), torch.tensor([-8.0]), "k3")  # exp(-8) + 7, under the clamp
    # the inner clamp keeps exp() finite, so the gradient is 0 and not 0 * inf = NaN
    far = torch.tensor([-100.0], requires_grad=True)
    (grad,) = torch.autograd.grad(F.kl_penalty(far, torch.tensor([0.0]), "k3").sum(), far)
    assert grad.item() == 0.0
    assert small.item() == pytest.approx(math.exp(-8) + 7, rel=1e-6)


def test_kl_straight_through_suffix():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0])
    val = F.kl_penalty(logp, ref, "k3+")
    torch.testing.assert_close(val, F.kl_penalty(logp, ref, "k3"))  # k3 value
    (grad,) = torch.autograd.grad(val.sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([0.5, -1.0]))  # k2 gradient: logp - ref


def test_kl_unknown_kind():
    with pytest.raises(ValueError, match="low_var_kl"):
        F.kl_penalty(torch.zeros(2), torch.zeros(2), "full")


# ---------------------------------------------------------------- aggregation


L_HAND = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 10.0, 11.0, 12.0]])
M_HAND = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize(
    "mode, kwargs, expected",
    [
        ("token-mean", {}, 8 / 3),  # (1 + 2 + 5) / 3 tokens
        ("token-mean", {"num_tokens": 10}, 0.8),
        ("seq-mean-token-sum", {}, 4.0),  # seq sums [3, 5, (empty)] / 2 non-empty seqs
        ("seq-mean-token-sum", {"num_seqs": 4}, 2.0),
        ("seq-mean-token-mean", {}, 3.25),  # seq means [1.5, 5] / 2
        ("seq-mean-token-mean", {"num_seqs": 5}, 1.3),
        ("seq-mean-token-sum-norm", {}, 1.0),  # (3 + 5) / 2 non-empty seqs / R=4 (verl 0.9.1)
        ("seq-mean-token-sum-norm", {"norm_length": 8, "num_seqs": 4, "num_tokens": 99}, 0.25),  # 8 / 4 / 8
        ("token-sum", {}, 8.0),  # 1 + 2 + 5
        ("token-sum", {"num_tokens": 99, "num_seqs": 99, "norm_length": 7}, 8.0),  # no count divides it
    ],
)
def test_agg_loss_by_hand(mode, kwargs, expected):
    assert F.agg_loss(L_HAND, M_HAND, mode, **kwargs).item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_agg_loss_empty_mask_is_zero(mode):
    out = F.agg_loss(torch.randn(3, 4), torch.zeros(3, 4), mode)
    assert out.item() == 0.0


def test_agg_loss_unknown_mode():
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        F.agg_loss(L_HAND, M_HAND, "mean")


def agg_loop(loss, mask, mode):
    """The five modes written out with Python loops over sequences and tokens."""
    seqs, tokens, n_tok = [], 0.0, 0
    for i in range(loss.shape[0]):
        valid = [loss[i, t].item() for t in range(loss.shape[1]) if mask[i, t] > 0]
        tokens += sum(valid)
        n_tok += len(valid)
        if valid:
            seqs.append(sum(valid) / len(valid) if mode == "seq-mean-token-mean" else sum(valid))
    if mode == "token-mean":
        return tokens / n_tok
    if mode == "token-sum":
        return tokens
    if mode == "seq-mean-token-sum-norm":
        return sum(seqs) / len(seqs) / loss.shape[1]
    return sum(seqs) / len(seqs)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_agg_loss_matches_loop(mode):
    gen = torch.Generator().manual_seed(3)
    loss = torch.randn(7, 5, generator=gen, dtype=torch.float64)
    mask = random_mask(7, 5, gen, empty_rows=(2,))
    assert F.agg_loss(loss, mask, mode).item() == pytest.approx(agg_loop(loss, mask, mode), rel=1e-6)


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("split", [[8], [3, 1, 4], [1] * 8, [2, 6]])
def test_agg_loss_micro_batches_sum_to_mini_batch(mode, split):
    """Summing micro-batch losses with the mini-batch counts gives the mini-batch loss and gradient."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(8, 6, generator=gen, dtype=torch.float64)
    mask = random_mask(8, 6, gen, empty_rows=(0, 5))
    theta = torch.randn(6, dtype=torch.float64, requires_grad=True)
    counts = dict(num_tokens=mask.sum(), num_seqs=(mask.sum(-1) > 0).sum(), norm_length=6)

    full = F.agg_loss(torch.sin(x * theta) * x, mask, mode)
    (g_full,) = torch.autograd.grad(full, theta)
    total, g_sum = 0.0, torch.zeros_like(theta)
    for idx in torch.arange(8).split(split):
        part = F.agg_loss(torch.sin(x[idx] * theta) * x[idx], mask[idx], mode, **counts)
        g_sum += torch.autograd.grad(part, theta)[0]
        total += part.item()
    assert total == pytest.approx(full.item(), rel=1e-9, abs=1e-12)
    torch.testing.assert_close(g_sum, g_full)


def test_token_sum_on_two_processes_is_the_sum_over_both():
    """Two ranks, each with half the rows and gradients averaged (as DDP/FSDP do), with ``dp_size=2``
    (an argument, or ``Aggregation(dp_size=2)``): the averaged gradient is that of the sum over every token
    (verl's ``dp_size``)."""
    gen = torch.Generator().manual_seed(5)
    theta = torch.randn(6, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = random_mask(6, 5, gen, empty_rows=(4,))
    whole = torch.autograd.grad(F.agg_loss(theta ** 2, mask, "token-sum"), theta)[0]
    for reduce in (lambda x, m: F.agg_loss(x, m, "token-sum", dp_size=2), Aggregation("token-sum", dp_size=2)):
        ranks = [torch.autograd.grad(reduce(theta[rows] ** 2, mask[rows]), theta)[0]
                 for rows in (slice(0, 3), slice(3, 6))]
        torch.testing.assert_close((ranks[0] + ranks[1]) / 2, whole)
    torch.testing.assert_close(whole, 2 * theta.detach() * mask)  # d/dθ Σ θ²·M, by hand


@pytest.mark.parametrize("mode", ALL_MODES)
def test_aggregation_is_agg_loss(mode):
    """``Aggregation`` is ``agg_loss``'s arguments as one value; the loss's mode and norm_length fill it in."""
    gen = torch.Generator().manual_seed(8)
    loss, mask = torch.randn(5, 6, generator=gen), random_mask(5, 6, gen, empty_rows=(2,))
    counts = dict(num_tokens=torch.tensor(40.0), num_seqs=torch.tensor(7.0))
    expected = F.agg_loss(loss, mask, mode, **counts, norm_length=9)
    assert Aggregation(**counts).using(mode, 9)(loss, mask).item() == expected.item()
    assert Aggregation(mode, **counts, norm_length=9)(loss, mask).item() == expected.item()
    assert Aggregation()(loss, mask).item() == F.agg_loss(loss, mask).item()  # no mode: token-mean


def test_aggregation_refuses_bad_values():
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'mean'; valid modes"):
        Aggregation("mean")
    with pytest.raises(ValueError, match="dp_size must be an int >= 1, got 0"):
        Aggregation(dp_size=0)
    with pytest.raises(ValueError, match="mode='token-sum', but the loss aggregates with 'token-mean'"):
        Aggregation("token-sum").using("token-mean")


def test_whole_batch_sums_are_an_argument_not_ambient_state():
    """``sum_fn`` reaches the statistics as an argument: with a sum over two processes that hold equal shares
    (``2 x``), whitening one share gives the whitening of the whole (both shares) batch."""
    gen = torch.Generator().manual_seed(9)
    x, m = torch.randn(4, 5, generator=gen, dtype=torch.float64), random_mask(4, 5, gen)
    whole = F.masked_whiten(torch.cat([x, x]), torch.cat([m, m]))[:4]
    twice = lambda t: 2 * t  # noqa: E731 - what a sum over two processes with equal shares returns
    torch.testing.assert_close(F.masked_whiten(x, m, sum_fn=twice), whole)
    assert not torch.allclose(F.masked_whiten(x, m), whole)  # n / (n - 1) differs: the check is not vacuous
    for removed in (lambda: F.batch_statistics(twice), lambda: F.data_parallel(2)):
        with pytest.raises(RuntimeError, match="was removed: the functional core reads no ambient state"):
            with removed():
                pass
