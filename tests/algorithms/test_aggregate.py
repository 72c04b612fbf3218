"""aggregate: the whole-batch sum reaches every module that needs it as a value set once (no ambient state),
and the Trainer's loss call keeps the earlier contract working with a warning."""

import pytest
import torch
from tensordict import TensorDict

from rlflow.algorithms import (GRPO, Aggregation, AdaptiveKLController, ClipCovLoss, KLInReward, PPOLoss,
                               ReinforcePlusPlus, TruncatedIS)
from rlflow.algorithms.aggregate import call_loss, share_batch_sum
from rlflow.data import keys as K
from rlflow.module import Chain


def twice(x):
    """What a sum over two processes that hold equal shares of the batch returns."""
    return 2 * x


def test_share_batch_sum_reaches_every_whole_batch_module():
    loss = ClipCovLoss()
    kl, tis, grpo = KLInReward(AdaptiveKLController()), TruncatedIS(batch_normalize=True), GRPO()
    selection = loss.selection()
    estimator = Chain(kl, tis, grpo, selection)
    assert all(m.sum_fn is None for m in (kl, tis, grpo, selection))  # the default: this process holds the batch
    share_batch_sum(twice, estimator)
    assert all(m.sum_fn is twice for m in (kl, tis, grpo, selection))
    other = ReinforcePlusPlus()
    assert other.sum_fn is None  # set on the instances reached, not on the class


def test_an_estimator_whitens_with_its_sum():
    """REINFORCE++ on one share with the two-process sum gives the advantages of the whole (doubled) batch."""
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(4, 5, generator=gen)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])

    def batch(n):
        data = {K.TOKEN_REWARDS: rewards.repeat(n, 1) * mask.repeat(n, 1), K.RESPONSE_MASK: mask.repeat(n, 1)}
        return TensorDict(data, batch_size=[4 * n])

    whole = ReinforcePlusPlus()(batch(2))[K.ADVANTAGES][:4]
    share = ReinforcePlusPlus()
    share_batch_sum(twice, share)
    torch.testing.assert_close(share(batch(1))[K.ADVANTAGES], whole)
    assert not torch.allclose(ReinforcePlusPlus()(batch(1))[K.ADVANTAGES], whole)  # the sum changed the result


class OldContractLoss:
    """A loss object written for ``loss(batch, num_tokens=, num_seqs=)`` (before Aggregation)."""

    in_keys = PPOLoss().in_keys

    def __init__(self):
        self.inner = PPOLoss()

    def __call__(self, batch, num_tokens=None, num_seqs=None):
        self.counts = (num_tokens, num_seqs)
        with pytest.warns(DeprecationWarning):
            return self.inner(batch, num_tokens=num_tokens, num_seqs=num_seqs)


def test_call_loss_keeps_the_old_contract_with_a_warning():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    batch = TensorDict({K.LOG_PROBS: logp, K.OLD_LOG_PROBS: logp.detach(), K.RESPONSE_MASK: torch.tensor([[1, 1, 0]]),
                        K.ADVANTAGES: torch.tensor([[2.0, -1.0, 5.0]])}, batch_size=[1])
    agg = Aggregation(num_tokens=torch.tensor(4.0), num_seqs=torch.tensor(2.0), dp_size=1)
    old = OldContractLoss()
    with pytest.warns(DeprecationWarning, match=r"OldContractLoss.__call__\(batch, num_tokens, num_seqs\) is deprec"):
        out = call_loss(old, batch, agg)
    assert old.counts == (agg.num_tokens, agg.num_seqs)
    new = call_loss(PPOLoss(), batch, agg).loss.item()
    assert out.loss.item() == new == pytest.approx(-(2.0 - 1.0) / 4)  # divided by num_tokens, not by the call's 2
