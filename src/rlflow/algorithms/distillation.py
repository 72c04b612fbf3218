"""On-policy distillation (verl ``distillation.*``): the student learns from a frozen teacher's log-probs of the
student's own samples.

The teacher (:class:`rlflow.models.teacher.Teacher`, a stage of the experience stream) writes
``teacher_log_probs`` [B, R]; the losses here read it with the student's ``log_probs`` (under autograd) during
the update. The per-token distillation loss is a single-sample estimate of the reverse KL
``KL(pi_student || pi_teacher)`` on the sampled tokens (Agarwal et al. 2024, arXiv 2306.13649; Thinking Machines,
"On-Policy Distillation", 2025), with verl's estimator names (``functional.kl_penalty``: ``k1`` = ``logp - logp_T``,
``k2``/``mse``, ``k3``/``low_var_kl``, ``abs``), clamped to ``[-loss_max_clamp, loss_max_clamp]``.

Two ways to learn from it (verl ``distillation_loss.use_policy_gradient``), one class each:

- :class:`DistillationLoss`: backpropagate it as a supervised loss, ``agg(d)`` (verl's ``use_policy_gradient=False``;
  ``k3`` recommended; ``k1`` is refused: its gradient does not depend on the teacher);
- :class:`PolicyGradientDistillationLoss`: use ``-d`` (detached) as a per-token advantage in verl's "vanilla"
  dual-clip PPO objective (verl's default; ``k1`` recommended).

Either is added to an RL loss (``rl_loss=PPOLoss(...)``: verl's ``use_task_rewards=True``) as
``rl + coef * distill``, or trains alone (``rl_loss=None``: verl's ``use_task_rewards=False``; verl then uses
coefficient 1). The aggregation is the Trainer's :class:`~rlflow.algorithms.aggregate.Aggregation` with the loss's
``agg`` (verl: the actor's ``loss_agg_mode``).
"""

from __future__ import annotations

from tensordict import TensorDict
from torch import Tensor

from rlflow.algorithms import functional as F
from rlflow.algorithms.aggregate import Aggregation
from rlflow.algorithms.losses import (
    LossOutput,
    PPOLoss,
    _aggregation,
    _require,
    _to_floats,
)
from rlflow.data.keys import LOG_PROBS, OLD_LOG_PROBS, RESPONSE_MASK, TEACHER_LOG_PROBS

KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def distillation_losses(log_probs: Tensor, teacher_log_probs: Tensor, kind: str = "k3",
                        max_clamp: float | None = None) -> Tensor:
    """Per-token distillation loss [B, R]: ``clamp(kl_penalty(logp, logp_T, kind), -c, c)`` (verl
    ``compute_distillation_loss_reverse_kl_estimator``, then ``loss_max_clamp``; ``None``: no clamp).

    log_probs: the student's [B, R]; teacher_log_probs: the teacher's on the same tokens [B, R].
    """
    if kind not in KINDS:
        raise ValueError(f"unknown distillation loss {kind!r}; valid: {list(KINDS)}")
    d = F.kl_penalty(log_probs, teacher_log_probs, kind)
    return d if max_clamp is None else d.clamp(-max_clamp, max_clamp)


class DistillationLoss:
    """Supervised on-policy distillation: ``rl_loss + coef * agg(d)`` (``d``: :func:`distillation_losses`).

    Args:
        rl_loss: the RL loss it is added to (``PPOLoss`` or a variant), or ``None`` to distil alone.
        kind: the KL estimator (``KINDS``); ``k1``/``kl`` only with :class:`PolicyGradientDistillationLoss`.
        coef: the distillation term's weight (verl ``distillation_loss_coef``).
        max_clamp: ``d`` is clamped to ``[-max_clamp, max_clamp]`` (verl ``loss_max_clamp``).
        agg, loss_scale_factor: the aggregation mode and its ``norm_length`` (verl ``loss_agg_mode``).

    Stats: ``distillation/loss`` (this call's share, summed over micro-batches), ``distillation/abs_loss`` (the mean
    ``|d|`` over this call's tokens), with the RL loss's own.
    """

    out_keys: tuple[str, ...] = ()

    def __init__(self, rl_loss: PPOLoss | None = None, kind: str = "k3", coef: float = 1.0,
                 max_clamp: float | None = None, agg: str = "token-mean", loss_scale_factor: float | None = None):
        if kind not in KINDS:
            raise ValueError(f"unknown distillation loss {kind!r}; valid: {list(KINDS)}")
        self.check_kind(kind)
        if max_clamp is not None and not max_clamp > 0:
            raise ValueError(f"max_clamp must be > 0, got {max_clamp}")
        Aggregation(agg)  # an unknown mode fails now
        self.rl_loss, self.kind, self.coef, self.max_clamp = rl_loss, kind, coef, max_clamp
        self.agg, self.loss_scale_factor = agg, loss_scale_factor

    def check_kind(self, kind: str) -> None:
        if kind in ("k1", "kl"):
            raise ValueError("distillation loss k1 as a supervised loss: its gradient, that of logp, does not depend "
                             "on the teacher's log-probs (verl refuses it too); use PolicyGradientDistillationLoss "
                             "(verl use_policy_gradient=True) or kind='k3'")

    @property
    def in_keys(self) -> tuple[str, ...]:
        own = (LOG_PROBS, TEACHER_LOG_PROBS, RESPONSE_MASK)
        rl = tuple(k for k in self.rl_loss.in_keys if k not in own) if self.rl_loss is not None else ()
        return own + rl

    def term(self, batch: TensorDict, per_token: Tensor, agg: Aggregation) -> tuple[Tensor, dict[str, Tensor]]:
        """The distillation term (a scalar) from the per-token losses ``per_token`` [B, R]; a variant overrides it."""
        return agg(per_token, batch[RESPONSE_MASK]), {}

    def __call__(self, batch: TensorDict, aggregation: Aggregation | None = None) -> LossOutput:
        _require(self, batch)
        agg = _aggregation(self, aggregation, None, None, "__call__")
        mask = batch[RESPONSE_MASK]
        per_token = distillation_losses(batch[LOG_PROBS], batch[TEACHER_LOG_PROBS], self.kind, self.max_clamp)
        distill, term_stats = self.term(batch, per_token, agg)
        stats = {"distillation/loss": distill.detach(),
                 "distillation/abs_loss": F.masked_mean(per_token.detach().abs(), mask)}
        stats |= {f"distillation/{k}": v for k, v in term_stats.items()}
        total, summed = self.coef * distill, {"distillation/loss"}
        if self.rl_loss is not None:
            rl = self.rl_loss(batch, aggregation)
            total, summed = rl.loss + total, summed | rl.summed
            return LossOutput(total, rl.stats | _to_floats(stats), frozenset(summed))
        return LossOutput(total, _to_floats(stats), frozenset(summed))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rl_loss={self.rl_loss!r}, kind={self.kind!r}, coef={self.coef!r}, "
                f"max_clamp={self.max_clamp!r}, agg={self.agg!r})")


class PolicyGradientDistillationLoss(DistillationLoss):
    """On-policy distillation as RL with a per-token reward: verl's "vanilla" dual-clip PPO objective
    (``functional.ppo_clip_objective``) with advantages ``-d`` (detached) and its own clip ratios (verl
    ``distillation_loss.clip_ratio*``; the dual clip at 3, verl's default), aggregated as the other terms.

    With ``kind="k1"`` the advantage of a token is ``logp_T - logp``: tokens the teacher likes more than the
    student are pushed up. ``clip_ratio_low`` / ``clip_ratio_high`` default to ``clip_ratio``. Stats add
    ``distillation/pg_clipfrac``, ``distillation/ppo_kl`` and ``distillation/pg_clipfrac_lower``.
    """

    def __init__(self, rl_loss: PPOLoss | None = None, kind: str = "k1", coef: float = 1.0,
                 max_clamp: float | None = None, agg: str = "token-mean", loss_scale_factor: float | None = None,
                 clip_ratio: float = 0.2, clip_ratio_low: float | None = None, clip_ratio_high: float | None = None):
        super().__init__(rl_loss, kind, coef, max_clamp, agg, loss_scale_factor)
        self.clip_low = clip_ratio if clip_ratio_low is None else clip_ratio_low
        self.clip_high = clip_ratio if clip_ratio_high is None else clip_ratio_high

    def check_kind(self, kind: str) -> None:
        """Every estimator works as a reward."""

    @property
    def in_keys(self) -> tuple[str, ...]:
        keys = super().in_keys
        return keys + ((OLD_LOG_PROBS,) if OLD_LOG_PROBS not in keys else ())

    def term(self, batch, per_token, agg):
        advantages = -per_token.detach()
        loss, stats = F.ppo_clip_objective(batch[LOG_PROBS], batch[OLD_LOG_PROBS], advantages, batch[RESPONSE_MASK],
                                           self.clip_low, self.clip_high, 3.0)
        return agg(loss, batch[RESPONSE_MASK]), stats


__all__ = ["KINDS", "DistillationLoss", "PolicyGradientDistillationLoss", "distillation_losses"]
