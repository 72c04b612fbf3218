"""Pure tensor functions for advantages and losses: the functional core.

Shapes: ``B`` batch, ``R`` response length. Masks are 0/1 (int, bool or float)
and are 0 on padding and on tool/observation tokens. Formulas follow verl
``verl/trainer/ppo/core_algos.py`` and ``verl/utils/torch_functional.py``
(see ``reference/verl.md`` section 2); deviations are marked "rlflow:".
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import Tensor


def batch_sum(x: Tensor, sum_fn: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """``x`` summed over the processes that each hold a share of the batch: ``sum_fn(x)`` in ``x``'s dtype
    (``x`` itself for ``None``, when this process's batch is the whole batch). Whole-batch statistics (whitening,
    GPG's ``alpha``, the adaptive KL's mean) take ``sum_fn`` as an argument; modules hold it
    (``rlflow.algorithms.aggregate.WholeBatch``), set once by the Trainer.
    """
    return x if sum_fn is None else sum_fn(x).to(x.dtype)


def _removed(name: str, instead: str):
    raise RuntimeError(f"rlflow.algorithms.functional.{name} was removed: the functional core reads no ambient "
                       f"state any more; {instead}")


@contextlib.contextmanager
def batch_statistics(sum_fn: Callable[[Tensor], Tensor] | None):
    """Removed (it set a ContextVar that whole-batch statistics read): pass ``sum_fn=`` to the pure functions,
    or set it on the modules with ``rlflow.algorithms.aggregate.share_batch_sum(sum_fn, estimator)``."""
    _removed("batch_statistics", "pass sum_fn= to the functions (masked_whiten, ...) or call "
             "rlflow.algorithms.aggregate.share_batch_sum(sum_fn, estimator) once")
    yield  # pragma: no cover


@contextlib.contextmanager
def data_parallel(world_size: int):
    """Removed (it set a ContextVar for ``token-sum``'s factor): pass ``dp_size=`` to :func:`agg_loss`, or an
    ``rlflow.algorithms.aggregate.Aggregation(dp_size=...)`` to the loss."""
    _removed("data_parallel", "pass dp_size= to agg_loss, or Aggregation(dp_size=...) to the loss")
    yield  # pragma: no cover


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


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8,
                  sum_fn: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """verl: ``(x - mean) * rsqrt(var + eps)`` with whole-batch statistics over masked entries
    (unbiased variance; the sums are over every process's share with ``sum_fn``, see :func:`batch_sum`).

    The result is not re-masked (as in verl). ``shift_mean=False`` adds the mean back.
    rlflow: with fewer than 2 valid entries the variance is undefined (verl raises);
    the values are then only centred, ``x - mean``, not scaled (a single valid entry becomes 0).
    """
    n = batch_sum(mask.sum().to(x.dtype), sum_fn)
    mean = batch_sum(masked_sum(x, mask), sum_fn) / (n + 1e-8)
    var = batch_sum(masked_sum((x - mean) ** 2, mask), sum_fn) / (n + 1e-8) * n / (n - 1).clamp(min=1)
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
    sum_fn: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016; verl ``compute_gae_advantage_return``).

    Backwards over t: ``delta = r_t + gamma * V_next - V_t``; ``A_t = delta + gamma * lam * A_next``.
    Masked (tool/observation) steps are skipped: ``V_next`` and ``A_next`` carry over them
    unchanged, so valid steps never see values at masked positions.
    ``returns = A + V`` (before whitening, not masked, as verl); then
    ``A = masked_whiten(A, mask) * mask`` (rlflow: re-masked; verl leaves padding unmasked), with the
    statistics summed over processes by ``sum_fn`` (:func:`batch_sum`).
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
        advantages = masked_whiten(advantages, mask, sum_fn=sum_fn)
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
    dp_size: int = 1,
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
      (``dp_size``: the processes whose gradients are averaged); no count divides it.

    Pass ``num_tokens``/``num_seqs`` of the whole mini-batch so that the micro-batch losses sum
    exactly to the mini-batch loss (and so do their gradients). Under data parallelism with
    averaged gradients, pass the global count divided by the world size (verl's
    ``batch_num_tokens / dp_size`` and ``global_batch_size / dp_size``). These arguments travel together as one
    ``rlflow.algorithms.aggregate.Aggregation``, which the Trainer builds per mini-batch.
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
        return masked_sum(loss_mat, mask) * dp_size
    raise ValueError(f"unknown loss aggregation mode {mode!r}; valid modes: {list(AGG_MODES)}")


def aggregated(
    objective: tuple[Tensor, dict[str, Tensor]], mask: Tensor, agg: str = "token-mean",
    num_tokens: float | Tensor | None = None, num_seqs: float | Tensor | None = None,
    weights: Tensor | None = None, norm_length: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``(per_token, stats)`` of an objective -> ``(scalar loss, stats)``: ``weights`` ([B, R], e.g. truncated IS
    weights, verl ``rollout_is_weights``) multiply the per-token loss, then :func:`agg_loss` reduces it.

    The ``*_loss`` functions are their ``*_objective`` through this (verl's ``compute_policy_loss_*`` form, which
    the parity tests call); ``PPOLoss`` does the same once for every variant.
    """
    per_token, stats = objective
    if weights is not None:
        per_token = per_token * weights
    return agg_loss(per_token, mask, agg, num_tokens, num_seqs, norm_length), stats


def ppo_clip_objective(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
    clip_low: float = 0.2, clip_high: float = 0.2, clip_c: float | None = 3.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Dual-clip PPO per-token policy loss (Schulman et al. 2017; Ye et al. 2020; verl "vanilla").

    ``d = clamp(logp - old, -20, 20)``, ``ratio = exp(d)``;
    ``L1 = -A ratio``, ``L2 = -A clamp(ratio, 1 - clip_low, 1 + clip_high)``, ``c1 = max(L1, L2)``;
    for ``A < 0``: ``min(c1, -A clip_c)`` (dual clip; ``clip_c=None`` disables it).
    Stats (detached scalars, masked means over this call's tokens): ``pg_clipfrac`` = frac(L2 > L1),
    ``pg_clipfrac_lower`` = frac(c1 > -A clip_c and A < 0), ``ppo_kl`` = mean(-d).
    All inputs [B, R]; returns (per-token loss [B, R], stats).
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
    return per_token, stats


def ppo_clip_loss(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
    clip_low: float = 0.2, clip_high: float = 0.2, clip_c: float | None = 3.0, agg: str = "token-mean",
    num_tokens: float | Tensor | None = None, num_seqs: float | Tensor | None = None,
    weights: Tensor | None = None, norm_length: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`ppo_clip_objective` weighted by ``weights`` (after clipping; the stats ignore them) and reduced
    by :func:`agg_loss` (:func:`aggregated`). All inputs [B, R]; returns (scalar loss, stats)."""
    return aggregated(ppo_clip_objective(log_probs, old_log_probs, advantages, mask, clip_low, clip_high, clip_c),
                      mask, agg, num_tokens, num_seqs, weights, norm_length)


def value_objective(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_range: float | None = 0.5,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss per token (verl ``compute_value_loss`` before its aggregation).

    ``v_clip = clamp(v, V_old - c, V_old + c)``; ``0.5 * max((v - R)^2, (v_clip - R)^2)``.
    ``clip_range=None`` disables clipping. Stats: ``vf_clipfrac`` = masked mean of
    ``(v_clip - R)^2 > (v - R)^2`` (detached). All inputs [B, R]; returns (per-token loss [B, R], stats).
    """
    if clip_range is None:
        clipped_values = values
    else:
        clipped_values = torch.clamp(values, old_values - clip_range, old_values + clip_range)
    loss1 = (values - returns) ** 2
    loss2 = (clipped_values - returns) ** 2
    # 0.5 on each token, not on the aggregate: the same number, and the objective is the whole per-token loss
    clipfrac = masked_mean((loss2 > loss1).to(values.dtype), mask).detach()
    return 0.5 * torch.maximum(loss1, loss2), {"vf_clipfrac": clipfrac}


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_range: float | None = 0.5,
    agg: str = "token-mean", num_tokens: float | Tensor | None = None, num_seqs: float | Tensor | None = None,
    norm_length: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`value_objective` reduced by :func:`agg_loss` (``norm_length``: verl's ``critic.loss_scale_factor``,
    ``seq-mean-token-sum-norm`` only). All inputs [B, R]; returns (scalar loss, stats)."""
    return aggregated(value_objective(values, old_values, returns, mask, clip_range), mask, agg, num_tokens,
                      num_seqs, None, norm_length)
