"""DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476; verl ``algorithm.filter_groups``).

Groups whose samples all get the same metric (all right or all wrong) have zero group-relative
advantage and only dilute the batch. :class:`DynamicSampling` generates and scores, drops those
groups, and pulls further prompt batches until ``batch_size`` prompts' groups remain.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rlflow.data import keys as K
from rlflow.rollout.wrapper import RolloutWrapper, cat_batches

_COUNTS = ("reward/errors", "reward/timeouts", "reward/non_finite")


class DynamicSampling(RolloutWrapper):
    """Rollout + reward with group filtering; use it in the Trainer's rollout slot with ``reward=None``.

    On a batch of ``P`` prompts: roll out (``n`` samples each) and score; keep the groups whose
    ``metric`` is not identical across their samples (a single-sample group is kept, as in verl);
    while fewer than ``P`` groups are kept, take the next prompt batch from the loader given to
    :meth:`bind_prompts` (the Trainer does it in ``fit``) and repeat. The first ``P`` kept groups are
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
        if self.metric == "score":
            return batch[K.SCORES]
        if self.metric == "seq_reward":
            return batch[K.TOKEN_REWARDS].sum(-1)
        column = getattr(self.reward, "extras", {}).get(self.metric)
        if column is None or any(v is None for v in column):
            raise KeyError(f"DynamicSampling metric {self.metric!r}: not 'score' or 'seq_reward', and "
                           f"{type(self.reward).__name__}.extras has no complete column of that name "
                           f"(columns: {sorted(getattr(self.reward, 'extras', {}))})")
        return torch.tensor([float(v) for v in column], device=batch[K.SCORES].device)

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
        target = prompts.batch_size[0]
        kept, n_kept, n_groups, offset, scores, reward_stats = [], 0, 0, 0, [], []
        for round_ in range(1, self.max_gen_batches + 1):
            if round_ > 1:
                prompts = self._next_prompts(prompts)
            samples = self.reward(self.rollout(prompts))
            reward_stats.append(dict(getattr(self.reward, "stats", {})))
            scores.append(samples[K.SCORES])
            samples.set(K.GROUP, samples[K.GROUP] + offset)  # ids unique across rounds
            offset = int(samples[K.GROUP].max()) + 1
            rows, kept_groups, groups = informative_rows(self.group_metric(samples), samples[K.GROUP])
            kept.append(samples[rows])
            n_kept, n_groups = n_kept + kept_groups, n_groups + groups
            if n_kept >= target:
                break
        else:
            raise RuntimeError(
                f"DynamicSampling: {self.max_gen_batches} generation batches (max_gen_batches) gave only {n_kept} "
                f"prompt groups with a non-constant {self.metric!r} out of {n_groups} generated; {target} are needed. "
                "Most prompts are solved by every sample or by none: raise max_gen_batches, change n, or the data")
        batch = first_groups(cat_batches(kept, self.tokenizer.pad_token_id), target)
        self.stats = _merge(reward_stats) | dict(getattr(self.rollout, "stats", {})) | {  # an AgentLoop's: last round
            "dapo/num_gen_batches": float(round_),
            "dapo/kept_group_frac": n_kept / n_groups,
            "dapo/gen_score_mean": float(torch.cat(scores).float().mean()),
        }
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


def _merge(stats: list[dict[str, float]]) -> dict[str, float]:
    """The reward's stats over the rounds: error counts add up, everything else is averaged."""
    out = {}
    for key in dict.fromkeys(k for s in stats for k in s):
        values = [s[key] for s in stats if key in s]
        out[key] = sum(values) if key in _COUNTS else sum(values) / len(values)
    return out
