"""Off-policy correction: truncated importance sampling between the sampler and the trainer.

The sampler (vLLM, SGLang, bf16 kernels, a stale copy of the weights) and the training
forward pass assign slightly different probabilities to the same tokens. Truncated IS
(Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training";
verl ``algorithm.rollout_correction``, ``rollout_corr_helper.py``) reweights each token's
policy loss by ``pi_old / pi_rollout``, truncated from above::

    Chain(TruncatedIS(level="token", threshold=2.0), GRPO())    # estimator slot: writes is_weights
    PPOLoss(is_weights=True)                                     # multiplies the per-token loss by them

The loss declares ``is_weights`` among its keys only when asked, so a loss that wants
weights without a ``TruncatedIS`` before it fails when the Trainer is built.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import Tensor

from rlflow.algorithms.functional import masked_mean, masked_sum
from rlflow.data.keys import IS_WEIGHTS, OLD_LOG_PROBS, RESPONSE_MASK, ROLLOUT_LOG_PROBS
from rlflow.module import BatchModule

SAFETY_BOUND = 20.0  # exp(20) ~ 4.9e8: the log-ratio is clamped to +-20 before exp (verl)


def _token_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    return log_ratio


def _sequence_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    return masked_sum(log_ratio, mask, -1)[:, None].expand_as(log_ratio)


LEVELS = {"token": _token_log_ratio, "sequence": _sequence_log_ratio}


def truncated_is_weights(
    old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor, level: str = "token",
    threshold: float = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance weights (verl ``compute_rollout_correction_weights``).

    ``token``: ``w_t = exp(clamp(old_t - rollout_t, -20, 20))``; ``sequence``: one weight per
    sequence, ``w = exp(clamp(sum_t m_t (old_t - rollout_t), -20, 20))``, on every valid token.
    Then ``w = min(w, threshold) * mask``, detached (the weights change the measure, not the objective).

    Stats (detached scalars, before truncation, as verl): ``rollout_is_mean`` (mean over valid
    tokens), ``rollout_is_max`` / ``rollout_is_min``, ``rollout_is_ratio_fraction_high`` (the
    fraction truncated: weight > threshold) and ``rollout_is_ratio_fraction_low`` (weight <
    1/threshold); at the sequence level max, min and the fractions are over sequences.
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
        "rollout_is_ratio_fraction_low": masked_mean((unit_w < 1.0 / threshold).to(raw.dtype), unit_mask),
    }
    return raw.clamp(max=threshold).detach(), stats


class TruncatedIS(BatchModule):
    """Writes ``is_weights`` ([B, R]): truncated ``pi_old / pi_rollout`` per token or per sequence.

    Reads ``old_log_probs`` (so the Trainer computes them, one extra forward pass) and the
    sampler's ``rollout_log_probs``. ``stats`` holds verl's metrics under ``rollout_corr/``:
    ``rollout_corr/rollout_is_mean``, ``..._max``, ``..._min``, ``..._ratio_fraction_high``
    (fraction truncated), ``..._ratio_fraction_low``. See :func:`truncated_is_weights`.

    Args:
        level: ``"token"`` (verl ``rollout_is=token``) or ``"sequence"`` (``rollout_is=sequence``).
        threshold: the truncation ``C`` (verl ``rollout_is_threshold``, default 2.0).
    """

    in_keys = (OLD_LOG_PROBS, ROLLOUT_LOG_PROBS, RESPONSE_MASK)
    out_keys = (IS_WEIGHTS,)

    def __init__(self, level: str = "token", threshold: float = 2.0):
        if level not in LEVELS:
            raise ValueError(f"unknown IS level {level!r}; valid levels: {sorted(LEVELS)}")
        if threshold <= 0:
            raise ValueError(f"threshold must be > 0, got {threshold}")
        self.level = level
        self.threshold = threshold
        self.stats: dict[str, float] = {}

    @torch.no_grad()
    def forward(self, batch: TensorDict) -> TensorDict:
        weights, stats = truncated_is_weights(
            batch[OLD_LOG_PROBS], batch[ROLLOUT_LOG_PROBS], batch[RESPONSE_MASK], self.level, self.threshold
        )
        batch.set(IS_WEIGHTS, weights)
        values = torch.stack(list(stats.values())).tolist()  # one device sync for all stats
        self.stats = {f"rollout_corr/{k}": v for k, v in zip(stats, values)}
        return batch

    def __repr__(self) -> str:
        return f"TruncatedIS(level={self.level!r}, threshold={self.threshold!r})"
