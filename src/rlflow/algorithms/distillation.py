"""On-policy distillation (verl ``distillation.*``): the student learns from a frozen teacher's log-probs of the
student's own samples.

The teacher (:class:`rlflow.models.teacher.Teacher`, a stage of the experience stream) writes
``teacher_log_probs`` [B, R]; the losses here read it with the student's ``log_probs`` (under autograd) during
the update. The per-token distillation loss is a single-sample estimate of the reverse KL
``KL(pi_student || pi_teacher)`` on the sampled tokens (Agarwal et al. 2024, arXiv 2306.13649; Thinking Machines,
"On-Policy Distillation", 2025), with verl's estimator names (``functional.kl_penalty``: ``k1`` = ``logp - logp_T``,
``k2``/``mse``, ``k3``/``low_var_kl``, ``abs``), clamped to ``[-loss_max_clamp, loss_max_clamp]``.

``kind="forward_kl_topk"`` (verl's ``loss_mode=forward_kl_topk``) is the forward KL over the teacher's top-k tokens
instead (:func:`forward_kl_topk_losses`): the teacher stage writes its ``k`` most likely tokens at every response
position (``Teacher(top_k=k)``) and the update scores the student's log-probs of those tokens from its
full-vocabulary log-softmax, in the same head pass as the sampled token's (``topk_log_probs``).

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
from rlflow.data.keys import (LOG_PROBS, OLD_LOG_PROBS, RESPONSE_MASK, TEACHER_LOG_PROBS, TEACHER_TOPK_IDS,
                              TEACHER_TOPK_LOG_PROBS, TOPK_LOG_PROBS)

KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
TOPK = "forward_kl_topk"  # the forward KL over the teacher's top-k tokens (not a single-token estimator)


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


def forward_kl_topk_losses(topk_log_probs: Tensor, teacher_topk_log_probs: Tensor, min_clamp: float | None = None,
                           max_clamp: float | None = None) -> Tensor:
    """Per-token forward KL over the teacher's top-k tokens [B, R], as verl's ``forward_kl_topk``:
    ``sum_i p_i (log p_i - log q_i)`` over the ``k`` tokens, with ``log p`` the teacher's and ``log q`` the student's
    full-vocabulary log-probs of them (not renormalised over the ``k``), both clamped below at ``min_clamp`` (verl
    ``log_prob_min_clamp``), then clamped at 0 (the ``k`` tokens' masses do not sum to 1, so the sum can be
    negative) and to ``[-max_clamp, max_clamp]`` (``loss_max_clamp``).

    topk_log_probs: the student's [B, R, k]; teacher_topk_log_probs: the teacher's, of the same tokens [B, R, k].
    """
    if topk_log_probs.shape != teacher_topk_log_probs.shape:
        raise ValueError(f"forward_kl_topk: the student's top-k log-probs {tuple(topk_log_probs.shape)} and the "
                         f"teacher's {tuple(teacher_topk_log_probs.shape)} differ in shape")
    q, p = topk_log_probs.float(), teacher_topk_log_probs.float()
    if min_clamp is not None:
        q, p = q.clamp_min(min_clamp), p.clamp_min(min_clamp)
    d = (p.exp() * (p - q)).sum(-1).clamp_min(0.0)
    return d if max_clamp is None else d.clamp(-max_clamp, max_clamp)


class DistillationLoss:
    """Supervised on-policy distillation: ``rl_loss + coef * agg(d)`` (``d``: :func:`distillation_losses`).

    Args:
        rl_loss: the RL loss it is added to (``PPOLoss`` or a variant), or ``None`` to distil alone.
        kind: the KL estimator (``KINDS``; ``k1``/``kl`` only with :class:`PolicyGradientDistillationLoss`), or
            ``"forward_kl_topk"`` (:func:`forward_kl_topk_losses`; needs ``Teacher(top_k=k)`` in the stages).
        coef: the distillation term's weight (verl ``distillation_loss_coef``).
        max_clamp: ``d`` is clamped to ``[-max_clamp, max_clamp]`` (verl ``loss_max_clamp``).
        agg, loss_scale_factor: the aggregation mode and its ``norm_length`` (verl ``loss_agg_mode``).
        log_prob_min_clamp: ``forward_kl_topk`` only: both sides' top-k log-probs are clamped below at it (verl's
            key of that name; ``None``: no clamp).

    Stats: ``distillation/loss`` (this call's share, summed over micro-batches), ``distillation/abs_loss`` (the mean
    ``|d|`` over this call's tokens), with the RL loss's own; ``forward_kl_topk`` adds ``distillation/student_mass``
    and ``distillation/teacher_mass``, the mean probability mass of the teacher's top-k tokens under each.
    """

    out_keys: tuple[str, ...] = ()

    def __init__(self, rl_loss: PPOLoss | None = None, kind: str = "k3", coef: float = 1.0,
                 max_clamp: float | None = None, agg: str = "token-mean", loss_scale_factor: float | None = None,
                 log_prob_min_clamp: float | None = None):
        if kind not in KINDS + (TOPK,):
            raise ValueError(f"unknown distillation loss {kind!r}; valid: {list(KINDS + (TOPK,))}")
        self.check_kind(kind)
        if max_clamp is not None and not max_clamp > 0:
            raise ValueError(f"max_clamp must be > 0, got {max_clamp}")
        if log_prob_min_clamp is not None and kind != TOPK:
            raise ValueError(f"log_prob_min_clamp is only read by kind={TOPK!r} (got kind={kind!r})")
        Aggregation(agg)  # an unknown mode fails now
        self.rl_loss, self.kind, self.coef, self.max_clamp = rl_loss, kind, coef, max_clamp
        self.agg, self.loss_scale_factor, self.log_prob_min_clamp = agg, loss_scale_factor, log_prob_min_clamp

    def check_kind(self, kind: str) -> None:
        if kind in ("k1", "kl"):
            raise ValueError("distillation loss k1 as a supervised loss: its gradient, that of logp, does not depend "
                             "on the teacher's log-probs (verl refuses it too); use PolicyGradientDistillationLoss "
                             "(verl use_policy_gradient=True) or kind='k3'")

    @property
    def in_keys(self) -> tuple[str, ...]:
        own = ((LOG_PROBS, TOPK_LOG_PROBS, TEACHER_TOPK_LOG_PROBS, TEACHER_TOPK_IDS, RESPONSE_MASK) if self.kind == TOPK
               else (LOG_PROBS, TEACHER_LOG_PROBS, RESPONSE_MASK))
        rl = tuple(k for k in self.rl_loss.in_keys if k not in own) if self.rl_loss is not None else ()
        return own + rl

    def term(self, batch: TensorDict, per_token: Tensor, agg: Aggregation) -> tuple[Tensor, dict[str, Tensor]]:
        """The distillation term (a scalar) from the per-token losses ``per_token`` [B, R]; a variant overrides it."""
        return agg(per_token, batch[RESPONSE_MASK]), {}

    def __call__(self, batch: TensorDict, aggregation: Aggregation | None = None) -> LossOutput:
        _require(self, batch)
        agg = _aggregation(self, aggregation, None, None, "__call__")
        mask = batch[RESPONSE_MASK]
        stats = {}
        if self.kind == TOPK:
            student, teacher = batch[TOPK_LOG_PROBS], batch[TEACHER_TOPK_LOG_PROBS]
            per_token = forward_kl_topk_losses(student, teacher, self.log_prob_min_clamp, self.max_clamp)
            stats = {"distillation/student_mass": F.masked_mean(student.detach().float().exp().sum(-1), mask),
                     "distillation/teacher_mass": F.masked_mean(teacher.float().exp().sum(-1), mask)}
        else:
            per_token = distillation_losses(batch[LOG_PROBS], batch[TEACHER_LOG_PROBS], self.kind, self.max_clamp)
        distill, term_stats = self.term(batch, per_token, agg)
        stats |= {"distillation/loss": distill.detach(),
                  "distillation/abs_loss": F.masked_mean(per_token.detach().abs(), mask)}
        stats |= {f"distillation/{k}": v for k, v in term_stats.items()}
        total, summed = self.coef * distill, {"distillation/loss"}
        if self.rl_loss is not None:
            rl = self.rl_loss(batch, aggregation)
            total, summed = rl.loss + total, summed | rl.summed
            return LossOutput(total, rl.stats | _to_floats(stats), frozenset(summed))
        return LossOutput(total, _to_floats(stats), frozenset(summed))

    def __repr__(self) -> str:
        clamp = f", log_prob_min_clamp={self.log_prob_min_clamp!r}" if self.log_prob_min_clamp is not None else ""
        return (f"{type(self).__name__}(rl_loss={self.rl_loss!r}, kind={self.kind!r}, coef={self.coef!r}, "
                f"max_clamp={self.max_clamp!r}, agg={self.agg!r}{clamp})")


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
                 clip_ratio: float = 0.2, clip_ratio_low: float | None = None, clip_ratio_high: float | None = None,
                 log_prob_min_clamp: float | None = None):
        super().__init__(rl_loss, kind, coef, max_clamp, agg, loss_scale_factor, log_prob_min_clamp)
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


__all__ = ["KINDS", "TOPK", "DistillationLoss", "PolicyGradientDistillationLoss", "distillation_losses",
           "forward_kl_topk_losses"]
