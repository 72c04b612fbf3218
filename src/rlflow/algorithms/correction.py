"""Off-policy correction: truncated importance sampling between the sampler and the trainer.

The sampler (vLLM, SGLang, bf16 kernels, a stale copy of the weights) and the training
forward pass assign slightly different probabilities to the same tokens. Truncated IS
(Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training";
verl ``algorithm.rollout_correction``, ``rollout_corr_helper.py``) reweights each token's
policy loss by ``pi_old / pi_rollout``, truncated from above::

    Chain(TruncatedIS(level="token", threshold=2.0), GRPO())    # estimator slot: writes is_weights
    PPOLoss(is_weights=True)                                     # multiplies the per-token loss by them

With a lower bound too (verl's ``rollout_is_threshold='0.5_4.0'``, IcePop) weights outside ``[lower, upper]``
are zeroed instead of truncated; ``batch_normalize=True`` (verl ``rollout_is_batch_normalize``) then scales the
weights to mean 1 over the batch.

The loss declares ``is_weights`` among its keys only when asked, so a loss that wants
weights without a ``TruncatedIS`` before it fails when the Trainer is built.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import Tensor

from rlflow.algorithms.aggregate import WholeBatch
from rlflow.algorithms.functional import batch_sum, masked_mean, masked_sum
from rlflow.data.keys import IS_WEIGHTS, OLD_LOG_PROBS, RESPONSE_MASK, ROLLOUT_LOG_PROBS
from rlflow.module import BatchModule

SAFETY_BOUND = 20.0  # exp(20) ~ 4.9e8: the log-ratio is clamped to +-20 before exp (verl)


def _token_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    return log_ratio


def _sequence_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    return masked_sum(log_ratio, mask, -1)[:, None].expand_as(log_ratio)


LEVELS = {"token": _token_log_ratio, "sequence": _sequence_log_ratio}


def parse_is_threshold(spec: float | str) -> tuple[float, float | None]:
    """verl's ``rollout_is_threshold`` (``_parse_rollout_is_threshold``): a number or a number-like string is the
    upper bound; ``"lower_upper"`` (``"0.5_4.0"``) gives both. Returns ``(upper, lower or None)``; bounds must be
    positive and ``lower <= upper``."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise TypeError(f"rollout_is_threshold must be a number or a 'lower_upper' string, got {spec!r}")
    lower = None
    if isinstance(spec, str):
        text = spec.strip()
        try:
            if "_" in text:
                low, high = text.split("_", 1)
                lower, upper = float(low), float(high)
            else:
                upper = float(text)
        except ValueError:
            raise ValueError(f"cannot read {spec!r} as a number or as 'lower_upper' (e.g. '0.5_4.0')") from None
    else:
        upper = float(spec)
    if not upper > 0:
        raise ValueError(f"the threshold (upper bound) must be > 0, got {upper}")
    if lower is not None and not 0 < lower <= upper:
        raise ValueError(f"the threshold's lower bound must be in (0, upper={upper}], got {lower}")
    return upper, lower


def truncated_is_weights(
    old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor, level: str = "token",
    threshold: float = 2.0, lower: float | None = None, batch_normalize: bool = False, sum_fn=None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance weights (verl ``compute_rollout_correction_weights``).

    ``token``: ``w_t = exp(clamp(old_t - rollout_t, -20, 20))``; ``sequence``: one weight per
    sequence, ``w = exp(clamp(sum_t m_t (old_t - rollout_t), -20, 20))``, on every valid token.
    Then ``w = min(w, threshold) * mask``, or with ``lower`` (IcePop) ``w`` where ``lower <= w <= threshold`` and
    0 elsewhere; detached (the weights change the measure, not the objective). ``batch_normalize`` divides them
    by their mean (over valid tokens at the token level, over sequences with a valid token at the sequence
    level; summed over processes by ``sum_fn``, ``functional.batch_sum``) when it exceeds 1e-8.

    Stats (detached scalars, before truncation, as verl): ``rollout_is_mean`` (mean over valid
    tokens), ``rollout_is_max`` / ``rollout_is_min``, ``rollout_is_ratio_fraction_high`` (the
    fraction truncated: weight > threshold) and ``rollout_is_ratio_fraction_low`` (weight <
    1/threshold, or ``lower``); at the sequence level max, min and the fractions are over sequences. With
    ``lower``: ``rollout_is_oob_ratio``, the fraction of valid tokens zeroed; with ``batch_normalize``:
    ``rollout_is_batch_norm_factor``, the mean divided by (1 when it is too small).
    rlflow: an empty mask gives zero weights and zero stats (verl raises); sequences without a valid
    token are left out of the sequence-level stats (verl counts them with weight 1).
    All tensors [B, R]; returns ``(weights [B, R], stats)``.
    """
    if level not in LEVELS:
        raise ValueError(f"unknown IS level {level!r}; valid levels: {sorted(LEVELS)}")
    mask = response_mask.to(old_log_probs.dtype)
    log_w = LEVELS[level]((old_log_probs - rollout_log_probs).detach(), mask).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    raw = torch.exp(log_w) * mask
    # Entries the max/min/fractions run over: valid tokens, or (sequence level) sequences with one.
    unit_w, unit_mask = (raw, mask) if level == "token" else (raw.amax(-1), (mask.sum(-1) > 0).to(mask.dtype))
    valid = unit_mask.bool()
    any_valid = valid.any()
    zero = raw.new_zeros(())
    stats = {
        "rollout_is_mean": masked_mean(raw, mask),
        "rollout_is_max": torch.where(any_valid, unit_w.masked_fill(~valid, float("-inf")).max(), zero),
        "rollout_is_min": torch.where(any_valid, unit_w.masked_fill(~valid, float("inf")).min(), zero),
        "rollout_is_ratio_fraction_high": masked_mean((unit_w > threshold).to(raw.dtype), unit_mask),
        "rollout_is_ratio_fraction_low": masked_mean((unit_w < (lower or 1.0 / threshold)).to(raw.dtype), unit_mask),
    }
    if lower is None:
        weights = raw.clamp(max=threshold)
    else:
        kept = (raw >= lower) & (raw <= threshold)
        weights = torch.where(kept, raw, torch.zeros_like(raw))
        stats["rollout_is_oob_ratio"] = masked_mean((~kept).to(raw.dtype), mask)
    if batch_normalize:
        if level == "token":
            total, count = masked_sum(weights, mask), mask.sum()
        else:
            seq_mask = (mask.sum(-1) > 0).to(mask.dtype)
            total, count = (masked_mean(weights, mask, -1) * seq_mask).sum(), seq_mask.sum()
        mean = batch_sum(total, sum_fn) / batch_sum(count, sum_fn).clamp_min(1e-8)
        factor = torch.where(mean > 1e-8, mean, torch.ones_like(mean))
        weights = weights / factor
        stats["rollout_is_batch_norm_factor"] = factor
    return weights.detach(), stats


class TruncatedIS(WholeBatch, BatchModule):
    """Writes ``is_weights`` ([B, R]): truncated ``pi_old / pi_rollout`` per token or per sequence.

    Reads ``old_log_probs`` (so the Trainer computes them, one extra forward pass) and the
    sampler's ``rollout_log_probs``. ``stats`` holds verl's metrics under ``rollout_corr/``:
    ``rollout_corr/rollout_is_mean``, ``..._max``, ``..._min``, ``..._ratio_fraction_high``
    (fraction truncated), ``..._ratio_fraction_low``. See :func:`truncated_is_weights`.

    Args:
        level: ``"token"`` (verl ``rollout_is=token``) or ``"sequence"`` (``rollout_is=sequence``).
        threshold: the truncation ``C`` (verl ``rollout_is_threshold``, default 2.0), or verl's ``"lower_upper"``
            string (``"0.5_4.0"``), which sets ``lower`` too.
        lower: with it, weights outside ``[lower, threshold]`` are zeroed, not truncated (IcePop).
        batch_normalize: scale the weights to mean 1 over the batch (verl ``rollout_is_batch_normalize``).
    """

    in_keys = (OLD_LOG_PROBS, ROLLOUT_LOG_PROBS, RESPONSE_MASK)
    out_keys = (IS_WEIGHTS,)

    def __init__(self, level: str = "token", threshold: float | str = 2.0, lower: float | None = None,
                 batch_normalize: bool = False):
        if level not in LEVELS:
            raise ValueError(f"unknown IS level {level!r}; valid levels: {sorted(LEVELS)}")
        upper, parsed_lower = parse_is_threshold(threshold)
        if parsed_lower is not None and lower is not None and parsed_lower != lower:
            raise ValueError(f"threshold={threshold!r} sets lower={parsed_lower}, but lower={lower} was given")
        self.level, self.threshold, self.batch_normalize = level, upper, batch_normalize
        self.lower = lower if lower is not None else parsed_lower
        if self.lower is not None:
            parse_is_threshold(f"{self.lower}_{upper}")  # 0 < lower <= threshold
        self.stats: dict[str, float] = {}

    @torch.no_grad()
    def forward(self, batch: TensorDict) -> TensorDict:
        weights, stats = truncated_is_weights(
            batch[OLD_LOG_PROBS], batch[ROLLOUT_LOG_PROBS], batch[RESPONSE_MASK], self.level, self.threshold,
            self.lower, self.batch_normalize, self.sum_fn)
        batch.set(IS_WEIGHTS, weights)
        values = torch.stack(list(stats.values())).tolist()  # one device sync for all stats
        self.stats = {f"rollout_corr/{k}": v for k, v in zip(stats, values)}
        return batch

    def __repr__(self) -> str:
        extra = (f", lower={self.lower!r}" if self.lower is not None else "") + (
            ", batch_normalize=True" if self.batch_normalize else "")
        return f"TruncatedIS(level={self.level!r}, threshold={self.threshold!r}{extra})"
