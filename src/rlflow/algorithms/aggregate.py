"""How a share of the batch becomes the whole: loss aggregation and whole-batch sums, passed as values.

Two things make a (micro-)batch's numbers those of the whole batch, and both travel as explicit values, never
as ambient state:

- :class:`Aggregation`: how a per-token loss [B, R] becomes the scalar to backpropagate. The Trainer builds one
  per mini-batch with the mini-batch's counts (``num_tokens``, ``num_seqs``) and the number of processes
  (``dp_size``) and passes it once to the loss; the loss fills in its own ``mode`` and ``norm_length``
  (:meth:`Aggregation.using`). With it, the micro-batch losses sum to the mini-batch loss on 1 or N processes.
- :class:`WholeBatch`: a module whose statistics span the batch (whitening, GPG's ``alpha``, the adaptive KL's
  mean, Clip-Cov's covariance) holds ``sum_fn``, a sum over the processes that each hold a share of the batch.
  The Trainer sets it once when it is built (:func:`share_batch_sum`); the pure functions take it as an argument
  (``functional.masked_whiten(x, mask, sum_fn=...)``).
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from rlflow.algorithms import functional as F
from rlflow.module import BatchModule

AGG_MODES = F.AGG_MODES


@dataclass(frozen=True)
class Aggregation:
    """One value for everything that turns a per-token loss into a scalar (``functional.agg_loss``'s arguments).

    Args:
        mode: verl's ``loss_agg_mode`` (one of :data:`AGG_MODES`); ``None``: the loss's own (``PPOLoss(agg=...)``),
            ``token-mean`` for a bare call.
        num_tokens, num_seqs: the whole mini-batch's valid tokens / sequences with a valid token, divided by the
            number of processes whose gradients are averaged (``None``: the call's own counts).
        dp_size: processes whose gradients are averaged; ``token-sum`` multiplies by it (verl's ``dp_size``).
        norm_length: ``seq-mean-token-sum-norm``'s divisor (verl ``loss_scale_factor``; ``None``: ``R``).

    ``Aggregation(num_tokens=n)(loss_mat, mask)`` is the scalar.
    """

    mode: str | None = None
    num_tokens: float | Tensor | None = None
    num_seqs: float | Tensor | None = None
    dp_size: int = 1
    norm_length: float | None = None

    def __post_init__(self):
        if self.mode is not None and self.mode not in AGG_MODES:
            raise ValueError(f"unknown loss aggregation mode {self.mode!r}; valid modes: {list(AGG_MODES)}")
        if not (isinstance(self.dp_size, int) and self.dp_size >= 1):
            raise ValueError(f"Aggregation dp_size must be an int >= 1, got {self.dp_size!r}")

    def using(self, mode: str, norm_length: float | None = None) -> Aggregation:
        """This aggregation with a loss's ``mode`` and ``norm_length`` (the Trainer's value carries neither).

        Raises ``ValueError`` if this value already names another mode: the loss was built for its own."""
        if self.mode is not None and self.mode != mode:
            raise ValueError(f"the Aggregation passed has mode={self.mode!r}, but the loss aggregates with {mode!r}; "
                             "leave Aggregation.mode None and set the loss's agg")
        return dataclasses.replace(self, mode=mode, norm_length=norm_length)

    def __call__(self, loss_mat: Tensor, mask: Tensor) -> Tensor:
        """The scalar of a per-token loss [B, R] over mask [B, R] (``functional.agg_loss``)."""
        return F.agg_loss(loss_mat, mask, self.mode or "token-mean", self.num_tokens, self.num_seqs,
                          self.norm_length, self.dp_size)


def call_loss(loss, batch, aggregation: Aggregation):
    """``loss(batch, aggregation)`` -> ``LossOutput``, as the Trainer calls every loss.

    A loss written for the earlier contract, ``loss(batch, num_tokens=..., num_seqs=...)`` (no ``aggregation``
    parameter), gets the counts, with a ``DeprecationWarning`` (and no ``dp_size``: its ``token-sum`` is this
    process's sum)."""
    if "aggregation" in inspect.signature(loss).parameters:
        return loss(batch, aggregation)
    warnings.warn(f"{type(loss).__name__}.__call__(batch, num_tokens, num_seqs) is deprecated: take "
                  "(batch, aggregation: rlflow.algorithms.aggregate.Aggregation) and reduce with aggregation(loss_mat, "
                  "mask), or subclass PPOLoss and override objective(batch)", DeprecationWarning, stacklevel=2)
    return loss(batch, num_tokens=aggregation.num_tokens, num_seqs=aggregation.num_seqs)


class WholeBatch:
    """Mixin of a module with whole-batch statistics.

    ``sum_fn`` sums a tensor over the processes that each hold a share of the batch, so a statistic of
    the whole batch is the same on 1 or N processes; ``None`` (the default): this process's batch is the
    whole batch. Subclasses pass ``self.sum_fn`` to the functional core (``sum_fn=self.sum_fn``).
    """

    sum_fn: Callable[[Tensor], Tensor] | None = None


def share_batch_sum(sum_fn: Callable[[Tensor], Tensor] | None, *roles) -> None:
    """Set ``sum_fn`` on every :class:`WholeBatch` module reachable from ``roles``: the roles themselves and
    the modules they hold (the members of a ``Chain``, a loss's ``CovSelection``), through instance attributes
    and lists or tuples of them. The Trainer calls it once, with its sum over the data-parallel processes."""
    seen: set[int] = set()
    todo = list(roles)
    while todo:
        obj = todo.pop()
        if id(obj) in seen or not isinstance(obj, (BatchModule, WholeBatch, list, tuple)):
            continue
        seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            todo += list(obj)
            continue
        if isinstance(obj, WholeBatch):
            obj.sum_fn = sum_fn
        todo += [v for v in vars(obj).values() if isinstance(v, (BatchModule, WholeBatch, list, tuple))]
