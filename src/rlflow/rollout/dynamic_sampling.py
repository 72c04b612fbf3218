"""DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476; verl ``algorithm.filter_groups``).

Groups whose samples all get the same metric (all right or all wrong) have zero group-relative
advantage and only dilute the batch. The filtering is the experience stream's ``FilterGroups`` stage
(``rlflow.rollout.stream``): ``Trainer(rollout=..., reward=..., stages=[FilterGroups(metric, max_gen_batches)])``,
which draws further prompt batches from the stream itself. ``DynamicSampling`` is the older form, a
rollout that scores its samples (kept for code that calls it by hand; the Trainer takes it apart into
rollout, reward and the stage, with a ``DeprecationWarning``); it lives beside the stage in the stream's
module (``rlflow.rollout.DynamicSampling``). This module keeps the helpers both use.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rlflow import roles
from rlflow.data import keys as K

_COUNTS = ("reward/errors", "reward/timeouts", "reward/non_finite")


def informative_rows(metric: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Rows of the groups whose ``metric`` is not constant, or that have one sample (verl keeps those).

    metric, group: [B]. Returns (bool [B] rows to keep, number of kept groups, number of groups).
    """
    ids, inverse = torch.unique(group, return_inverse=True)
    m = metric.to(torch.float64)
    hi = torch.full((ids.numel(),), -torch.inf, dtype=m.dtype, device=m.device).scatter_reduce(0, inverse, m, "amax")
    lo = torch.full((ids.numel(),), torch.inf, dtype=m.dtype, device=m.device).scatter_reduce(0, inverse, m, "amin")
    keep = (hi > lo) | (torch.bincount(inverse, minlength=ids.numel()) == 1)
    return keep[inverse], int(keep.sum()), ids.numel()


def first_groups(batch: TensorDict, count: int) -> TensorDict:
    """The rows of the first ``count`` groups (in order of appearance), with ``group`` renumbered ``0..count-1``.

    The rows of a group must be contiguous, and neighbouring groups must have different ids.
    """
    group = batch[K.GROUP]
    starts = torch.ones_like(group, dtype=torch.bool)
    starts[1:] = group[1:] != group[:-1]
    ordinal = starts.long().cumsum(0) - 1
    out = batch[ordinal < count]
    out.set(K.GROUP, ordinal[ordinal < count])
    return out


def group_metric(batch: TensorDict, metric: str, reward) -> torch.Tensor:
    """The [B] per-sample values of ``metric`` that must differ within a group for it to be kept: ``"score"``,
    ``"seq_reward"`` or a complete column of ``reward.extras`` (of the call that scored ``batch``)."""
    if metric == "score":
        return batch[K.SCORES]
    if metric == "seq_reward":
        return batch[K.TOKEN_REWARDS].sum(-1)
    column = roles.optional(reward, roles.Reward, "extras").get(metric)
    if column is None or any(v is None for v in column):
        raise KeyError(f"DynamicSampling metric {metric!r}: not 'score' or 'seq_reward', and "
                       f"{type(reward).__name__}.extras has no complete column of that name "
                       f"(columns: {sorted(roles.optional(reward, roles.Reward, 'extras'))})")
    return torch.tensor([float(v) for v in column], device=batch[K.SCORES].device)


def merge_stats(stats: list[dict[str, float]]) -> dict[str, float]:
    """The reward's stats over the rounds: error counts add up, everything else is averaged."""
    out = {}
    for key in dict.fromkeys(k for s in stats for k in s):
        values = [s[key] for s in stats if key in s]
        out[key] = sum(values) if key in _COUNTS else sum(values) / len(values)
    return out
