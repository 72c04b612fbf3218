"""The prompt groups of a :class:`~rlflow.rollout.fully_async.FullyAsyncRollout` from drawn to taken: the queue drawn
from the prompts, admission paced by the staleness bound, the complete groups taken for each step (dropped or
waited for when too old) and the step's off-policy metrics; and a group's prompt row as plain values for a
checkpoint. :mod:`rlflow.rollout.fully_async` has the engine, its driver thread and the weights; its module
docstring explains the pacing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from rlflow.data import keys as K
from rlflow.data.nontensor import per_row, stack
from rlflow.rollout.agent.trajectory import summarize
from rlflow.rollout.chunks import Sample
from rlflow.rollout.engines.process import EngineProcessError
from rlflow.rollout.group_sampler import choose_groups
from rlflow.rollout.single_turn import unpadded


@dataclass
class Group:
    """One prompt's ``n`` samples (an agent loop's: its conversations, from admission on), the row it came in
    (``[1]``), and the trainer's version when it was admitted."""

    seq: int
    row: TensorDict
    samples: list
    admitted: int = -1

    @property
    def done(self) -> bool:
        return all(s.finish is not None for s in self.samples)


class GroupPacing:
    """The groups' queues and their pacing, for :class:`~rlflow.rollout.fully_async.FullyAsyncRollout` (whose
    ``__init__`` sets the state these methods share with its driver thread, under ``_cond``: ``_queue`` drawn,
    ``_active`` admitted, ``_ready`` complete, and the version, bound and batch size they are paced by)."""

    def want(self, groups: int) -> None:
        """The next batch the stream yields holds ``groups`` complete groups (once), taken for the same step as the
        last one: dynamic sampling (``FilterGroups``) replaces the groups it filtered by the next ones to finish,
        one for one. ``stats`` then describe every group taken for the step."""
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise ValueError(f"want(groups): an integer >= 1, got {groups!r}")
        with self._cond:
            self._want = groups

    def _draw(self, prompts, ended: bool) -> bool:
        """Keep the queue holding what the driver may admit while the trainer learns; returns whether it ended."""
        while not ended:
            with self._cond:
                if self.batch_size is not None and len(self._queue) >= self._limit():
                    return False
            batch = next(prompts, None)
            if batch is None:
                return True
            with self._cond:
                self.batch_size = self.batch_size or batch.batch_size[0]
                self._queue.extend(self._group(batch[i:i + 1]) for i in range(batch.batch_size[0]))
                self._cond.notify_all()
        return ended

    def _take(self, ended: bool) -> list[Group] | None:
        """Wait for ``batch_size`` complete groups, oldest first (dropping or waiting for stale ones). ``[]``: the
        queue needs prompts drawn first (a dropped group's replacement); ``None``: the prompts ended."""
        start, topup = time.perf_counter(), self._want is not None
        with self._cond:
            B = self._want or self.batch_size
            if self._learning:  # asked again with no push since the last batch: the next trains on this version too
                self._learning = False
                self._cond.notify_all()
            while True:
                if self._error is not None:
                    raise EngineProcessError(f"the fully asynchronous rollout's generation failed: "
                                             f"{self._error!r}") from self._error
                if self.threshold is not None and self.strategy == "drop":
                    stale = [g for g in self._ready if self._age(g) > self.threshold]
                    if stale:  # verl evicts them and refills one prompt each: the queue hands on the next ones
                        self._ready = [g for g in self._ready if g not in stale]
                        self._dropped += len(stale)
                        self._cond.notify_all()
                if B is None:
                    return None
                if not ended and len(self._queue) < self._limit():
                    return []
                waiting = self.threshold is not None and self.strategy == "wait" and any(
                    self._age(g) >= self.threshold for g in self._active)
                if len(self._ready) >= B and not waiting:
                    break
                if ended and len(self._ready) + len(self._active) + len(self._queue) < B:
                    return None
                if not self._cond.wait(timeout=self.timeout) and self._error is None:
                    raise EngineProcessError(f"FullyAsyncRollout: no group completed within {self.timeout:.0f} s "
                                             "(timeout)")
            self._ready.sort(key=lambda g: g.seq)
            chosen = set(choose_groups(self.sampler, self._ready, B, self.version, self.threshold))
            groups = [g for i, g in enumerate(self._ready) if i in chosen]
            self._ready = [g for i, g in enumerate(self._ready) if i not in chosen]
            self._learning = True  # until the next sync_weights: admission leaves room for the version it brings
            in_flight, dropped, self._dropped, self._want = len(self._active), self._dropped, 0, None
        self._record(groups, time.perf_counter() - start, dropped, in_flight, topup)
        return groups

    def _age(self, group: Group) -> int:
        """verl's span from admission to training: ``t - a + 1`` at the trainer's current version ``t``."""
        return self.version - group.admitted + 1

    def _limit(self) -> int:
        """The most groups admitted and not yet taken: the batch waited for and the warm-up batches ahead."""
        B = self.batch_size
        ahead = B + int(B * self.num_warmup_batches)
        return ahead if self.threshold is None else min(ahead, B * self.threshold)

    def _room(self) -> int:
        """Groups the driver may admit now (with the lock held): pacing, so that taken in order none is too old."""
        bound = self._limit()
        if self.threshold is not None:  # while the trainer learns, the next batch is trained one version later;
            taking = 0 if self._learning else (self._want or self.batch_size)  # a top-up takes its k groups only
            bound = min(bound, self.batch_size * (self.threshold - 1) + taking)
        return bound - len(self._active) - len(self._ready)

    def _record(self, groups: list[Group], waited: float, dropped: int, in_flight: int, topup: bool) -> None:
        """verl's off-policy metrics over the batch's responses, and rlflow's ``async/*`` (a top-up: over every
        group taken for the step, the waits and drops added up)."""
        if topup:
            groups = self._step + groups
            waited += self.stats.get("timing_s/gen_wait", 0.0)
            dropped += int(self.stats.get("async/dropped_groups", 0))
        self._step = groups
        samples = [s for g in groups for s in g.samples]
        oldest, newest = torch.tensor([self._oldest_newest(s) for s in samples], dtype=torch.float).T
        spans, staleness, worst = newest - oldest + 1, self.version - newest, self.version - oldest
        stats = {}
        for name, values in (("trajectory_spans", spans), ("trajectory_staleness", staleness),
                             ("trajectory_staleness_worst", worst)):
            stats |= {f"training/off_policy/{name}/{how}": float(getattr(values, how)())
                      for how in ("mean", "max", "min")}
        self.stats = dict(self.engine.stats) | stats | {
            "async/staleness_mean": float(worst.mean()), "async/staleness_max": float(worst.max()),
            "async/partial_frac": float((spans > 1).float().mean()), "async/dropped_groups": float(dropped),
            "async/in_flight_groups": float(in_flight), "async/policy_version": float(self.version),
            "timing_s/gen_wait": waited,
        } | (summarize(samples) if self.agent is not None else {})

    def _oldest_newest(self, sample) -> tuple[int, int]:
        """The oldest and newest versions among a sample's sampled tokens (tool tokens carry -1)."""
        sampled = [v for v in sample.versions if v >= 0] or [self.version]
        return min(sampled), max(sampled)

    def _group(self, row: TensorDict) -> Group:
        self._seq += 1
        if self.agent is not None:  # its conversations start when it is admitted
            return Group(self._seq, row, [])
        prompt = unpadded(row[K.PROMPT_IDS].cpu(), row[K.PROMPT_MASK].cpu())[0]
        return Group(self._seq, row, [Sample(list(prompt)) for _ in range(self.rollout.n)])

    def _clear(self) -> None:
        with self._cond:
            self._queue.clear()
            self._active.clear()
            self._ready.clear()
            self._weights, self._learning, self._dropped, self._error = None, False, 0, None
            self._want, self._step = None, []

    def _admit(self) -> list[Group]:
        """Admit queued groups one at a time, as the pacing allows, at the trainer's version (the lock held)."""
        admitted = []
        while self._queue and self._room() > 0:
            group = self._queue.popleft()
            group.admitted = self.version
            self._active.append(group)
            admitted.append(group)
        return admitted

    def _hand_over_finished(self, done: list[Group] | None = None) -> None:
        """Move the groups whose samples have all finished (or ``done``) from in flight to ready, waking the
        trainer."""
        with self._cond:
            done = [g for g in self._active if g.done] if done is None else done
            if done:
                handed = {g.seq for g in done}
                self._active = [g for g in self._active if g.seq not in handed]
                self._ready += done
                self._cond.notify_all()


def plain_row(row: TensorDict) -> dict:
    """A ``[1]`` prompt row as tensors and plain values (a checkpoint loads with ``weights_only=True``)."""
    out = {"tensors": {}, "values": {}}
    for key in row.keys():
        value = row.get(key)
        if isinstance(value, torch.Tensor):
            out["tensors"][key] = value.detach().cpu().clone()
        else:
            out["values"][key] = per_row(row, key)[0]
    return out


def row_from_plain(plain: dict) -> TensorDict:
    row = TensorDict(dict(plain["tensors"]), batch_size=[1])
    for key, value in plain["values"].items():
        row.set(key, stack([value]))
    return row
