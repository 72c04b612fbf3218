"""Advantage estimators: the functional GRPO/GAE against hand-worked numbers and loops, then the shells."""

import math

import pytest
import torch
from tensordict import TensorDict

from rlflow.algorithms import GAE, GRPO, AdvantageEstimator
from rlflow.algorithms import functional as F
from rlflow.data import keys as K


def random_mask(b, r, gen, empty_rows=(0,)):
    """Right-padded masks with holes (tool tokens) and some all-zero rows."""
    mask = (torch.rand(b, r, generator=gen) < 0.7).double()
    mask *= (torch.arange(r)[None, :] < torch.randint(1, r + 1, (b,), generator=gen)[:, None]).double()
    mask[list(empty_rows)] = 0
    return mask


# ---------------------------------------------------------------- functional: GRPO


def test_grpo_by_hand():
    # sequence scores s = [1, 0, 0.5, 2] (reward on the last valid token); groups 5,5,5 and a singleton 9
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 2.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    group = torch.tensor([5, 5, 5, 9])
    adv, ret = F.grpo_advantages(rewards, mask, group)
    # group 5: mean 0.5, unbiased std sqrt((0.25 + 0.25 + 0) / 2) = 0.5; singleton: mean 0, std 1
    a = torch.tensor([0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), 0.0, 2.0 / (1 + 1e-6)])
    torch.testing.assert_close(adv, a[:, None] * mask)
    torch.testing.assert_close(ret, adv)
    adv, _ = F.grpo_advantages(rewards, mask, group, norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 2.0])[:, None] * mask)


def test_grpo_all_equal_group_is_zero_not_nan():
    rewards = torch.ones(4, 3)
    adv, _ = F.grpo_advantages(rewards, torch.ones(4, 3), torch.tensor([1, 1, 2, 2]))
    assert torch.equal(adv, torch.zeros(4, 3))  # std 0: 0 / (0 + eps) = 0


def test_grpo_matches_verl_loop():
    gen = torch.Generator().manual_seed(1)
    b, r = 24, 7
    rewards = torch.randn(b, r, generator=gen, dtype=torch.float64)
    mask = random_mask(b, r, gen)
    group = torch.tensor([3, 3, 3, 8, 8, 42, 0, 0, 0, 0, 11, 11] * 2)
    group[-1] = 999  # a singleton
    adv, _ = F.grpo_advantages(rewards, mask, group)
    s = rewards.sum(-1)
    for i in range(b):  # verl's id2score loop
        members = s[group == group[i]]
        mean, std = (members.mean(), members.std()) if len(members) > 1 else (0.0, 1.0)
        torch.testing.assert_close(adv[i], (s[i] - mean) / (std + 1e-6) * mask[i])


# ---------------------------------------------------------------- GAE


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.2, 0.7]])
    mask = torch.ones(1, 3)
    adv, ret = F.gae_advantages(rewards, values, mask, whiten=False)
    # gamma = lam = 1: t2 delta = 1 - 0.7 = 0.3; t1 0.7 - 0.2 = 0.5 -> 0.8; t0 0.2 - 0.5 = -0.3 -> 0.5
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.8, 0.3]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0]]))
    adv, ret = F.gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5, whiten=False)
    # t2 0.3; t1 delta 0.9*0.7 - 0.2 = 0.43, A = 0.43 + 0.45*0.3 = 0.565
    # t0 delta 0.9*0.2 - 0.5 = -0.32, A = -0.32 + 0.45*0.565 = -0.06575
    torch.testing.assert_close(adv, torch.tensor([[-0.06575, 0.565, 0.3]]))
    torch.testing.assert_close(ret, torch.tensor([[0.43425, 0.765, 1.0]]))


def test_gae_skips_masked_step_by_hand():
    rewards = torch.tensor([[0.0, 5.0, 1.0, 7.0]])  # rewards on masked steps are never used
    values = torch.tensor([[0.5, 99.0, 0.7, 3.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    adv, ret = F.gae_advantages(rewards, values, mask, whiten=False)
    # t3 padding: carries zeros. t2: 1 - 0.7 = 0.3. t1 masked: carries A = 0.3, V_next = 0.7.
    # t0: delta = 0.7 - 0.5 = 0.2, A = 0.5 (the tool step at t1 is invisible)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0, 0.3, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 99.3, 1.0, 3.0]]))  # A (carried) + V, unmasked


def test_gae_whitened_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.2, 0.7]])
    adv, _ = F.gae_advantages(rewards, values, torch.ones(1, 3))
    # raw [0.5, 0.8, 0.3]: mean 1.6/3, unbiased var = sum((a - mean)^2) / 2
    mean = 1.6 / 3
    var = ((0.5 - mean) ** 2 + (0.8 - mean) ** 2 + (0.3 - mean) ** 2) / 2
    expected = [(a - mean) / math.sqrt(var + 1e-8) for a in (0.5, 0.8, 0.3)]
    torch.testing.assert_close(adv, torch.tensor([expected]))


def gae_loop(rewards, values, mask, gamma, lam):
    """Textbook GAE over each sample's valid steps only; masked steps copy the next valid step's A."""
    adv = torch.zeros_like(values)
    for i in range(values.shape[0]):
        valid = [t for t in range(values.shape[1]) if mask[i, t] > 0]
        a_next, v_next = 0.0, 0.0
        for t in reversed(valid):
            a_next = rewards[i, t].item() + gamma * v_next - values[i, t].item() + gamma * lam * a_next
            v_next = values[i, t].item()
            adv[i, t] = a_next
        carried = 0.0
        for t in reversed(range(values.shape[1])):
            carried = adv[i, t].item() if mask[i, t] > 0 else carried
            adv[i, t] = carried
    return adv, adv + values


def test_gae_matches_loop_and_ignores_masked_values():
    gen = torch.Generator().manual_seed(2)
    b, r = 6, 9
    rewards = torch.randn(b, r, generator=gen, dtype=torch.float64)
    values = torch.randn(b, r, generator=gen, dtype=torch.float64)
    mask = random_mask(b, r, gen, empty_rows=(3,))
    raw, ret = F.gae_advantages(rewards, values, mask, gamma=0.95, lam=0.9, whiten=False)
    ref_adv, ref_ret = gae_loop(rewards, values, mask, 0.95, 0.9)
    torch.testing.assert_close(raw, ref_adv * mask)
    torch.testing.assert_close(ret, ref_ret)
    adv, ret = F.gae_advantages(rewards, values, mask, gamma=0.95, lam=0.9)
    n = mask.sum()
    mean = (ref_adv * mask).sum() / n
    var = (((ref_adv - mean) * mask) ** 2).sum() / (n - 1)
    torch.testing.assert_close(adv, (ref_adv - mean) / torch.sqrt(var + 1e-8) * mask)
    # values at masked (tool/padding) positions change nothing where it matters (verl's test)
    other = torch.where(mask > 0, values, torch.randn(b, r, generator=gen, dtype=torch.float64) * 100)
    adv2, ret2 = F.gae_advantages(rewards, other, mask, gamma=0.95, lam=0.9)
    torch.testing.assert_close(adv2, adv)
    torch.testing.assert_close(ret2 * mask, ret * mask)


# ---------------------------------------------------------------- estimator shells


def make_batch(rewards, mask, group, values=None):
    data = {K.TOKEN_REWARDS: rewards, K.RESPONSE_MASK: mask, K.GROUP: group}
    if values is not None:
        data[K.VALUES] = values
    return TensorDict(data, batch_size=[rewards.shape[0]])


def test_grpo_writes_advantages_by_hand():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [3.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    batch = make_batch(rewards, mask, torch.tensor([10, 10, 4]))
    out = GRPO()(batch)
    assert out is batch
    # group 10: scores 1, 0 -> mean 0.5, std sqrt(0.5); group 4 is a singleton: 3 / (1 + 1e-6)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    expected = torch.tensor([[a, a], [-a, 0.0], [3 / (1 + 1e-6)] * 2])
    torch.testing.assert_close(out[K.ADVANTAGES], expected)
    torch.testing.assert_close(out[K.RETURNS], expected)
    out = GRPO(norm_by_std=False)(make_batch(rewards, mask, torch.tensor([10, 10, 4])))
    torch.testing.assert_close(out[K.ADVANTAGES], torch.tensor([[0.5, 0.5], [-0.5, 0.0], [3.0, 3.0]]))


def test_grpo_declares_keys_and_args():
    est = GRPO(norm_by_std=False, eps=1e-3)
    assert (est.norm_by_std, est.eps) == (False, 1e-3)
    assert est.in_keys == (K.TOKEN_REWARDS, K.RESPONSE_MASK, K.GROUP)
    assert est.out_keys == (K.ADVANTAGES, K.RETURNS)
    assert GRPO.needs_critic is False
    batch = TensorDict({K.TOKEN_REWARDS: torch.zeros(2, 3), K.RESPONSE_MASK: torch.ones(2, 3)}, batch_size=[2])
    with pytest.raises(KeyError, match=K.GROUP):
        est(batch)


def test_advantages_carry_no_graph():
    rewards = torch.randn(4, 3, requires_grad=True)
    out = GRPO()(make_batch(rewards, torch.ones(4, 3), torch.tensor([0, 0, 1, 1])))
    assert not out[K.ADVANTAGES].requires_grad


def test_gae_by_hand_and_declared_keys():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 9.0, 0.2, 0.7]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0]])  # a tool token at t1, padding at t3
    out = GAE(gamma=0.9, lam=0.5)(make_batch(rewards, mask, torch.tensor([0]), values))
    # t2: delta = 1 - 0.2 = 0.8; t1 skipped (V_next stays 0.2, A stays 0.8)
    # t0: delta = 0.9 * 0.2 - 0.5 = -0.32; A = -0.32 + 0.45 * 0.8 = 0.04
    torch.testing.assert_close(out[K.RETURNS] * mask, torch.tensor([[0.54, 0.0, 1.0, 0.0]]))
    # whitened over the 2 valid entries: mean 0.42, unbiased var 2 * 0.38^2, then re-masked
    z = 0.38 / math.sqrt(2 * 0.38**2 + 1e-8)
    torch.testing.assert_close(out[K.ADVANTAGES], torch.tensor([[-z, 0.0, z, 0.0]]))
    assert GAE.needs_critic is True
    assert K.VALUES in GAE.in_keys and set(AdvantageEstimator.in_keys) <= set(GAE.in_keys)
    est = GAE(gamma=0.99, lam=0.95)
    assert (est.gamma, est.lam) == (0.99, 0.95)


def test_gae_matches_functional_on_random_batch():
    gen = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(5, 6, generator=gen), torch.randn(5, 6, generator=gen)
    mask = (torch.rand(5, 6, generator=gen) > 0.3).float()
    out = GAE(gamma=0.97, lam=0.9)(make_batch(rewards, mask, torch.arange(5), values))
    adv, ret = F.gae_advantages(rewards, values, mask, 0.97, 0.9)
    torch.testing.assert_close(out[K.ADVANTAGES], adv)
    torch.testing.assert_close(out[K.RETURNS], ret)


def test_new_estimator_overrides_compute_only():
    class LeaveOneOut(AdvantageEstimator):
        """RLOO: s_i minus the mean of the other samples of its group."""

        def compute(self, batch):
            s = batch[K.TOKEN_REWARDS].sum(-1)
            mean, _, n = F.group_stats(s, batch[K.GROUP])
            a = (s - mean) * n / (n - 1).clamp(min=1)
            adv = a[:, None] * batch[K.RESPONSE_MASK]
            return adv, adv

    rewards = torch.tensor([[1.0], [0.0], [0.0]])
    out = LeaveOneOut()(make_batch(rewards, torch.ones(3, 1), torch.tensor([2, 2, 2])))
    # 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5
    torch.testing.assert_close(out[K.ADVANTAGES], torch.tensor([[1.0], [-0.5], [-0.5]]))
    torch.testing.assert_close(out[K.RETURNS], out[K.ADVANTAGES])
