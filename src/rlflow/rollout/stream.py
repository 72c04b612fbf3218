"""The experience stream: prompt batches in, scored batches out, with stages composed over the stream.

``Trainer.fit`` owns the iteration: it hands :class:`Experience` the prompt batches (a
:class:`PromptStream` over the loader) and learns from what comes out::

    for batch in experience(prompts):       # generate -> sample stages -> reward -> scored stages
        trainer.learn(batch)                # reference / old log-probs / values -> estimator -> updates

A stage (:mod:`rlflow.rollout.stages`; importable from here too) is one of three kinds, by where it runs
(``where``):

- ``"engine"``: :class:`Prefetch` runs the rollout's engine beside the trainer (``AsyncRollout``). It reads
  the upcoming batches from the prompt stream itself, so it knows them: nothing is guessed or copied.
- ``"samples"``: ``stage(prompts, samples) -> samples`` on every generated batch, before the reward
  (:class:`ReferenceResponses`: SPIN's real responses, scored like the samples).
- ``"scored"``: ``stage.stream(batches, experience)`` transforms the stream of scored batches: it may pull
  more of them (:class:`FilterGroups`: DAPO's dynamic sampling draws further prompt batches from the same
  stream) or map each one (any ``BatchModule``, e.g. ReMax's ``GreedyBaseline``).

Each part is timed under its own name for the batch it produced: ``timing_s/gen`` (the rollout; with
prefetch, the wait for it), ``timing_s/reward``, and ``timing_s/<stage.name>`` for every stage (its own
time, without the generation and scoring it pulled), e.g. ``timing_s/dynamic_sampling``,
``timing_s/greedy_baseline``, ``timing_s/reference_responses``. ``metrics`` holds them with the rollout's,
the reward's (summed or averaged over the scoring rounds of the batch) and the stages' ``stats``.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import warnings
from collections import defaultdict, deque
from collections.abc import Iterable, Iterator

import torch
from tensordict import TensorDict

from rlflow.data import keys as K
from rlflow.data.nontensor import to_device
from rlflow.phases import phase
from rlflow.rewards.base import rewards_in
from rlflow.roles import Reward, Rollout, optional
from rlflow.rollout.async_rollout import AsyncRollout
from rlflow.rollout.dynamic_sampling import group_metric, merge_stats
from rlflow.rollout.fully_async import FullyAsyncRollout
from rlflow.rollout.ranks import group_shares, lead, ranks, received
from rlflow.rollout.reference_responses import WithReferenceResponses
from rlflow.rollout.stages import WHERE, FilterGroups, ModuleStage, Prefetch, ReferenceResponses, Stage
from rlflow.rollout.wrapper import RolloutWrapper


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
        experience = Experience(self.rollout, self.reward, [FilterGroups(self.metric, self.max_gen_batches)])
        more = (self._next_prompts(prompts) for _ in itertools.count())
        with contextlib.closing(experience(itertools.chain([prompts], more))) as stream:
            batch = next(stream)
        self.stats = {k: v for k, v in experience.metrics.items() if not k.startswith("timing_s/")}
        return batch

    def __repr__(self) -> str:
        return (f"DynamicSampling({self.rollout!r}, {self.reward!r}, metric={self.metric!r}, "
                f"max_gen_batches={self.max_gen_batches})")


class Experience:
    """Scored batches from prompt batches: ``Experience(rollout, reward, stages=[...])``.

    ``experience(prompts)`` is an iterator over scored batches (``prompts``: an iterator of prompt batches);
    ``experience.collect(prompts)`` scores one batch (a stage that needs more, such as ``FilterGroups``,
    raises when one batch is not enough). ``metrics`` holds the last batch's timings and stats, ``elapsed``
    the seconds it took to produce. ``rollout`` is the rollout that generates (with :class:`Prefetch`, the
    ``AsyncRollout`` around the one given): the Trainer binds it and pushes weights to it.
    """

    def __init__(self, rollout, reward, stages: Iterable = ()):
        if reward is None:
            raise ValueError("Experience needs a reward: it scores every generated batch (DynamicSampling's "
                             "filtering is the FilterGroups stage now, over the scored stream)")
        self.stages = [s if isinstance(s, Stage) else ModuleStage(s) for s in stages]
        bad = [s for s in self.stages if s.where not in WHERE]
        if bad:
            raise ValueError(f"stage {bad[0]!r}: where={bad[0].where!r}, expected one of {WHERE}")
        engine = [s for s in self.stages if s.where == "engine"]
        if len(engine) > 1:
            raise ValueError(f"one engine stage at most (Prefetch), got {engine}")
        self.rollout = engine[0].wrap(rollout) if engine else rollout
        self.reward = reward
        self.precision = contextlib.nullcontext  # the Trainer's autocast for sampling with the trained module
        self.metrics: dict[str, float] = {}
        self.elapsed = 0.0
        for stage in self.stages:
            stage.bind(self)

    @classmethod
    def of(cls, rollout, reward, stages: Iterable = (), experience: "Experience | None" = None) -> "Experience":
        """The Trainer's experience: ``experience``, or one made of ``rollout``, ``reward`` and ``stages``. The
        older form ``rollout=DynamicSampling(rollout, reward, ...)``, ``reward=None`` is taken apart into its
        rollout, its reward and a ``FilterGroups`` stage (with a ``DeprecationWarning``)."""
        stages = list(stages)
        if experience is not None:
            if rollout is not None or reward is not None or stages:
                raise ValueError("pass experience=Experience(rollout, reward, stages) or rollout, reward and stages, "
                                 "not both")
            return experience
        if isinstance(rollout, DynamicSampling):
            if reward is not None:
                raise ValueError("rollout=DynamicSampling(rollout, reward) scores its samples itself: pass "
                                 "reward=None, or better rollout, reward and stages=[FilterGroups(...)]")
            warnings.warn("Trainer(rollout=DynamicSampling(rollout, reward), reward=None) is deprecated: pass "
                          "rollout=..., reward=..., stages=[FilterGroups(metric, max_gen_batches)]",
                          DeprecationWarning, stacklevel=3)
            stages.insert(0, FilterGroups(rollout.metric, rollout.max_gen_batches))
            rollout, reward = rollout.rollout, rollout.reward
        if reward is None:
            raise ValueError("reward is None: the Trainer needs the reward that scores the samples")
        return cls(rollout, reward, stages)

    @property
    def tokenizer(self):
        return self.rollout.tokenizer

    def keyed(self) -> list[tuple[str, object]]:
        """(name, module) in the order they write keys, for ``rlflow.module.check_chain``."""
        at = {w: [(s.name, s) for s in self.stages if s.where == w] for w in WHERE}
        return [("rollout", self.rollout)] + at["samples"] + [("reward", self.reward)] + at["scored"]

    def modules(self) -> list:
        """Everything that may hold a reward model or state: the rollout, the reward and the stages' modules."""
        return [self.rollout, self.reward] + [getattr(s, "module", s) for s in self.stages]

    # ------------------------------------------------------------------ the stream
    def __call__(self, prompts: Iterable[TensorDict]) -> Iterator[TensorDict]:
        prompts = iter(prompts)
        self._times, self._stack, self._reward_stats, self._shared = defaultdict(float), [], [], {}
        scored = [stage for stage in self.stages if stage.where == "scored"]
        (rank, world), alone = ranks(), self._filtered_on_rank_0(scored)
        if alone and rank > 0:  # rank 0 generates, scores and filters: this rank gets its share of the kept groups
            batches = self._timed("gen", self._received())
        else:
            batches = self._timed("reward", self._scored(self._timed("gen", self._generated(prompts, not alone))))
            for stage in scored[:alone]:
                batches = self._timed(stage.name, stage.stream(batches, self))
            if alone:
                batches = self._handed_out(batches, world)
        for stage in scored[alone:]:
            batches = self._timed(stage.name, stage.stream(batches, self))
        start = time.perf_counter()
        try:
            for batch in batches:
                self.elapsed = time.perf_counter() - start
                self._publish(prompts)
                yield batch
                start = time.perf_counter()
        finally:
            batches.close()

    def collect(self, prompts: TensorDict) -> TensorDict:
        """One prompt batch, scored (``Trainer.step``)."""
        stream = self(iter([prompts]))
        try:
            return next(stream)
        finally:
            stream.close()

    def _filtered_on_rank_0(self, scored: list[Stage]) -> int:
        """Several processes with one engine on rank 0 (``AsyncRollout``, ``FullyAsyncRollout``) and dynamic
        sampling: the number of scored stages, up to the last ``FilterGroups``, that rank 0 runs alone over whole
        batches before it hands out the kept groups (:mod:`rlflow.rollout.ranks`); else 0."""
        filters = [i for i, stage in enumerate(scored) if isinstance(stage, FilterGroups)]
        if not filters or ranks()[1] == 1 or not isinstance(self.rollout, (AsyncRollout, FullyAsyncRollout)):
            return 0
        sharded = [r for r in rewards_in(self.reward) if getattr(r, "_sharded", lambda: False)()]
        if sharded:  # its forward is collective: rank 0 alone would wait for the others forever
            raise NotImplementedError(
                f"dynamic sampling with {type(self.rollout).__name__} on several processes: rank 0 scores every "
                f"group alone, and {type(sharded[0]).__name__} is sharded over the processes (FSDP2); use a reward "
                "that scores in one process (shard=False), or one training process")
        return filters[-1] + 1

    def _handed_out(self, batches: Iterator[TensorDict], world: int) -> Iterator[TensorDict]:
        """Rank 0: each kept batch split in ``world`` shares of whole groups; every other rank gets its own with
        rank 0's metrics (:func:`rlflow.rollout.ranks.lead`); rank 0's share goes on."""
        def steps():
            try:
                for batch in batches:
                    self._shared = {}  # this batch's alone
                    self._shared = self._stats()
                    yield [(share,) for share in group_shares(batch, world)], self._shared
            finally:
                batches.close()

        for (mine,) in lead(steps(), world):
            yield mine

    def _received(self) -> Iterator[TensorDict]:
        """A rank > 0: its share of every batch that rank 0 scored and filtered, with rank 0's metrics."""
        for (samples,), self._shared in received(self.rollout.device, f"{type(self).__name__} (dynamic sampling)"):
            yield samples

    def _generated(self, prompts: Iterator[TensorDict], split: bool = True
                   ) -> Iterator[tuple[TensorDict, TensorDict]]:
        """(prompts, samples) per batch; a streaming rollout (``AsyncRollout``) reads the prompts itself
        (``split=False``: whole batches on rank 0, see :meth:`_handed_out`)."""
        if optional(self.rollout, Rollout, "stream") is not None:  # its engine holds its own weights: no autocast
            yield from (self.rollout.stream(prompts, pairs=True) if split else
                        self.rollout.stream(prompts, pairs=True, split=False))
            return
        for batch in prompts:
            with self.precision():  # entered per batch: the autocast must not stay on across the yield
                samples = self.rollout(batch)
            yield batch, samples

    def _scored(self, generated) -> Iterator[TensorDict]:
        for prompts, samples in generated:
            for stage in self.stages:
                if stage.where == "samples":  # its own time, not the reward's
                    start = time.perf_counter()
                    samples = stage(prompts, samples)
                    self._times[stage.name] += time.perf_counter() - start
                    self._stack[-1] += time.perf_counter() - start
            samples = self.reward(samples)
            self._reward_stats.append(dict(optional(self.reward, Reward, "stats")))
            yield samples

    def _timed(self, name: str, items: Iterator) -> Iterator:
        """Times every ``next`` of ``items`` as ``name``, less the time spent in the parts it pulled from."""
        try:
            while True:
                self._stack.append(0.0)
                start = time.perf_counter()
                try:
                    with phase(name):  # what a fault report says this rank was doing (gen, reward, a stage)
                        item = next(items)
                except StopIteration:
                    return
                finally:
                    elapsed, inner = time.perf_counter() - start, self._stack.pop()
                    self._times[name] += elapsed - inner
                    if self._stack:
                        self._stack[-1] += elapsed
                yield item
        finally:
            items.close()

    def _publish(self, prompts) -> None:
        """The metrics of the batch about to be yielded; the prompt stream learns how many batches are ahead."""
        self.metrics = self._stats() | {f"timing_s/{k}": v for k, v in self._times.items()}
        self._times, self._reward_stats = defaultdict(float), []
        if isinstance(prompts, PromptStream):
            prompts.ahead = len(optional(self.rollout, Rollout, "in_flight"))

    def _stats(self) -> dict[str, float]:
        """The rollout's, the reward's and the stages' stats (over those rank 0 handed out, on a rank > 0)."""
        metrics = self._shared | dict(optional(self.rollout, Rollout, "stats")) | merge_stats(self._reward_stats)
        for stage in self.stages:
            metrics |= stage.stats
        return metrics

    def close(self) -> None:
        close = optional(self.rollout, Rollout, "close")
        if close is not None:
            close()

    def __repr__(self) -> str:
        return f"Experience({self.rollout!r}, {self.reward!r}, stages={self.stages!r})"


class PromptStream:
    """A loader's prompt batches for this process (its contiguous share, tensors on ``device``).

    ``state_dict`` is the loader's position after the last batch handed on, less the ``ahead`` batches a
    prefetching engine holds in flight: a checkpoint resumes at the first batch not yet trained on."""

    def __init__(self, loader, rank: int = 0, world_size: int = 1, device=None):
        self.loader, self.rank, self.world_size, self.device = loader, rank, world_size, device
        self.ahead, self._before = 0, deque(maxlen=64)

    def __iter__(self):
        return self

    def __next__(self) -> TensorDict:
        self._before.append(self.loader.state_dict())
        batch = next(self.loader)
        if self.world_size > 1:  # every rank draws the same global batch and takes its contiguous share
            size = batch.batch_size[0]
            if size % self.world_size:
                raise ValueError(f"{size} prompts per step do not split evenly over {self.world_size} processes")
            per = size // self.world_size
            batch = batch[self.rank * per : (self.rank + 1) * per]
        return to_device(batch, self.device) if self.device is not None else batch

    def whole(self) -> Iterator[TensorDict]:
        """The loader's whole batches (every process's share), drawn by this process alone: a rollout that
        generates for every process on one of them (``FullyAsyncRollout`` on rank 0) reads these, and the
        checkpoint's loader position is that process's."""
        while True:
            self._before.append(self.loader.state_dict())
            batch = next(self.loader, None)
            if batch is None:
                return
            yield to_device(batch, self.device) if self.device is not None else batch

    @property
    def steps_per_epoch(self) -> int:
        return self.loader.steps_per_epoch

    @property
    def epoch(self) -> int:
        return int(self.state_dict()["epoch"])

    def state_dict(self) -> dict:
        return dict(self._before[-self.ahead]) if self.ahead else self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)
        self.ahead = 0
        self._before.clear()


__all__ = ["Experience", "FilterGroups", "Prefetch", "PromptStream", "ReferenceResponses", "Stage",
           "WithReferenceResponses"]
