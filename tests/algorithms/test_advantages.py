"""Critic-free estimators (RLOO, REINFORCE++, ReMax, OPO, GPG, pass@k, Dr.GRPO): numbers worked by hand,
straightforward per-sample loops on random masked batches, edge cases, the module shells and GreedyBaseline."""

import math

import pytest
import torch
from tensordict import TensorDict

from rlflow.algorithms import (
    GPG,
    GRPO,
    OPO,
    RLOO,
    DrGRPO,
    GreedyBaseline,
    GRPOPassK,
    ReinforcePlusPlus,
    ReinforcePlusPlusBaseline,
    ReMax,
)
from rlflow.algorithms import advantages as A
from rlflow.data import keys as K
from rlflow.data.prompts import collate, load_rows
from rlflow.module import Chain, MissingKeyError
from rlflow.rewards import FunctionReward
from rlflow.rollout.hf import HFRollout
from tests.trainer.helpers import make_trainer, starts_with_digit


def random_batch(seed, b=24, r=7, dtype=torch.float64):
    """Random rewards, masks with holes (tool tokens) and right padding, one empty row, and groups
    that include a singleton (id 999) and an all-equal group (id 42)."""
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(b, r, generator=gen, dtype=dtype)
    mask = (torch.rand(b, r, generator=gen) < 0.75).to(dtype)
    mask *= (torch.arange(r)[None, :] < torch.randint(1, r + 1, (b,), generator=gen)[:, None]).to(dtype)
    mask[0] = 0
    group = torch.tensor([3, 3, 3, 8, 8, 42, 42, 42, 0, 0, 0, 0, 11, 11, 5, 5, 5, 5, 6, 6, 7, 7, 7, 999])[:b]
    rewards[group == 42] = 0.0
    rewards[group == 42, 0] = 0.5  # every sample of group 42 scores 0.5
    return rewards, mask, group


def members(group, i):
    return [j for j in range(len(group)) if group[j] == group[i]]


def whiten_loop(values, mask):
    """Whole-batch whitening over the valid entries, unbiased variance, in plain Python."""
    xs = [values[i, t].item() for i in range(values.shape[0]) for t in range(values.shape[1]) if mask[i, t] > 0]
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
    return (values - mean) / math.sqrt(var + 1e-8) * mask


# ---------------------------------------------------------------- RLOO


def test_rloo_by_hand():
    # scores s = [1, 0, 0.5, 2]; groups 5, 5, 5 and a singleton 9
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 2.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    adv, ret = A.rloo_advantages(rewards, mask, torch.tensor([5, 5, 5, 9]))
    # 1 - mean(0, 0.5) = 0.75; 0 - mean(1, 0.5) = -0.75; 0.5 - mean(1, 0) = 0; singleton: 0 (no baseline)
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.75, 0.0, 0.0])[:, None] * mask)
    torch.testing.assert_close(ret, adv)


def test_rloo_matches_loop():
    rewards, mask, group = random_batch(1)
    adv, _ = A.rloo_advantages(rewards, mask, group)
    s = rewards.sum(-1)
    for i in range(len(s)):
        others = [s[j].item() for j in members(group, i) if j != i]
        a = s[i].item() - sum(others) / len(others) if others else 0.0
        torch.testing.assert_close(adv[i], a * mask[i])
    assert adv[group == 42].abs().max() == 0 and adv[group == 999].abs().max() == 0


def test_rloo_singleton_differs_from_verl_loop_only():
    # verl's loop rloo: n > 1 -> s*n/(n-1) - mean*n/(n-1); n == 1 -> s (raw). rlflow: 0 for n == 1.
    rewards, mask, group = random_batch(2)
    adv, _ = A.rloo_advantages(rewards, mask, group)
    s = rewards.sum(-1)
    for i in range(len(s)):
        n = len(members(group, i))
        mean = s[members(group, i)].mean()
        verl = s[i] * n / (n - 1) - mean * n / (n - 1) if n > 1 else s[i]
        expected = verl if n > 1 else torch.zeros((), dtype=s.dtype)
        torch.testing.assert_close(adv[i], expected * mask[i])


# ---------------------------------------------------------------- REINFORCE++


def test_reinforce_pp_by_hand():
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv, ret = A.reinforce_pp_advantages(rewards, mask, gamma=0.5)
    # row 0: G1 = 1, G0 = 0.5 * 1; row 1: G2 = 2, G1 = 1, G0 = 0.5
    torch.testing.assert_close(ret, torch.tensor([[0.5, 1.0, 0.0], [0.5, 1.0, 2.0]]))
    # valid returns 0.5, 1, 0.5, 1, 2: mean 1, unbiased var (0.25 + 0 + 0.25 + 0 + 1) / 4 = 0.375
    z = 1 / math.sqrt(0.375 + 1e-8)
    torch.testing.assert_close(adv, torch.tensor([[-0.5 * z, 0.0, 0.0], [-0.5 * z, 0.0, z]]))


def test_reinforce_pp_tool_token_does_not_cut_the_return():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])  # a tool/observation token at t1
    _, ret = A.reinforce_pp_advantages(rewards, mask, gamma=0.5)
    # t3: 1; t2: 0.5; t1 skipped (returns 0 there); t0: 0.5 * 0.5 = 0.25.
    # verl resets the running return at t1, so t0 would get 0.
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.0, 0.5, 1.0]]))


def verl_reinforce_pp_loop(rewards, mask, gamma):
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    returns = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return returns


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_loop(gamma):
    rewards, mask, _ = random_batch(3)
    adv, ret = A.reinforce_pp_advantages(rewards, mask, gamma=gamma)
    expected = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):  # discounted sum over this row's valid steps only
        g = 0.0
        for t in reversed([t for t in range(rewards.shape[1]) if mask[i, t] > 0]):
            g = rewards[i, t].item() + gamma * g
            expected[i, t] = g
    torch.testing.assert_close(ret, expected)
    torch.testing.assert_close(adv, whiten_loop(expected, mask))


def test_reinforce_pp_equals_verl_on_right_padded_masks():
    gen = torch.Generator().manual_seed(4)
    rewards = torch.randn(9, 6, generator=gen, dtype=torch.float64)
    lengths = torch.randint(0, 7, (9,), generator=gen)
    mask = (torch.arange(6)[None, :] < lengths[:, None]).double()
    rewards = rewards * mask  # rewards sit on valid tokens (as rlflow's Reward places them)
    _, ret = A.reinforce_pp_advantages(rewards, mask, gamma=0.95)
    torch.testing.assert_close(ret, verl_reinforce_pp_loop(rewards, mask, 0.95) * mask)


# ---------------------------------------------------------------- REINFORCE++-baseline


def test_reinforce_pp_baseline_by_hand():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    adv, ret = A.reinforce_pp_baseline_advantages(rewards, mask, torch.tensor([1, 1, 2]))
    # group 1: mean 0.5 -> 0.5, -0.5; group 2 is a singleton: mean 0 -> 3. Tiled: [[.5,.5],[-.5,0],[3,3]]
    # valid entries .5 .5 -.5 3 3: mean 1.3, unbiased var (.64 + .64 + 3.24 + 2.89 + 2.89) / 4 = 2.575
    z = 1 / math.sqrt(2.575 + 1e-8)
    expected = torch.tensor([[-0.8, -0.8], [-1.8, 0.0], [1.7, 1.7]]) * z
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, adv)


def test_reinforce_pp_baseline_matches_loop():
    rewards, mask, group = random_batch(5)
    adv, _ = A.reinforce_pp_baseline_advantages(rewards, mask, group)
    s = rewards.sum(-1)
    a = torch.zeros_like(s)
    for i in range(len(s)):  # verl's id2mean loop: singleton mean 0
        idx = members(group, i)
        a[i] = s[i] - (s[idx].mean() if len(idx) > 1 else 0.0)
    torch.testing.assert_close(adv, whiten_loop(a[:, None] * mask, mask))


# ---------------------------------------------------------------- ReMax


def test_remax_by_hand():
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv, ret = A.remax_advantages(rewards, mask, torch.tensor([0.25, 1.0]))
    # reward-to-go: row 0 [1, 1, 0]; row 1 [2.5, 2, 2]; minus the greedy score on valid tokens
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 0.0], [2.5, 2.0, 2.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.75, 0.75, 0.0], [1.5, 1.0, 1.0]]))


def test_remax_matches_loop():
    rewards, mask, _ = random_batch(6)
    baseline = torch.randn(rewards.shape[0], generator=torch.Generator().manual_seed(0), dtype=rewards.dtype)
    adv, ret = A.remax_advantages(rewards, mask, baseline)
    for i in range(rewards.shape[0]):
        for t in range(rewards.shape[1]):
            to_go = sum(rewards[i, u].item() * mask[i, u].item() for u in range(t, rewards.shape[1]))
            torch.testing.assert_close(ret[i, t].item(), to_go)
            torch.testing.assert_close(adv[i, t].item(), to_go - baseline[i].item() * mask[i, t].item())


# ---------------------------------------------------------------- OPO


def test_opo_by_hand():
    # scores [1, 0, 1, 5], lengths [2, 4, 1, 3], groups 7, 7, 7 and a singleton 8
    rewards = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0] * 4, [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 5.0, 0.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]])
    adv, ret = A.opo_advantages(rewards, mask, torch.tensor([7, 7, 7, 8]))
    # b_7 = (2*1 + 4*0 + 1*1) / (2 + 4 + 1) = 3/7; singleton: b = 0
    a = torch.tensor([4 / 7, -3 / 7, 4 / 7, 5.0])
    torch.testing.assert_close(adv, a[:, None] * mask)
    torch.testing.assert_close(ret, adv)


def test_opo_matches_loop():
    rewards, mask, group = random_batch(7)
    adv, _ = A.opo_advantages(rewards, mask, group)
    s, length = rewards.sum(-1), mask.sum(-1)
    for i in range(len(s)):
        idx = members(group, i)
        b = sum(length[j] * s[j] for j in idx) / sum(length[j] for j in idx) if len(idx) > 1 else 0.0
        torch.testing.assert_close(adv[i], (s[i] - b) * mask[i])


def test_opo_group_of_empty_masks_is_zero_not_nan():
    adv, _ = A.opo_advantages(torch.ones(2, 3), torch.zeros(2, 3), torch.tensor([1, 1]))
    assert torch.equal(adv, torch.zeros(2, 3))


# ---------------------------------------------------------------- GPG


def test_gpg_by_hand():
    # scores [1, 0, 0, 0, 2]; groups 1, 1, 2, 2 and a singleton 3; B = 5, two non-zero scores
    rewards = torch.tensor([[1.0], [0.0], [0.0], [0.0], [2.0]])
    mask = torch.ones(5, 1)
    adv, ret = A.gpg_advantages(rewards, mask, torch.tensor([1, 1, 2, 2, 3]))
    # alpha = 5 / 2 = 2.5; group 1: mean .5 -> +-0.5 * 2.5; group 2 all equal -> 0; singleton: 2 * 2.5
    torch.testing.assert_close(adv, torch.tensor([[1.25], [-1.25], [0.0], [0.0], [5.0]]))
    torch.testing.assert_close(ret, adv)
    adv, _ = A.gpg_advantages(rewards, mask, torch.tensor([1, 1, 2, 2, 3]), f_norm=2.0)
    torch.testing.assert_close(adv, torch.tensor([[0.625], [-0.625], [0.0], [0.0], [2.5]]))


def test_gpg_matches_verl_loop():
    rewards, mask, group = random_batch(8)
    rewards[3:6] = 0  # some zero scores, so alpha != 1
    adv, _ = A.gpg_advantages(rewards, mask, group, f_norm=1.5)
    s = rewards.sum(-1)
    alpha = len(s) / max(int((s != 0).sum()), 1)
    for i in range(len(s)):
        idx = members(group, i)
        mean = s[idx].mean() if len(idx) > 1 else 0.0
        torch.testing.assert_close(adv[i], alpha * (s[i] - mean) / 1.5 * mask[i])


def test_gpg_all_zero_scores_is_zero():
    adv, _ = A.gpg_advantages(torch.zeros(4, 2), torch.ones(4, 2), torch.tensor([0, 0, 1, 1]))
    assert torch.equal(adv, torch.zeros(4, 2))  # alpha = 4 / max(0, 1); every s - mean = 0


# ---------------------------------------------------------------- GRPO pass@k


def test_grpo_passk_by_hand():
    # group 1: scores 1, 3, 2 -> best is row 1, gain 3 - 2 = 1, unbiased std 1
    # group 2: scores 4, 0 -> best row 3, gain 4, std sqrt(8); group 3: a tie at the top (2, 2) -> all 0
    s = torch.tensor([1.0, 3.0, 2.0, 0.0, 4.0, 2.0, 2.0])
    group = torch.tensor([1, 1, 1, 2, 2, 3, 3])
    mask = torch.ones(7, 2)
    mask[1, 1] = 0
    rewards = torch.zeros(7, 2)
    rewards[:, 0] = s
    adv, ret = A.grpo_passk_advantages(rewards, mask, group)
    a = torch.tensor([0.0, 1 / (1 + 1e-6), 0.0, 0.0, 4 / (math.sqrt(8) + 1e-6), 0.0, 0.0])
    torch.testing.assert_close(adv, a[:, None] * mask)
    torch.testing.assert_close(ret, adv)
    adv, _ = A.grpo_passk_advantages(rewards, mask, group, norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.0, 1.0, 0.0, 0.0, 4.0, 0.0, 0.0])[:, None] * mask)


def test_grpo_passk_matches_verl_loop():
    gen = torch.Generator().manual_seed(9)
    rewards = torch.randn(20, 5, generator=gen, dtype=torch.float64)  # continuous scores: no ties
    mask = (torch.rand(20, 5, generator=gen) < 0.8).double()
    group = torch.tensor([4, 4, 4, 4, 1, 1, 1, 9, 9, 0, 0, 0, 0, 0, 2, 2, 2, 3, 3, 3])
    adv, _ = A.grpo_passk_advantages(rewards, mask, group)
    s = rewards.sum(-1)
    expected = torch.zeros_like(s)
    for g in group.unique().tolist():  # verl: topk(2) per group, credit the argmax only
        idx = [i for i in range(len(s)) if group[i] == g]
        top, pos = torch.topk(s[idx], 2)
        expected[idx[pos[0]]] = (top[0] - top[1]) / (s[idx].std() + 1e-6)
    torch.testing.assert_close(adv, expected[:, None] * mask)


def test_grpo_passk_rejects_singleton_groups():
    with pytest.raises(ValueError, match=r"at least 2 samples per group; group id\(s\) \[7\]"):
        A.grpo_passk_advantages(torch.ones(3, 2), torch.ones(3, 2), torch.tensor([1, 1, 7]))


# ---------------------------------------------------------------- edge cases, every estimator

FUNCTIONS = {
    "rloo": lambda r, m, g: A.rloo_advantages(r, m, g),
    "reinforce_pp": lambda r, m, g: A.reinforce_pp_advantages(r, m, 0.9),
    "reinforce_pp_baseline": lambda r, m, g: A.reinforce_pp_baseline_advantages(r, m, g),
    "remax": lambda r, m, g: A.remax_advantages(r, m, r.sum(-1) * 0.5),
    "opo": lambda r, m, g: A.opo_advantages(r, m, g),
    "gpg": lambda r, m, g: A.gpg_advantages(r, m, g),
    "grpo_passk": lambda r, m, g: A.grpo_passk_advantages(r, m, g),
}


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_empty_masks_give_zeros_not_nan(name):
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [2.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    group = torch.tensor([0, 0, 1, 1])
    for mask in (torch.zeros(4, 3), torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])):
        adv, ret = FUNCTIONS[name](rewards, mask, group)
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
        assert torch.equal(adv * (1 - mask), torch.zeros_like(adv))  # nothing on masked tokens
        if mask.sum() == 0:
            assert torch.equal(adv, torch.zeros_like(adv))


@pytest.mark.parametrize("name", ["rloo", "opo", "gpg", "grpo_passk"])
def test_all_equal_group_gets_zero(name):
    rewards = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 3.0], [1.0, 0.0]])
    adv, _ = FUNCTIONS[name](rewards, torch.ones(5, 2), torch.tensor([4, 4, 4, 6, 6]))
    assert torch.equal(adv[:3], torch.zeros(3, 2))
    assert adv[3:].abs().sum() > 0  # the other group does get a signal


def test_all_equal_batch_whitens_to_zero():
    for name in ("reinforce_pp", "reinforce_pp_baseline"):
        adv, _ = FUNCTIONS[name](torch.ones(4, 1), torch.ones(4, 1), torch.tensor([0, 0, 1, 1]))
        assert torch.equal(adv, torch.zeros(4, 1)), name


# ---------------------------------------------------------------- module shells


def make_batch(rewards, mask, group, **extra):
    return TensorDict({K.TOKEN_REWARDS: rewards, K.RESPONSE_MASK: mask, K.GROUP: group, **extra},
                      batch_size=[rewards.shape[0]])


@pytest.mark.parametrize(
    "estimator, fn",
    [
        (RLOO(), lambda r, m, g, b: A.rloo_advantages(r, m, g)),
        (ReinforcePlusPlus(gamma=0.9), lambda r, m, g, b: A.reinforce_pp_advantages(r, m, 0.9)),
        (ReinforcePlusPlusBaseline(), lambda r, m, g, b: A.reinforce_pp_baseline_advantages(r, m, g)),
        (ReMax(), lambda r, m, g, b: A.remax_advantages(r, m, b)),
        (OPO(), lambda r, m, g, b: A.opo_advantages(r, m, g)),
        (GPG(f_norm=2.0), lambda r, m, g, b: A.gpg_advantages(r, m, g, 2.0)),
        (GRPOPassK(norm_by_std=False), lambda r, m, g, b: A.grpo_passk_advantages(r, m, g, norm_by_std=False)),
    ],
    ids=["rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "opo", "gpg", "grpo_passk"],
)
def test_shells_write_the_functional_result(estimator, fn):
    rewards, mask, group = random_batch(10)
    group = group.clone()
    group[-1] = 7  # pass@k needs groups of >= 2
    baseline = torch.linspace(-1, 1, rewards.shape[0], dtype=rewards.dtype)
    out = estimator(make_batch(rewards, mask, group, **{K.REWARD_BASELINE: baseline}))
    adv, ret = fn(rewards, mask, group, baseline)
    torch.testing.assert_close(out[K.ADVANTAGES], adv)
    torch.testing.assert_close(out[K.RETURNS], ret)
    assert not estimator.needs_critic


def test_shells_declare_their_keys():
    assert ReinforcePlusPlus.in_keys == (K.TOKEN_REWARDS, K.RESPONSE_MASK)  # no grouping
    assert K.REWARD_BASELINE in ReMax.in_keys and K.GROUP not in ReMax.in_keys
    for cls in (RLOO, ReinforcePlusPlusBaseline, OPO, GPG, GRPOPassK, DrGRPO):
        assert cls.in_keys == (K.TOKEN_REWARDS, K.RESPONSE_MASK, K.GROUP)
    with pytest.raises(KeyError, match=K.REWARD_BASELINE):
        ReMax()(make_batch(torch.zeros(2, 2), torch.ones(2, 2), torch.tensor([0, 0])))


def test_drgrpo_is_grpo_without_std_by_hand():
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.5, 0.0], [3.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]])
    out = DrGRPO()(make_batch(rewards, mask, torch.tensor([2, 2, 2, 5])))
    # group 2 mean 0.5 -> 0.5, -0.5, 0; singleton: mean 0 -> 3 (GRPO's verl convention)
    torch.testing.assert_close(out[K.ADVANTAGES], torch.tensor([[0.5, 0.5], [-0.5, 0.0], [0.0, 0.0], [3.0, 3.0]]))
    assert isinstance(DrGRPO(), GRPO) and DrGRPO().norm_by_std is False


def test_grpo_passk_k_checks_group_size():
    with pytest.raises(ValueError, match="k >= 2"):
        GRPOPassK(k=1)
    batch = make_batch(torch.ones(4, 1), torch.ones(4, 1), torch.tensor([0, 0, 0, 1]))
    with pytest.raises(ValueError, match=r"exactly k samples .* sizes \[1, 3\]"):
        GRPOPassK(k=3)(batch)
    batch = make_batch(torch.arange(6.0)[:, None], torch.ones(6, 1), torch.tensor([0, 0, 0, 1, 1, 1]))
    out = GRPOPassK(k=3, norm_by_std=False)(batch)  # best of (0, 1, 2) and of (3, 4, 5): gain 1 each
    torch.testing.assert_close(out[K.ADVANTAGES], torch.tensor([[0.0], [0.0], [1.0], [0.0], [0.0], [1.0]]))


# ---------------------------------------------------------------- GreedyBaseline


def test_greedy_baseline_scores_one_greedy_sample_per_group_and_broadcasts(model, tokenizer):
    rows, _ = load_rows([{"prompt": p, "ground_truth": str(i)} for i, p in enumerate(("12+34=", "5+6=", "99+9="))])
    rollout = HFRollout(n=3, max_new_tokens=4)
    rollout.bind(model, tokenizer)
    torch.manual_seed(0)
    batch = rollout(collate(rows, tokenizer))
    greedy = rollout.with_options(n=1, do_sample=False)(collate(rows, tokenizer))
    calls = []

    def score(response, ground_truth):
        calls.append((response, ground_truth))
        return 10.0 * int(ground_truth) + len(response)  # differs per prompt

    module = GreedyBaseline(rollout, FunctionReward(score, max_workers=1))
    assert set(module.in_keys) >= {K.PROMPT_IDS, K.PROMPT_MASK, K.GROUP, K.GROUND_TRUTH}
    assert module.out_keys == (K.REWARD_BASELINE,)
    out = module(batch)
    # one call per prompt, on the greedy response, never on the sampled ones
    assert sorted(calls) == sorted(zip(greedy[K.RESPONSE_TEXT], ["0", "1", "2"]))
    expected = [10.0 * i + len(t) for i, t in enumerate(greedy[K.RESPONSE_TEXT])]
    assert out[K.REWARD_BASELINE].tolist() == [v for v in expected for _ in range(3)]
    assert module.stats["remax/greedy_score/mean"] == pytest.approx(sum(expected) / 3)
    # in a chain before ReMax: advantages are the sample's score minus its prompt's greedy score
    batch[K.TOKEN_REWARDS] = torch.zeros_like(batch[K.ROLLOUT_LOG_PROBS])
    batch[K.TOKEN_REWARDS][:, 0] = torch.arange(9.0)
    batch[K.RESPONSE_MASK] = torch.ones_like(batch[K.RESPONSE_MASK])
    out = Chain(module, ReMax())(batch)
    torch.testing.assert_close(out[K.ADVANTAGES][:, 0], torch.arange(9.0) - out[K.REWARD_BASELINE])


def test_greedy_baseline_groups_in_any_order(model, tokenizer):
    rows, _ = load_rows([{"prompt": p, "ground_truth": p} for p in ("1+1=", "2+2=")])
    rollout = HFRollout(n=2, max_new_tokens=2)
    rollout.bind(model, tokenizer)
    batch = rollout(collate(rows, tokenizer))
    batch = batch[torch.tensor([3, 0, 2, 1])]  # groups 1, 0, 1, 0
    batch[K.GROUP] = torch.tensor([70, 5, 70, 5])
    out = GreedyBaseline(rollout, FunctionReward(lambda response, ground_truth: float(ground_truth[0])))(batch)
    assert out[K.REWARD_BASELINE].tolist() == [2.0, 1.0, 2.0, 1.0]  # each row gets its own prompt's score


def test_remax_chain_in_the_trainer(model, tokenizer, addition_rows, tmp_path):
    with pytest.raises(MissingKeyError, match=K.REWARD_BASELINE):  # ReMax without its GreedyBaseline
        make_trainer(model, tokenizer, addition_rows, tmp_path / "a", estimator=ReMax())
    engine = HFRollout(max_new_tokens=4)  # make_trainer builds its own rollout: bind this one to its model
    baseline = GreedyBaseline(engine, FunctionReward(starts_with_digit))
    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path / "b", max_steps=2,
                                 estimator=Chain(baseline, ReMax()))
    engine.bind(trainer.rollout.model, trainer.policy.tokenizer)
    history = trainer.fit(data)
    assert len(history) == 2 and 0.0 <= history[-1]["remax/greedy_score/mean"] <= 1.0
