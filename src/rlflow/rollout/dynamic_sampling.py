"""DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476; verl ``algorithm.filter_groups``).

Groups whose samples all get the same metric (all right or all wrong) have zero group-relative
advantage and only dilute the batch. The filtering is the experience stream's ``FilterGroups`` stage
(``rlflow.rollout.stream``): ``Trainer(rollout=..., reward=..., stages=[FilterGroups(metric, max_gen_batches)])``,
which draws further prompt batches from the stream itself. :class:`DynamicSampling` is the older form, a
rollout that scores its samples (kept for code that calls it by hand; the Trainer takes it apart into
rollout, reward and the stage, with a ``DeprecationWarning``). This module keeps the shared helpers.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rlflow import roles
from rlflow.data import keys as K
from rlflow.rollout.wrapper import RolloutWrapper, cat_batches

_COUNTS = ("reward/errors", "reward/timeouts", "reward/non_finite")


class DynamicSampling(RolloutWrapper):
    """Rollout + reward with group filtering, one call per step (deprecated in the Trainer: use the
    ``FilterGroups`` stage; ``Trainer(rollout=DynamicSampling(...), reward=None)`` still runs, as that stage).

    On a batch of ``P`` prompts: roll out (``n`` samples each) and score; keep the groups whose
    ``metric`` is not identical across their samples (a single-sample group is kept, as in verl);
    while fewer than ``P`` groups are kept, take the next prompt batch from the loader given to
    :meth:`bind_prompts` and repeat. The first ``P`` kept groups are
    returned, in order, with ``group`` renumbered ``0..P-1``; the rows stay contiguous per group.

    Args:
        rollout: the sampler (e.g. ``HFRollout(n=16)``).
        reward: scores the samples (e.g. ``OverlongPenalty(FunctionReward(...), ...)``).
        metric: ``"score"`` (the ``scores`` key), ``"seq_reward"`` (``token_rewards`` summed) or the name of
            a column of ``reward.extras`` (e.g. ``"acc"``, verl's usual choice).
        max_gen_batches: generation rounds allowed per step (verl ``max_num_gen_batches``); reaching it
            without enough groups raises ``RuntimeError``.

    ``stats``: ``dapo/num_gen_batches``, ``dapo/kept_group_frac`` (kept / generated groups, before the
    cut to ``P``), ``dapo/gen_score_mean`` (mean score over every generated sample: the unfiltered
    batch reward, since the kept batch's ``critic/score/mean`` is biased towards 0.5), and the reward's
    own stats (error counts summed over rounds).

    Several processes: each rank filters its own shard of every prompt batch it pulls (the loader is
    drawn identically on every rank) and may need a different number of rounds.
    """

    def __init__(self, rollout, reward, metric: str = "score", max_gen_batches: int = 10):
        if max_gen_batches < 1:
            raise ValueError(f"max_gen_batches must be >= 1, got {max_gen_batches}")
        super().__init__(rollout)
        self.reward, self.metric, self.max_gen_batches = reward, metric, max_gen_batches
        self.in_keys = tuple(rollout.in_keys)
        self.out_keys = tuple(dict.fromkeys(tuple(rollout.out_keys) + tuple(reward.out_keys)))
        self.loader = None
        self.stats: dict[str, float] = {}

    def bind_prompts(self, loader) -> None:
        """Where further prompt batches come from: an iterator of prompt batches (``next(loader)``)."""
        self.loader = loader

    def group_metric(self, batch: TensorDict) -> torch.Tensor:
        """The [B] per-sample values that must differ within a group for it to be kept."""
        return group_metric(batch, self.metric, self.reward)

    def _next_prompts(self, like: TensorDict) -> TensorDict:
        if self.loader is None:
            raise RuntimeError("DynamicSampling needs more prompts than one batch: call bind_prompts(loader) "
                               "(Trainer.fit does) before using it outside the Trainer")
        batch = next(self.loader)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
            per = batch.batch_size[0] // world
            batch = batch[rank * per : (rank + 1) * per]
        return batch.to(like[K.PROMPT_IDS].device)

    def forward(self, prompts: TensorDict) -> TensorDict:
        """The stream's ``FilterGroups`` stage over this batch, then the loader's (see the class docstring)."""
        import contextlib
        import itertools

        from rlflow.rollout.stream import Experience, FilterGroups

        experience = Experience(self.rollout, self.reward, [FilterGroups(self.metric, self.max_gen_batches)])
        more = (self._next_prompts(prompts) for _ in itertools.count())
        with contextlib.closing(experience(itertools.chain([prompts], more))) as stream:
            batch = next(stream)
        self.stats = {k: v for k, v in experience.metrics.items() if not k.startswith("timing_s/")}
        return batch

    def __repr__(self) -> str:
        return (f"DynamicSampling({self.rollout!r}, {self.reward!r}, metric={self.metric!r}, "
                f"max_gen_batches={self.max_gen_batches})")


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
