"""Pure tensor functions for advantages and losses: the functional core.

Shapes: ``B`` batch, ``R`` response length. Masks are 0/1 (int, bool or float)
and are 0 on padding and on tool/observation tokens. Formulas follow verl
``verl/trainer/ppo/core_algos.py`` and ``verl/utils/torch_functional.py``
(see ``reference/verl.md`` section 2); deviations are marked "rlflow:".
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import torch
from torch import Tensor


_BATCH_SUM: contextvars.ContextVar = contextvars.ContextVar("rlflow_batch_sum", default=None)
_DP_SIZE: contextvars.ContextVar = contextvars.ContextVar("rlflow_dp_size", default=1)


@contextlib.contextmanager
def batch_statistics(sum_fn: Callable[[Tensor], Tensor] | None):
    """Inside, whole-batch statistics (whitening, GPG's ``alpha``, the adaptive KL's mean) sum their
    parts with ``sum_fn``: the Trainer passes a sum over the processes that each hold a share of the
    batch, so a statistic of the whole batch is the same on 1 or N processes. ``None``: this process's
    batch is the whole batch (the default, and what every function here does outside the block).
    """
    token = _BATCH_SUM.set(sum_fn)
    try:
        yield
    finally:
        _BATCH_SUM.reset(token)


def batch_sum(x: Tensor) -> Tensor:
    """``x`` summed over the processes of :func:`batch_statistics` (``x`` itself outside it)."""
    fn = _BATCH_SUM.get()
    return x if fn is None else fn(x).to(x.dtype)


@contextlib.contextmanager
def data_parallel(world_size: int):
    """Inside, losses are computed on one of ``world_size`` processes whose gradients are averaged:
    ``token-sum`` multiplies by it (verl's ``dp_size``), so the loss is the sum over all processes' tokens.
    The modes with a denominator need nothing here: their ``num_tokens``/``num_seqs`` already carry it.
    """
    token = _DP_SIZE.set(world_size)
    try:
        yield
    finally:
        _DP_SIZE.reset(token)


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """``sum(x * mask)`` over ``dim`` (all elements if None). x, mask: [B, R]."""
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """verl: ``sum(x * mask) / (sum(mask) + 1e-8)``; an empty mask gives 0, never NaN."""
    denom = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / (denom + 1e-8)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the masked entries (scalar); unbiased multiplies by ``n / (n - 1)``.

    rlflow: verl raises when ``n = sum(mask)`` is 0 or 1; here the variance is 0
    (no Python branch, so no device sync).
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        var = var * n / (n - 1).clamp(min=1)  # n <= 1: var is already 0
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """verl: ``(x - mean) * rsqrt(var + eps)`` with whole-batch statistics over masked entries
    (unbiased variance; summed over processes inside :func:`batch_statistics`).

    The result is not re-masked (as in verl). ``shift_mean=False`` adds the mean back.
    rlflow: with fewer than 2 valid entries the variance is undefined (verl raises);
    the values are then only centred, ``x - mean``, not scaled (a single valid entry becomes 0).
    """
    n = batch_sum(mask.sum().to(x.dtype))
    mean = batch_sum(masked_sum(x, mask)) / (n + 1e-8)
    var = batch_sum(masked_sum((x - mean) ** 2, mask)) / (n + 1e-8) * n / (n - 1).clamp(min=1)
    scale = torch.where(n >= 2, torch.rsqrt(var + eps), torch.ones_like(var))
    whitened = (x - mean) * scale
    return whitened if shift_mean else whitened + mean


def group_stats(scores: Tensor, group: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group mean, unbiased std and size, broadcast back to each sample.

    scores: [B] float; group: [B] int64 of arbitrary ids (any values, any order).
    Returns (mean, std, count), each [B]; count is int64. A singleton group has
    std 0 here (``torch.std`` would give NaN); callers decide what a singleton means.
    """
    ids, inverse = torch.unique(group, return_inverse=True)
    n_groups = ids.numel()
    count = torch.bincount(inverse, minlength=n_groups)
    total = scores.new_zeros(n_groups).index_add(0, inverse, scores)
    mean = (total / count)[inverse]
    # Two-pass variance: exact like torch.std, unlike sum(x^2) - sum(x)^2/n.
    sq = scores.new_zeros(n_groups).index_add(0, inverse, (scores - mean) ** 2)
    std = (sq / (count - 1).clamp(min=1)).sqrt()[inverse]
    return mean, std, count[inverse]


def grpo_advantages(
    token_rewards: Tensor, response_mask: Tensor, group: Tensor, norm_by_std: bool = True, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath; verl ``compute_grpo_outcome_advantage``).

    ``s = token_rewards.sum(-1)``; ``a = (s - mean_g) / (std_g + eps)`` (or ``s - mean_g`` when
    ``norm_by_std=False``, Dr.GRPO); a singleton group uses mean 0, std 1 (verl), so ``a = s/(1+eps)``.
    token_rewards, response_mask: [B, R]; group: [B]. Returns (advantages, returns), both
    ``a[:, None] * response_mask``, [B, R].
    """
    s = token_rewards.sum(-1)
    mean, std, count = group_stats(s, group)
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    a = (s - mean) / (std + eps) if norm_by_std else s - mean
    adv = a[:, None] * response_mask
    return adv, adv.clone()


def gae_advantages(
    token_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016; verl ``compute_gae_advantage_return``).

    Backwards over t: ``delta = r_t + gamma * V_next - V_t``; ``A_t = delta + gamma * lam * A_next``.
    Masked (tool/observation) steps are skipped: ``V_next`` and ``A_next`` carry over them
    unchanged, so valid steps never see values at masked positions.
    ``returns = A + V`` (before whitening, not masked, as verl); then
    ``A = masked_whiten(A, mask) * mask`` (rlflow: re-masked; verl leaves padding unmasked).
    All tensors [B, R]. Returns (advantages, returns).
    """
    mask = response_mask.to(values.dtype)
    next_value = values.new_zeros(values.shape[0])
    last_gae = values.new_zeros(values.shape[0])
    advantages = torch.empty_like(values)
    for t in reversed(range(values.shape[-1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        last_gae = gae * mask[:, t] + (1 - mask[:, t]) * last_gae
        advantages[:, t] = last_gae
    returns = advantages + values
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages * mask, returns


def _kl_low_var(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    kl = (ref_log_probs - log_probs).clamp(-20, 20)  # clamps keep exp() finite
    return (torch.exp(kl) - kl - 1).clamp(-10, 10)


_KL = {
    "kl": lambda lp, ref: lp - ref,
    "k1": lambda lp, ref: lp - ref,
    "abs": lambda lp, ref: (lp - ref).abs(),
    "mse": lambda lp, ref: 0.5 * (lp - ref) ** 2,
    "k2": lambda lp, ref: 0.5 * (lp - ref) ** 2,
    "low_var_kl": _kl_low_var,
    "k3": _kl_low_var,
}


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, kind: str = "low_var_kl") -> Tensor:
    """Per-token KL estimate of pi against pi_ref (Schulman, "Approximating KL divergence", 2020).

    ``kl``/``k1``: ``logp - ref``; ``abs``: ``|logp - ref|``; ``mse``/``k2``: ``0.5 (logp - ref)^2``;
    ``low_var_kl``/``k3``: ``d = clamp(ref - logp, -20, 20)``, ``clamp(exp(d) - d - 1, -10, 10)``.
    A ``+`` suffix (``k3+``) keeps the forward value but uses the k2 gradient:
    ``k2 - k2.detach() + fwd.detach()`` (verl 0.9.1 accepts ``k1+`` and ``k3+`` the same way).
    log_probs, ref_log_probs: [B, R]; returns [B, R].
    """
    base = kind[:-1] if kind.endswith("+") else kind
    if base not in _KL:
        raise ValueError(f"unknown KL kind {kind!r}; valid kinds: {sorted(_KL)} (optionally with a '+' suffix)")
    fwd = _KL[base](log_probs, ref_log_probs)
    if base == kind:
        return fwd
    k2 = _KL["k2"](log_probs, ref_log_probs)
    return k2 - k2.detach() + fwd.detach()


AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum")


def _nonzero(count):
    # A zero count means the numerator is an empty sum too: return 0, not 0/0 = NaN.
    # Only an exact zero is replaced (a count divided by dp_size may be below 1); no device sync.
    if isinstance(count, Tensor):
        return torch.where(count == 0, torch.ones_like(count), count)
    return count or 1


def _seq_mean(seq: Tensor, mask: Tensor, num_seqs) -> Tensor:
    has_tokens = (mask.sum(-1) > 0).to(seq.dtype)
    return masked_sum(seq, has_tokens) / _nonzero(num_seqs if num_seqs is not None else has_tokens.sum())


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    norm_length: float | None = None,
) -> Tensor:
    """Reduce a per-token loss [B, R] to a scalar (verl 0.9.1 ``core_algos.agg_loss``).

    - ``token-mean``: ``sum(L*M) / num_tokens`` (default ``sum(M)``), DAPO's token-level loss.
    - ``seq-mean-token-sum``: ``l_i = sum_t L*M``; ``sum_{i: |M_i|>0} l_i / num_seqs``
      (default: number of sequences with a valid token).
    - ``seq-mean-token-mean``: ``l_i = sum_t L*M / (sum_t M + 1e-8)``; then as above (GRPO paper).
    - ``seq-mean-token-sum-norm`` (Dr.GRPO): ``seq-mean-token-sum / norm_length`` (default ``R``), i.e.
      ``sum_i l_i / (num_seqs * norm_length)``, as verl 0.9.1. ``norm_length`` is verl's
      ``actor.loss_scale_factor`` (``PPOLoss(loss_scale_factor=...)``); the other modes ignore it, as verl does.
    - ``token-sum``: ``sum(L*M) * dp_size`` (verl 0.9.1): the sum over every valid token of every process
      (``dp_size`` from :func:`data_parallel`, 1 outside it); no count divides it.

    Pass ``num_tokens``/``num_seqs`` of the whole mini-batch so that the micro-batch losses sum
    exactly to the mini-batch loss (and so do their gradients). Under data parallelism with
    averaged gradients, pass the global count divided by the world size (verl's
    ``batch_num_tokens / dp_size`` and ``global_batch_size / dp_size``).
    rlflow: a zero denominator is replaced by 1, so an empty mask gives 0, not NaN (verl returns 0 too).
    """
    if mode == "token-mean":
        return masked_sum(loss_mat, mask) / _nonzero(num_tokens if num_tokens is not None else mask.sum())
    if mode == "seq-mean-token-sum":
        return _seq_mean(masked_sum(loss_mat, mask, -1), mask, num_seqs)
    if mode == "seq-mean-token-mean":
        return _seq_mean(masked_mean(loss_mat, mask, -1), mask, num_seqs)
    if mode == "seq-mean-token-sum-norm":
        return _seq_mean(masked_sum(loss_mat, mask, -1), mask, num_seqs) / (norm_length or mask.shape[-1])
    if mode == "token-sum":
        return masked_sum(loss_mat, mask) * _DP_SIZE.get()
    raise ValueError(f"unknown loss aggregation mode {mode!r}; valid modes: {list(AGG_MODES)}")


def ppo_clip_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = 3.0,
    agg: str = "token-mean",
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    weights: Tensor | None = None,
    norm_length: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Dual-clip PPO policy loss (Schulman et al. 2017; Ye et al. 2020; verl "vanilla").

    ``d = clamp(logp - old, -20, 20)``, ``ratio = exp(d)``;
    ``L1 = -A ratio``, ``L2 = -A clamp(ratio, 1 - clip_low, 1 + clip_high)``, ``c1 = max(L1, L2)``;
    for ``A < 0``: ``min(c1, -A clip_c)`` (dual clip; ``clip_c=None`` disables it).
    Stats (detached scalars, masked means over this call's tokens): ``pg_clipfrac`` = frac(L2 > L1),
    ``pg_clipfrac_lower`` = frac(c1 > -A clip_c and A < 0), ``ppo_kl`` = mean(-d).
    ``weights`` ([B, R], optional, e.g. truncated IS weights) multiply the per-token loss after
    clipping, before aggregation (verl ``rollout_is_weights``); the stats ignore them.
    ``norm_length`` is ``agg_loss``'s (``seq-mean-token-sum-norm`` only).
    All inputs [B, R]; returns (scalar loss, stats).
    """
    neg_kl = (log_probs - old_log_probs).clamp(-20, 20)  # keeps exp() finite on stale samples
    ratio = torch.exp(neg_kl)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    clipped = torch.maximum(loss1, loss2)
    stats = {
        "pg_clipfrac": masked_mean((loss2 > loss1).to(ratio.dtype), mask).detach(),
        "ppo_kl": masked_mean(-neg_kl, mask).detach(),
    }
    if clip_c is None:
        per_token = clipped
        stats["pg_clipfrac_lower"] = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
    else:
        if clip_c <= 1:
            raise ValueError(f"clip_c must be > 1 for the dual clip, got {clip_c}")
        loss3 = -advantages * clip_c
        lower = (clipped > loss3) & (advantages < 0)
        per_token = torch.where(advantages < 0, torch.minimum(clipped, loss3), clipped)
        stats["pg_clipfrac_lower"] = masked_mean(lower.to(ratio.dtype), mask).detach()
    if weights is not None:
        per_token = per_token * weights
    return agg_loss(per_token, mask, agg, num_tokens, num_seqs, norm_length), stats


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_range: float | None = 0.5,
    agg: str = "token-mean",
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    norm_length: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss (verl ``compute_value_loss``).

    ``v_clip = clamp(v, V_old - c, V_old + c)``; ``0.5 * agg(max((v - R)^2, (v_clip - R)^2))``.
    ``clip_range=None`` disables clipping. ``norm_length`` is ``agg_loss``'s (``seq-mean-token-sum-norm`` only;
    verl's ``critic.loss_scale_factor``). Stats: ``vf_clipfrac`` = masked mean of
    ``(v_clip - R)^2 > (v - R)^2`` (detached). All inputs [B, R]; returns (scalar loss, stats).
    """
    if clip_range is None:
        clipped_values = values
    else:
        clipped_values = torch.clamp(values, old_values - clip_range, old_values + clip_range)
    loss1 = (values - returns) ** 2
    loss2 = (clipped_values - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(loss1, loss2), mask, agg, num_tokens, num_seqs, norm_length)
    return loss, {"vf_clipfrac": masked_mean((loss2 > loss1).to(values.dtype), mask).detach()}
