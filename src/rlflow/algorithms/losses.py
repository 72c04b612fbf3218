"""Policy and value losses: module shells over ``functional``, and the one place a loss is aggregated.

A loss reads a (micro-)batch and an :class:`~rlflow.algorithms.aggregate.Aggregation` (the mini-batch's
counts and the number of processes, built by the Trainer) and returns a :class:`LossOutput`. A policy-loss
variant (GSPO, CISPO, ...) subclasses :class:`PPOLoss` and overrides ``objective`` only: the per-token
loss and its stats. The shell applies, once for every variant, the IS weights, the aggregation, the KL
and entropy terms, the key checks and the statistics.

With the mini-batch's counts the losses of the micro-batches sum to the mini-batch loss. Statistics
follow the same rule, and :class:`LossOutput` says which is which: loss terms ("actor/pg_loss",
"actor/kl_loss", "actor/entropy", "critic/vf_loss") are this call's share, summed over micro-batches
(``LossOutput.summed``); fractions and means ("actor/pg_clipfrac", "actor/ppo_kl", "critic/vf_clipfrac",
"critic/vpred_mean") are over this call's tokens only, averaged.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import dataclass, field

import torch
from tensordict import TensorDict
from torch import Tensor

from rlflow.algorithms import functional as F
from rlflow.algorithms.aggregate import Aggregation
from rlflow.data.keys import (
    ADVANTAGES,
    ENTROPY,
    IS_WEIGHTS,
    LOG_PROBS,
    OLD_LOG_PROBS,
    OLD_VALUES,
    REF_LOG_PROBS,
    RESPONSE_MASK,
    RETURNS,
    VALUES,
)

# The terms of a loss as verl logs them: each call's share of its mini-batch's value, so they sum over micro-batches.
LOSS_TERMS = frozenset({"actor/pg_loss", "actor/kl_loss", "actor/entropy", "critic/vf_loss"})


@dataclass
class LossOutput:
    """The scalar to backpropagate, statistics named as verl logs them (python floats), and how they reduce.

    ``summed`` names the stats that are this call's share of its mini-batch's value (loss terms): over
    micro-batches they add up, as the losses do. Every other stat is a mean over this call's tokens, averaged
    over micro-batches. Default: the :data:`LOSS_TERMS` among ``stats``.
    """

    loss: Tensor
    stats: dict[str, float] = field(default_factory=dict)
    summed: frozenset[str] | None = None

    def __post_init__(self):
        summed = LOSS_TERMS & self.stats.keys() if self.summed is None else frozenset(self.summed)
        if summed - self.stats.keys():
            raise ValueError(f"LossOutput.summed names {sorted(summed - self.stats.keys())}, which are not in its "
                             f"stats {sorted(self.stats)}")
        self.summed = summed


def _require(module, batch: TensorDict) -> None:
    missing = [k for k in module.in_keys if k not in batch.keys()]
    if missing:
        raise KeyError(f"{type(module).__name__} needs batch key(s) {missing}; the batch has {sorted(batch.keys())}")


def _aggregation(loss, aggregation, num_tokens, num_seqs, where: str) -> Aggregation:
    # The loss's mode and norm_length on the caller's counts; the counts as loose keywords are the old contract.
    if aggregation is not None and not isinstance(aggregation, Aggregation):
        raise TypeError(f"{type(loss).__name__}.{where}(batch, aggregation): aggregation must be an "
                        f"rlflow.algorithms.aggregate.Aggregation, got {type(aggregation).__name__} "
                        "(pass counts as Aggregation(num_tokens=..., num_seqs=...))")
    if num_tokens is not None or num_seqs is not None:
        if aggregation is not None:
            raise TypeError(f"{type(loss).__name__}.{where}: pass the counts in the Aggregation or as "
                            "num_tokens/num_seqs, not both")
        warnings.warn(f"{type(loss).__name__}.{where}(batch, num_tokens=, num_seqs=) is deprecated: pass "
                      "Aggregation(num_tokens=..., num_seqs=...)", DeprecationWarning, stacklevel=3)
        aggregation = Aggregation(num_tokens=num_tokens, num_seqs=num_seqs)
    return (aggregation or Aggregation()).using(loss.agg, loss.loss_scale_factor)


@functools.cache
def _takes_aggregation(cls) -> bool:
    # Whether cls.pg_loss follows today's contract, pg_loss(batch, aggregation); read once per class, not per call.
    return "aggregation" in inspect.signature(cls.pg_loss).parameters


def _to_floats(stats: dict[str, Tensor | float]) -> dict[str, float]:
    # One device-to-host copy for all tensor stats instead of one sync per .item().
    names = [k for k, v in stats.items() if isinstance(v, Tensor)]
    dtype = torch.float32  # at least float32 (bf16 stats would lose digits); float64 stays float64
    for k in names:
        dtype = torch.promote_types(dtype, stats[k].dtype)
    values = torch.stack([stats[k].detach().reshape(()).to(dtype) for k in names]).tolist() if names else []
    out = {k: float(v) for k, v in stats.items() if not isinstance(v, Tensor)}
    out.update(zip(names, values))
    return {k: out[k] for k in stats}  # keep the caller's order


class PPOLoss:
    """Actor objective: ``agg(w * objective) - entropy_coef * agg(H) + kl_coef * agg(kl_penalty(logp, ref))``.

    ``objective(batch)`` is the per-token policy loss, the one method a variant overrides; the default is verl's
    "vanilla" dual-clip PPO (``functional.ppo_clip_objective``) with ``clip_low = clip_ratio_low or clip_ratio``
    and ``clip_high = clip_ratio_high or clip_ratio``; ``clip_ratio_c=None`` disables the dual clip. DAPO's
    clip-higher is ``clip_ratio_high=0.28``; Dr.GRPO is ``agg="seq-mean-token-sum-norm"``.

    ``agg`` is verl's ``loss_agg_mode``: the mode of the :class:`~rlflow.algorithms.aggregate.Aggregation` the
    three terms are reduced with (the Trainer's value brings the counts). ``loss_scale_factor`` (verl
    ``actor.loss_scale_factor``) is the constant that ``seq-mean-token-sum-norm`` divides by (``norm_length``) in
    the policy, entropy and KL terms; ``None`` divides by the batch's padded response length ``R``. Like verl, the
    other aggregation modes ignore it (rlflow: with a warning when the loss is built).

    ``is_weights=True`` multiplies the per-token policy loss by the batch's ``is_weights`` (``weigh``; truncated
    importance weights from ``rlflow.algorithms.correction.TruncatedIS``, verl ``rollout_correction.rollout_is``);
    it adds ``is_weights`` to ``in_keys``, so a chain without a ``TruncatedIS`` before the loss fails when the
    Trainer is built.
    """

    out_keys: tuple[str, ...] = ()

    def __init__(
        self,
        clip_ratio: float = 0.2,
        clip_ratio_low: float | None = None,
        clip_ratio_high: float | None = None,
        clip_ratio_c: float | None = 3.0,
        kl_coef: float = 0.0,
        kl_type: str = "low_var_kl",
        entropy_coef: float = 0.0,
        agg: str = "token-mean",
        is_weights: bool = False,
        loss_scale_factor: float | None = None,
    ):
        if clip_ratio_c is not None and clip_ratio_c <= 1:
            raise ValueError(f"clip_ratio_c must be > 1 for the dual clip, got {clip_ratio_c}")
        Aggregation(agg)  # an unknown mode fails now, naming the valid ones
        if loss_scale_factor is not None:
            if not loss_scale_factor > 0:
                raise ValueError(f"loss_scale_factor must be > 0, got {loss_scale_factor}")
            if agg != "seq-mean-token-sum-norm":
                warnings.warn(f"loss_scale_factor={loss_scale_factor} only applies to agg='seq-mean-token-sum-norm'; "
                              f"with agg={agg!r} it has no effect (as in verl)", stacklevel=2)
        F.kl_penalty(torch.zeros(1), torch.zeros(1), kl_type)  # fail now on an unknown kind, not mid-run
        self.clip_ratio = clip_ratio
        self.clip_ratio_low = clip_ratio_low
        self.clip_ratio_high = clip_ratio_high
        self.clip_ratio_c = clip_ratio_c
        self.kl_coef = kl_coef
        self.kl_type = kl_type
        self.entropy_coef = entropy_coef
        self.agg = agg
        self.is_weights = is_weights
        self.loss_scale_factor = loss_scale_factor
        self.clip_low = clip_ratio if clip_ratio_low is None else clip_ratio_low
        self.clip_high = clip_ratio if clip_ratio_high is None else clip_ratio_high

    @property
    def in_keys(self) -> tuple[str, ...]:
        keys = (LOG_PROBS, OLD_LOG_PROBS, ADVANTAGES, RESPONSE_MASK)
        if self.kl_coef > 0:
            keys += (REF_LOG_PROBS,)
        if self.entropy_coef != 0:
            keys += (ENTROPY,)
        if self.is_weights:
            keys += (IS_WEIGHTS,)
        return keys

    def objective(self, batch: TensorDict) -> tuple[Tensor, dict[str, Tensor]]:
        """The per-token policy loss [B, R] (before IS weights and aggregation) and its stats (names without the
        "actor/" prefix). A variant overrides this one method."""
        return F.ppo_clip_objective(batch[LOG_PROBS], batch[OLD_LOG_PROBS], batch[ADVANTAGES], batch[RESPONSE_MASK],
                                    self.clip_low, self.clip_high, self.clip_ratio_c)

    def weigh(self, per_token: Tensor, weights: Tensor, mask: Tensor) -> Tensor:
        """How ``is_weights`` [B, R] enter the per-token loss: multiplied, after clipping (verl
        ``rollout_is_weights``). GMPO overrides it."""
        return per_token * weights

    def pg_loss(self, batch: TensorDict, aggregation: Aggregation | None = None, *,
                num_tokens=None, num_seqs=None) -> tuple[Tensor, dict[str, Tensor]]:
        """The policy-gradient term: ``objective``, weighted by ``is_weights`` (``is_weights=True``), aggregated."""
        agg = _aggregation(self, aggregation, num_tokens, num_seqs, "pg_loss")
        per_token, stats = self.objective(batch)
        if self.is_weights:
            per_token = self.weigh(per_token, batch[IS_WEIGHTS], batch[RESPONSE_MASK])
        return agg(per_token, batch[RESPONSE_MASK]), stats

    def __call__(self, batch: TensorDict, aggregation: Aggregation | None = None, *,
                 num_tokens=None, num_seqs=None) -> LossOutput:
        _require(self, batch)
        agg = _aggregation(self, aggregation, num_tokens, num_seqs, "__call__")
        if _takes_aggregation(type(self)):  # pg_loss(batch, aggregation)
            pg, pg_stats = self.pg_loss(batch, agg)
        else:  # a subclass written for the earlier contract: pg_loss(batch, num_tokens, num_seqs) -> (loss, stats)
            warnings.warn(f"{type(self).__name__} overrides pg_loss(batch, num_tokens, num_seqs), which is deprecated: "
                          "override objective(batch) -> (per-token loss, stats); PPOLoss weighs and aggregates it",
                          DeprecationWarning, stacklevel=2)
            pg, pg_stats = self.pg_loss(batch, num_tokens=agg.num_tokens, num_seqs=agg.num_seqs)
        mask = batch[RESPONSE_MASK]
        total = pg
        stats: dict[str, Tensor | float] = {"actor/pg_loss": pg.detach()}
        stats.update({f"actor/{k}": v for k, v in pg_stats.items()})
        if ENTROPY in batch.keys():  # logged whenever present; differentiated only with a coefficient
            entropy = batch[ENTROPY]
            entropy_term = agg(entropy if self.entropy_coef != 0 else entropy.detach(), mask)
            if self.entropy_coef != 0:
                total = total - self.entropy_coef * entropy_term
            stats["actor/entropy"] = entropy_term.detach()
        if self.kl_coef > 0:
            kl = agg(F.kl_penalty(batch[LOG_PROBS], batch[REF_LOG_PROBS], self.kl_type), mask)
            total = total + self.kl_coef * kl
            stats["actor/kl_loss"] = kl.detach()
            stats["actor/kl_coef"] = self.kl_coef
        floats = _to_floats(stats)
        return LossOutput(total, floats, LOSS_TERMS & floats.keys())

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if k not in ("clip_low", "clip_high"))
        return f"{type(self).__name__}({args})"


class ValueLoss:
    """Critic objective (verl ``compute_value_loss``): ``0.5 * agg(max((v-R)^2, (clip(v, V_old +- c)-R)^2))``."""

    in_keys: tuple[str, ...] = (VALUES, OLD_VALUES, RETURNS, RESPONSE_MASK)
    out_keys: tuple[str, ...] = ()

    def __init__(self, clip_range: float | None = 0.5, agg: str = "token-mean", loss_scale_factor: float | None = None):
        Aggregation(agg)  # an unknown mode fails now, naming the valid ones
        if loss_scale_factor is not None and loss_scale_factor <= 0:
            raise ValueError(f"loss_scale_factor must be > 0, got {loss_scale_factor}")
        self.clip_range = clip_range
        self.agg = agg
        self.loss_scale_factor = loss_scale_factor  # seq-mean-token-sum-norm's divisor (default: the response length)

    def __call__(self, batch: TensorDict, aggregation: Aggregation | None = None, *,
                 num_tokens=None, num_seqs=None) -> LossOutput:
        _require(self, batch)
        agg = _aggregation(self, aggregation, num_tokens, num_seqs, "__call__")
        values, mask = batch[VALUES], batch[RESPONSE_MASK]
        per_token, stats = F.value_objective(values, batch[OLD_VALUES], batch[RETURNS], mask, self.clip_range)
        loss = agg(per_token, mask)
        floats = _to_floats({"critic/vf_loss": loss.detach(), "critic/vf_clipfrac": stats["vf_clipfrac"],
                             "critic/vpred_mean": F.masked_mean(values.detach(), mask)})
        return LossOutput(loss, floats, frozenset({"critic/vf_loss"}))

    def __repr__(self) -> str:
        scale = f", loss_scale_factor={self.loss_scale_factor!r}" if self.loss_scale_factor is not None else ""
        return f"ValueLoss(clip_range={self.clip_range!r}, agg={self.agg!r}{scale})"
