"""Bypass mode: the sampler's log-probs are the old policy; no old-log-prob pass (verl ``rollout_correction.bypass_mode``).

Decoupled correction (:mod:`rlflow.algorithms.correction`) knows three policies: the sampler, the old policy
(one forward pass before the updates) and the current one. Bypass mode drops the middle one: ``old_log_probs``
*are* the sampler's ``rollout_log_probs``, so the pass is skipped, and the correction is computed in the loss,
per micro-batch, between the current policy and the sampler (verl ``apply_bypass_mode`` and
``core_algos.compute_policy_loss_bypass_mode``)::

    Chain(RolloutAsOld(), GRPO())                               # estimator slot: old_log_probs = rollout_log_probs
    BypassLoss("reinforce", weights=TruncatedIS("sequence"),     # -A * w * logp, w = min(pi / pi_rollout, 2)
               rejection=RejectionSampling("token_k1", "0.6_1.6"))

With ``rho = pi_theta / pi_rollout`` per token (the log-ratio clamped to +-20), ``m`` the response mask and
``m'`` it after ``rejection`` (its options read ``log_probs - rollout_log_probs``):

* ``loss_type="ppo_clip"`` (verl's default): PPO's (dual-)clipped objective with the ratio ``rho`` and mask
  ``m'``; ``weights`` are computed for their metrics only (the ratio is the correction: weighting too would
  count it twice).
* ``loss_type="reinforce"``: ``-A * sg(w) * logp`` on ``m'``, ``w`` the truncated weights of ``weights``
  (``rho`` truncated per token or per sequence), or 1 without them; ``actor/ppo_kl`` is the mean of
  ``rollout - logp`` over ``m'``.

The entropy and KL terms keep the unrejected mask ``m`` (as verl). The loss logs, per micro-batch,
``rollout_corr/*``: the weights' and rejection's statistics and the off-policy metrics of
:func:`rlflow.algorithms.mismatch.offpolicy_metrics`, all between the current policy and the sampler.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import Tensor

from rlflow.algorithms import functional as F
from rlflow.algorithms import policy_functional as PF
from rlflow.algorithms.correction import TruncatedIS, truncated_is_weights
from rlflow.algorithms.aggregate import Aggregation
from rlflow.algorithms.losses import LossOutput, PPOLoss, _aggregation
from rlflow.algorithms.mismatch import offpolicy_metrics, to_floats
from rlflow.algorithms.rejection import RejectionSampling, rejection_mask
from rlflow.data.keys import (
    ADVANTAGES,
    LOG_PROBS,
    OLD_LOG_PROBS,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
)
from rlflow.module import BatchModule

LOSS_TYPES = ("ppo_clip", "reinforce")  # verl rollout_correction.loss_type


class RolloutAsOld(BatchModule):
    """Writes ``old_log_probs = rollout_log_probs`` (verl ``apply_bypass_mode``). First in the estimator chain:
    what reads the old policy before the update (a KL in the reward) reads the sampler, and the Trainer, seeing the
    estimator write ``old_log_probs``, skips its old-log-prob pass even with several mini-batches or epochs."""

    in_keys = (ROLLOUT_LOG_PROBS,)
    out_keys = (OLD_LOG_PROBS,)

    def forward(self, batch: TensorDict) -> TensorDict:
        batch.set(OLD_LOG_PROBS, batch[ROLLOUT_LOG_PROBS])
        return batch

    def __repr__(self) -> str:
        return "RolloutAsOld()"


class BypassLoss(PPOLoss):
    """The policy loss of bypass mode (module docstring): PPO-clip or REINFORCE against the sampler.

    Reads ``rollout_log_probs`` itself (so it is right with or without :class:`RolloutAsOld`, which saves the
    old-log-prob pass). ``weights`` / ``rejection`` give the settings only (level, thresholds, options); the
    weights and masks are computed here, from the current log-probs. The other arguments are PPOLoss's.

    Args:
        loss_type: ``"ppo_clip"`` or ``"reinforce"`` (verl ``rollout_correction.loss_type``).
        weights: a :class:`TruncatedIS` (verl ``rollout_is`` / ``rollout_is_threshold`` /
            ``rollout_is_batch_normalize``), or None.
        rejection: a :class:`RejectionSampling` (verl ``rollout_rs`` / ``rollout_rs_threshold``), or None.
    """

    def __init__(self, loss_type: str = "ppo_clip", weights: TruncatedIS | None = None,
                 rejection: RejectionSampling | None = None, **ppo_kwargs):
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown bypass loss_type {loss_type!r}; valid: {', '.join(LOSS_TYPES)}")
        if ppo_kwargs.get("is_weights"):
            raise ValueError("is_weights=True: in bypass mode the loss computes its IS weights itself (weights=)")
        if weights is not None and not isinstance(weights, TruncatedIS):
            raise TypeError(f"weights must be a TruncatedIS (its level and thresholds), got {weights!r}")
        if rejection is not None and not isinstance(rejection, RejectionSampling):
            raise TypeError(f"rejection must be a RejectionSampling (its options), got {rejection!r}")
        super().__init__(**ppo_kwargs)
        self.loss_type, self.weights, self.rejection = loss_type, weights, rejection
        self._corr: dict[str, Tensor] = {}

    @property
    def in_keys(self) -> tuple[str, ...]:
        return tuple(ROLLOUT_LOG_PROBS if k == OLD_LOG_PROBS else k for k in super().in_keys)

    def pg_loss(self, batch: TensorDict, aggregation: Aggregation | None = None, *,
                num_tokens=None, num_seqs=None) -> tuple[Tensor, dict[str, Tensor]]:
        """The policy term against the sampler, aggregated over the tokens ``rejection`` keeps (``m'``)."""
        agg = _aggregation(self, aggregation, num_tokens, num_seqs, "pg_loss")
        log_probs, rollout, advantages = batch[LOG_PROBS], batch[ROLLOUT_LOG_PROBS], batch[ADVANTAGES]
        mask = kept = batch[RESPONSE_MASK]
        current, stats, w = log_probs.detach(), {}, None
        with torch.no_grad():
            if self.weights is not None:
                c = self.weights
                w, stats = truncated_is_weights(current, rollout, mask, c.level, c.threshold, c.lower,
                                                c.batch_normalize)
            if self.rejection is not None:
                kept, rs_stats = rejection_mask(current, rollout, mask, self.rejection.thresholds)
                stats |= rs_stats
            self._corr = {f"rollout_corr/{k}": v for k, v in stats.items()} | offpolicy_metrics(current, rollout, mask)
        if self.loss_type == "ppo_clip":  # the ratio pi / pi_rollout is the correction: no weights on top
            per_token, pg_stats = F.ppo_clip_objective(log_probs, rollout, advantages, kept, self.clip_low,
                                                       self.clip_high, self.clip_ratio_c)
            return agg(per_token, kept), pg_stats
        per_token, _ = PF.reinforce_objective(log_probs, advantages)
        if w is not None:
            per_token = per_token * w
        return agg(per_token, kept), {"ppo_kl": F.masked_mean(rollout - current, kept)}

    def __call__(self, batch: TensorDict, aggregation: Aggregation | None = None, *,
                 num_tokens=None, num_seqs=None) -> LossOutput:
        out = super().__call__(batch, aggregation, num_tokens=num_tokens, num_seqs=num_seqs)
        out.stats |= to_floats(self._corr)
        return out

    def __repr__(self) -> str:
        return (f"BypassLoss(loss_type={self.loss_type!r}, weights={self.weights!r}, rejection={self.rejection!r}, "
                f"clip_ratio={self.clip_ratio!r}, agg={self.agg!r})")
