"""Estimator shells: key mapping, hand-worked numbers, subclassing."""

import math

import pytest
import torch
from tensordict import TensorDict

from rlflow.algorithms import GAE, GRPO, AdvantageEstimator, functional
from rlflow.data import keys as K


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
    adv, ret = functional.gae_advantages(rewards, values, mask, 0.97, 0.9)
    torch.testing.assert_close(out[K.ADVANTAGES], adv)
    torch.testing.assert_close(out[K.RETURNS], ret)


def test_new_estimator_overrides_compute_only():
    class LeaveOneOut(AdvantageEstimator):
        """RLOO: s_i minus the mean of the other samples of its group."""

        def compute(self, batch):
            s = batch[K.TOKEN_REWARDS].sum(-1)
            mean, _, n = functional.group_stats(s, batch[K.GROUP])
            a = (s - mean) * n / (n - 1).clamp(min=1)
            adv = a[:, None] * batch[K.RESPONSE_MASK]
            return adv, adv

    rewards = torch.tensor([[1.0], [0.0], [0.0]])
    out = LeaveOneOut()(make_batch(rewards, torch.ones(3, 1), torch.tensor([2, 2, 2])))
    # 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5
    torch.testing.assert_close(out[K.ADVANTAGES], torch.tensor([[1.0], [-0.5], [-0.5]]))
    torch.testing.assert_close(out[K.RETURNS], out[K.ADVANTAGES])
