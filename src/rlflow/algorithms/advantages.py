"""Critic-free advantage estimators as pure tensor functions (verl ``core_algos.py``, see ``reference/verl.md`` §2).

Shapes: ``B`` batch, ``R`` response length. ``token_rewards`` and ``response_mask`` are ``[B, R]``
(the mask is 0 on padding and on tool/observation tokens); ``group`` is ``[B]`` int64 ids (any
values, any order), samples of one prompt sharing one id. ``s = token_rewards.sum(-1)`` is a
sample's score. Every function returns ``(advantages, returns)``, each ``[B, R]`` and 0 wherever
the mask is 0. Group loops of verl are vectorised with ``functional.group_stats``; deviations
from verl are marked "rlflow:".
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlflow.algorithms.functional import batch_sum, group_stats, masked_whiten


def _group_sum(x: Tensor, group: Tensor) -> Tensor:
    """Per-group sum of ``x`` [B], broadcast back to each sample."""
    ids, inverse = torch.unique(group, return_inverse=True)
    return x.new_zeros(ids.numel()).index_add(0, inverse, x)[inverse]


def _outcome(a: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    adv = a[:, None] * response_mask
    return adv, adv.clone()


def rloo_advantages(token_rewards: Tensor, response_mask: Tensor, group: Tensor) -> tuple[Tensor, Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, arXiv 2402.14740; verl ``rloo``).

    ``a_i = s_i - mean_{j in g, j != i} s_j = (n s_i - sum_g s) / (n - 1)`` for a group of ``n > 1``.
    rlflow: a singleton group gets ``a = 0`` (no other sample, so no baseline and no signal), as
    verl's ``rloo_vectorized``; verl's loop ``rloo`` gives it the raw score ``s_i`` instead.
    """
    s = token_rewards.sum(-1)
    mean, _, n = group_stats(s, group)
    a = torch.where(n > 1, (s - mean) * n / (n - 1).clamp(min=1), torch.zeros_like(s))
    return _outcome(a, response_mask)


def reinforce_pp_advantages(token_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0,
                            sum_fn=None) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262; verl ``reinforce_plus_plus``).

    Discounted return over valid steps, backwards: ``G_t = r_t + gamma * G_next``; then the
    advantage is ``masked_whiten(G, mask) * mask`` with whole-batch statistics (summed over processes by
    ``sum_fn``, ``functional.batch_sum``).
    rlflow: masked (tool/observation) steps are skipped, so the return flows through them unchanged
    and earlier tokens still see the final reward; verl resets the running return at every masked
    step, which is the same for right padding but cuts multi-turn credit at the first tool call.
    Rewards placed on masked positions are ignored (rlflow's Reward never puts them there).
    Returns ``(advantages, G * mask)``.
    """
    mask = response_mask.to(token_rewards.dtype)
    running = token_rewards.new_zeros(token_rewards.shape[0])
    returns = torch.zeros_like(token_rewards)
    for t in reversed(range(token_rewards.shape[-1])):
        running = mask[:, t] * (token_rewards[:, t] + gamma * running) + (1 - mask[:, t]) * running
        returns[:, t] = running
    returns = returns * mask
    return masked_whiten(returns, mask, sum_fn=sum_fn) * mask, returns


def reinforce_pp_baseline_advantages(
    token_rewards: Tensor, response_mask: Tensor, group: Tensor, sum_fn=None
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline (arXiv 2501.03262; verl ``reinforce_plus_plus_baseline``).

    ``a_i = s_i - mean_g`` (a singleton group uses mean 0, as verl), written on every valid token,
    then whitened over all valid tokens of the batch: ``masked_whiten(a * mask, mask) * mask`` (``sum_fn``).
    Advantages = returns.
    """
    s = token_rewards.sum(-1)
    mean, _, n = group_stats(s, group)
    a = s - torch.where(n > 1, mean, torch.zeros_like(mean))
    mask = response_mask.to(token_rewards.dtype)
    adv = masked_whiten(a[:, None] * mask, mask, sum_fn=sum_fn) * mask
    return adv, adv.clone()


def remax_advantages(
    token_rewards: Tensor, response_mask: Tensor, reward_baseline: Tensor
) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023, arXiv 2310.10505; verl ``remax``).

    ``returns_t = sum_{t' >= t} r_{t'} m_{t'}`` (undiscounted reward-to-go), and
    ``A_t = returns_t - b * m_t`` where ``b`` ([B]) is the score of a greedy response to the same
    prompt (``GreedyBaseline``). Not whitened. Returns ``(advantages, returns)``.
    """
    returns = (token_rewards * response_mask).flip(-1).cumsum(-1).flip(-1)
    return returns - reward_baseline[:, None] * response_mask, returns


def opo_advantages(token_rewards: Tensor, response_mask: Tensor, group: Tensor) -> tuple[Tensor, Tensor]:
    """On-policy RL with optimal baseline (Hao et al. 2025, arXiv 2505.23585; verl ``opo``).

    Length-weighted group baseline ``b_g = sum_g(|o_j| s_j) / sum_g |o_j|`` with ``|o| = mask.sum(-1)``;
    ``a_i = s_i - b_g``. A singleton group uses ``b = 0`` (as verl).
    rlflow: a group whose samples all have empty masks uses ``b = 0`` (verl divides 0 by 0; the
    advantages are masked to 0 either way).
    """
    s = token_rewards.sum(-1)
    length = response_mask.sum(-1).to(s.dtype)
    weighted, total = _group_sum(length * s, group), _group_sum(length, group)
    _, _, n = group_stats(s, group)
    b = torch.where((n > 1) & (total > 0), weighted / torch.where(total > 0, total, torch.ones_like(total)), 0.0)
    return _outcome(s - b, response_mask)


def gpg_advantages(
    token_rewards: Tensor, response_mask: Tensor, group: Tensor, f_norm: float = 1.0, sum_fn=None
) -> tuple[Tensor, Tensor]:
    """Group Policy Gradient (Chu et al. 2025, arXiv 2504.02546; verl ``gpg``).

    ``alpha = B / max(#{i : s_i != 0}, 1)``; ``a_i = alpha (s_i - mean_g) / f_norm`` (a singleton
    group uses mean 0, as verl). ``alpha`` counts non-zero *scores* over the whole batch, as verl
    does; GPG pairs it with the plain policy-gradient loss ``-A log pi`` (equal to the PPO loss
    with one update per batch). ``sum_fn`` sums the counts over processes (``functional.batch_sum``).
    """
    s = token_rewards.sum(-1)
    mean, _, n = group_stats(s, group)
    size = batch_sum(torch.tensor(float(s.shape[0]), dtype=s.dtype, device=s.device), sum_fn)
    alpha = size / batch_sum(torch.count_nonzero(s).to(s.dtype), sum_fn).clamp(min=1)
    a = alpha * (s - torch.where(n > 1, mean, torch.zeros_like(mean))) / f_norm
    return _outcome(a, response_mask)


def grpo_passk_advantages(
    token_rewards: Tensor, response_mask: Tensor, group: Tensor, norm_by_std: bool = True, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """GRPO for the pass@k objective with k = group size (Tang et al. 2025, arXiv 2503.19595; verl ``grpo_passk``).

    Only the best sample of each group gets a non-zero advantage, ``r_max - r_second``
    (divided by ``std_g + eps``, unbiased std, when ``norm_by_std``): the leave-one-out gain of
    the group's max. Ties at the top give 0. Raises ``ValueError`` for a group of fewer than 2
    samples (as verl). rlflow: the best sample is the first row holding the max (verl: whichever
    ``torch.topk`` returns; the value is the same, since a tie at the top gives 0 to everyone).
    """
    s = token_rewards.sum(-1)
    ids, inverse = torch.unique(group, return_inverse=True)
    count = torch.bincount(inverse, minlength=ids.numel())
    if (count < 2).any():
        bad = ids[count < 2].tolist()
        raise ValueError(f"GRPO pass@k needs at least 2 samples per group; group id(s) {bad[:10]} have 1")
    rows = torch.arange(s.shape[0], device=s.device)
    g_max = s.new_full((ids.numel(),), float("-inf")).scatter_reduce(0, inverse, s, "amax")
    is_max = s == g_max[inverse]
    first_max = torch.full_like(ids, s.shape[0]).scatter_reduce(0, inverse, torch.where(is_max, rows, s.shape[0]), "amin")
    best = rows == first_max[inverse]
    # Second-best: the max over the group without its (first) best row.
    g_second = s.new_full((ids.numel(),), float("-inf")).scatter_reduce(
        0, inverse, torch.where(best, torch.full_like(s, float("-inf")), s), "amax"
    )
    gain = (g_max - g_second)[inverse]
    if norm_by_std:
        _, std, _ = group_stats(s, group)
        gain = gain / (std + eps)
    return _outcome(torch.where(best, gain, torch.zeros_like(s)), response_mask)
