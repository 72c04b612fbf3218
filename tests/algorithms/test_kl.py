"""KL in the reward: the penalty by hand and against a loop, the controllers' update rule by hand,
the module's stats and controller update, and exact resume of the adaptive coefficient."""

import math

import pytest
import torch
from tensordict import TensorDict

from rlflow.algorithms import GRPO, AdaptiveKLController, FixedKLController, KLInReward
from rlflow.algorithms import functional as F
from rlflow.algorithms.kl import kl_in_reward, mean_sequence_kl
from rlflow.data import keys as K
from rlflow.module import Chain
from tests.trainer.helpers import make_trainer


def small():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -3.0]])
    ref = torch.tensor([[-1.5, -2.0, -1.0], [-0.5, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return rewards, old, ref, mask


def batch_of(rewards, old, ref, mask):
    data = {K.TOKEN_REWARDS: rewards, K.OLD_LOG_PROBS: old, K.REF_LOG_PROBS: ref, K.RESPONSE_MASK: mask}
    return TensorDict(data, batch_size=[rewards.shape[0]])


def test_kl_in_reward_by_hand():
    rewards, old, ref, mask = small()
    out, kld = kl_in_reward(rewards, old, ref, mask, beta=0.1, kind="kl")
    # kld = (old - ref) * mask = [[0.5, 0, 0.5], [-0.5, 0, 0 (masked: -2)]]
    torch.testing.assert_close(kld, torch.tensor([[0.5, 0.0, 0.5], [-0.5, 0.0, 0.0]]))
    torch.testing.assert_close(out, torch.tensor([[-0.05, 0.0, 0.95], [0.05, 2.0, 0.0]]))
    # per-sequence token means 1/3 and -0.25; batch mean (1/3 - 0.25) / 2
    torch.testing.assert_close(mean_sequence_kl(kld, mask), torch.tensor((1 / 3 - 0.25) / 2))
    _, kld = kl_in_reward(rewards, old, ref, mask, beta=0.1, kind="mse")
    torch.testing.assert_close(kld, torch.tensor([[0.125, 0.0, 0.125], [0.125, 0.0, 0.0]]))


@pytest.mark.parametrize("kind", ["kl", "abs", "mse", "low_var_kl"])
def test_kl_in_reward_matches_loop(kind):
    gen = torch.Generator().manual_seed(0)
    b, r = 6, 5
    rewards = torch.randn(b, r, generator=gen, dtype=torch.float64)
    old, ref = torch.randn(b, r, generator=gen, dtype=torch.float64), torch.randn(b, r, generator=gen, dtype=torch.float64)
    mask = (torch.rand(b, r, generator=gen) < 0.7).double()
    mask[2] = 0  # an empty sequence: not part of the batch mean
    out, kld = kl_in_reward(rewards, old, ref, mask, beta=0.3, kind=kind)
    per_seq = []
    for i in range(b):
        row = []
        for t in range(r):
            d = old[i, t].item() - ref[i, t].item()
            k = {"kl": d, "abs": abs(d), "mse": 0.5 * d * d,
                 "low_var_kl": min(max(math.exp(-d) + d - 1, -10), 10)}[kind] * mask[i, t].item()
            torch.testing.assert_close(out[i, t].item(), rewards[i, t].item() - 0.3 * k)
            if mask[i, t]:
                row.append(k)
        if row:
            per_seq.append(sum(row) / len(row))
    torch.testing.assert_close(mean_sequence_kl(kld, mask).item(), sum(per_seq) / len(per_seq))


def test_mean_sequence_kl_of_empty_batch_is_zero():
    assert mean_sequence_kl(torch.ones(3, 2), torch.zeros(3, 2)).item() == 0.0


def test_adaptive_controller_update_by_hand():
    ctl = AdaptiveKLController(init_coef=0.1, target_kl=0.5, horizon=100)
    ctl.update(0.55, n_steps=10)  # err = 0.55/0.5 - 1 = 0.1 -> value *= 1 + 0.1 * 10 / 100
    assert ctl.value == pytest.approx(0.1 * 1.01, rel=1e-12)
    ctl.update(0.6, n_steps=10)  # err 0.2 (at the clip) -> * 1.02
    assert ctl.value == pytest.approx(0.1 * 1.01 * 1.02, rel=1e-12)
    ctl.update(5.0, n_steps=10)  # err 9 clipped to 0.2
    assert ctl.value == pytest.approx(0.1 * 1.01 * 1.02 * 1.02, rel=1e-12)
    ctl.update(0.0, n_steps=50)  # err -1 clipped to -0.2 -> * (1 - 0.2 * 50 / 100)
    assert ctl.value == pytest.approx(0.1 * 1.01 * 1.02 * 1.02 * 0.9, rel=1e-12)
    ctl.update(0.5, n_steps=1000)  # on target: unchanged
    assert ctl.value == pytest.approx(0.1 * 1.01 * 1.02 * 1.02 * 0.9, rel=1e-12)


def test_fixed_controller_never_moves_and_adaptive_checks_args():
    ctl = FixedKLController(0.2)
    ctl.update(100.0, n_steps=1000)
    assert ctl.value == 0.2
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, 0.1, horizon=0)
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(0.1, 0.0, horizon=10)


def test_module_rewrites_rewards_updates_controller_and_reports():
    rewards, old, ref, mask = small()
    ctl = AdaptiveKLController(init_coef=0.1, target_kl=0.01, horizon=20)
    module = KLInReward(ctl)  # kind "kl", verl's default algorithm.kl_penalty
    out = module(batch_of(rewards.clone(), old, ref, mask))
    torch.testing.assert_close(out[K.TOKEN_REWARDS], torch.tensor([[-0.05, 0.0, 0.95], [0.05, 2.0, 0.0]]))
    kl = (1 / 3 - 0.25) / 2  # 0.041667 > target: err clipped to 0.2; n_steps = B = 2
    assert module.stats["actor/reward_kl_penalty"] == pytest.approx(kl)
    assert module.stats["actor/reward_kl_penalty_coeff"] == 0.1  # the beta used, before the update
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 2 / 20))
    out = module(batch_of(rewards.clone(), old, ref, mask))  # the next step uses the new beta
    torch.testing.assert_close(out[K.TOKEN_REWARDS][0, 0], torch.tensor(-0.5 * 0.1 * 1.02))
    assert module.stats["actor/reward_kl_penalty_coeff"] == pytest.approx(0.102)


def test_module_keys_kind_and_chain():
    module = KLInReward(FixedKLController(0.1), kind="low_var_kl")
    assert set(module.in_keys) == {K.TOKEN_REWARDS, K.OLD_LOG_PROBS, K.REF_LOG_PROBS, K.RESPONSE_MASK}
    assert module.out_keys == (K.TOKEN_REWARDS,)
    with pytest.raises(ValueError, match="unknown KL kind"):
        KLInReward(FixedKLController(0.1), kind="k9")
    rewards, old, ref, mask = small()
    out = module(batch_of(rewards.clone(), old, ref, mask))
    torch.testing.assert_close(out[K.TOKEN_REWARDS], rewards - 0.1 * F.kl_penalty(old, ref, "low_var_kl") * mask)
    chain = Chain(KLInReward(FixedKLController(0.1)), GRPO())
    assert {K.OLD_LOG_PROBS, K.REF_LOG_PROBS} <= set(chain.in_keys)  # so the Trainer computes both


def test_controller_state_round_trips_through_the_chain():
    chain = Chain(KLInReward(AdaptiveKLController(0.1, 0.01, 20)), GRPO())
    chain.modules[0].controller.update(1.0, n_steps=7)
    state = chain.state_dict()
    fresh = Chain(KLInReward(AdaptiveKLController(0.1, 0.01, 20)), GRPO())
    fresh.load_state_dict(state)
    assert fresh.modules[0].controller.value == chain.modules[0].controller.value == pytest.approx(0.1 * 1.07)
    fixed = FixedKLController(0.3)
    fixed.load_state_dict(FixedKLController(0.7).state_dict())
    assert fixed.value == 0.7


def test_trainer_resume_restores_the_adaptive_coefficient(model, tokenizer, addition_rows, tmp_path):
    """Stopping at step 2 and resuming continues with the same KL coefficient as an uninterrupted run."""

    def estimator():
        return Chain(KLInReward(AdaptiveKLController(init_coef=0.05, target_kl=1e-4, horizon=20)), GRPO())

    full, data = make_trainer(model, tokenizer, addition_rows, tmp_path / "full", max_steps=3, save_every=2,
                              estimator=estimator())
    assert full.reference is not None and full.needs_old_log_probs  # the chain reads both
    history = full.fit(data)
    values = full.estimator.modules[0].controller.value
    assert values != 0.05  # it moved: the test would notice a coefficient that is not restored
    # the step metrics carry the chain's stats: the beta each step used, and the measured KL
    assert history[0]["actor/reward_kl_penalty_coeff"] == 0.05
    assert history[1]["actor/reward_kl_penalty_coeff"] != 0.05 and "actor/reward_kl_penalty" in history[1]

    resumed, data = make_trainer(model, tokenizer, addition_rows, tmp_path / "resumed", max_steps=3,
                                 estimator=estimator(), resume=tmp_path / "full" / "global_step_2")
    resumed.fit(data)
    assert resumed.estimator.modules[0].controller.value == values
