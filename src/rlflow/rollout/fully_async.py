"""Fully asynchronous RL with partial rollouts: generation never stops for training, and a response may span
several policy versions (verl's V1 ``colocate_async`` / ``separate_async``, AReaL, prime-rl).

:class:`FullyAsyncRollout` runs the rollout's engine beside the trainer (in a child process, or a server driven
from a thread, as :class:`~rlflow.rollout.async_rollout.AsyncRollout` does) and keeps it busy:

- **One group at a time.** The prompt batches of the experience stream are split into prompts (groups of ``n``
  samples); a *driver* thread admits them to the engine one by one and generates every admitted sample in
  chunks of ``chunk_tokens`` tokens. The trainer takes a batch as soon as ``batch_size`` groups are complete,
  oldest admitted first, whatever batch they were drawn in.
- **Partial rollouts.** Weights pushed by the trainer (``sync_weights``) are loaded by the driver between two
  chunks, and the requests in flight continue under them: each chunk is a new request of prompt + tokens so far,
  so its tokens are sampled, and their log-probs recorded, with the weights loaded then. A response that spans
  versions has, per token, the log-prob of the weights that sampled it (``rollout_log_probs``) and that
  version (``token_policy_version``); ``policy_version`` / ``policy_version_max`` are its oldest / newest.
  The importance-sampling correction (``TruncatedIS``, ``rlflow.algorithms.correction``) reads these per-token
  log-probs, so it corrects each token against its own behaviour policy. Chunking works with every engine; its
  cost is one prefill of the prefix per chunk.
- **Requests kept across an update** (``pause_mode="keep"``, the default where the engine has it: a vLLM server
  with ``/pause`` and ``/inference/v1/generate``, :mod:`rlflow.rollout.kept`): no chunks; each group is one
  request, a push pauses the server with vLLM's ``mode="keep"`` (requests frozen, KV cache kept), loads the
  weights and resumes, and vLLM reports which version sampled which token. The KV of the tokens before the pause
  stays the old weights' (verl and vLLM accept it). ``bind`` logs which path is used (``partial_path``).
- **Staleness per sample, in verl's terms.** A group admitted while the trainer's weights were version ``a`` and
  trained at version ``t`` has the *age* ``t - a + 1`` (verl's span from first generation to training; ``1``:
  trained on the weights it was admitted under). ``max_off_policy_threshold`` bounds it. Admission is paced so
  that, taken in order, no group would exceed it: the groups admitted and not yet taken never exceed
  ``batch_size * (threshold - 1)`` while the trainer learns and ``batch_size * threshold`` while it waits (and
  ``batch_size * (1 + num_warmup_batches)`` at most, the generation ahead verl's warm-up batches allow). Groups
  that finish out of order can still grow older; ``max_off_policy_strategy`` decides: ``"drop"`` evicts a
  finished group older than the threshold (its prompt is lost to training and the next prompt takes its place,
  as verl's refill), ``"wait"`` keeps the trainer waiting while an in-flight group has reached the threshold,
  so that it finishes and is trained, never dropped. ``None``: no bound but the pacing of warm-up batches.

``stats`` (logged every step): verl's ``training/off_policy/trajectory_spans/{mean,max,min}`` (versions a
response's tokens span: newest - oldest + 1), ``training/off_policy/trajectory_staleness/*`` (the trainer's
version - the newest), ``training/off_policy/trajectory_staleness_worst/*`` (- the oldest), and
``async/staleness_mean|max`` (the worst, as ``AsyncRollout`` logs it), ``async/partial_frac`` (responses spanning
more than one version), ``async/dropped_groups``, ``async/in_flight_groups``, ``async/policy_version``,
``timing_s/gen_wait`` (the trainer waiting for complete groups).

Checkpoints hold the version and the prompts drawn but not yet trained (queued, in flight or complete): a resumed
run generates them again first, from the restored weights, and the loader resumes after the last prompt drawn,
so no prompt is lost or trained twice. Several training processes (DDP): rank 0 runs the engine and hands
each rank whole groups of every step (:mod:`rlflow.rollout.ranks`).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from tensordict import TensorDict

from rlflow.data import keys as K
from rlflow.data.nontensor import per_row, stack
from rlflow.rollout.async_rollout import PLACEMENTS, EngineFactory, single_turn
from rlflow.rollout.engines.base import Completion, SamplingParams, hf_weight_buckets
from rlflow.rollout.engines.process import EngineProcessError, ProcessEngine
from rlflow.rollout.kept import drive_kept, keeps_requests
from rlflow.rollout.ranks import follow, full_twin, lead, ranks, refresh, shares, whole
from rlflow.rollout.single_turn import unpadded
from rlflow.rollout.wrapper import RolloutWrapper, cat_batches

STRATEGIES = ("drop", "wait")
PAUSE_MODES = ("auto", "keep", "chunks")
log = logging.getLogger(__name__)


@dataclass
class Sample:
    """One response being generated: the tokens so far, each one's log-prob and the version that sampled it."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None  # "stop" or "length" once complete


def generate_chunk(engine, samples: list[Sample], params: SamplingParams, chunk_tokens: int, version: int) -> None:
    """Extend every unfinished sample by up to ``chunk_tokens`` tokens with ``engine``'s current weights
    (``version``, or the version the engine reports in ``extras["policy_version"]``).

    Each sample is one request of its prompt and its tokens so far (``n=1``); a completion that ends in a stop
    token finishes the sample, one that reaches ``params.max_new_tokens`` in all finishes it as ``"length"``."""
    live = [s for s in samples if s.finish is None]
    if not live:
        return
    room = [params.max_new_tokens - len(s.tokens) for s in live]
    chunk = dataclasses.replace(params, n=1, max_new_tokens=max(1, min(chunk_tokens, max(room))))
    completions = engine.generate([s.prompt + s.tokens for s in live], chunk)
    if len(completions) != len(live) or any(len(c) != 1 for c in completions):
        raise RuntimeError(f"{type(engine).__name__} returned {[len(c) for c in completions]} completions for "
                           f"{len(live)} requests of one sample each")
    for sample, (completion,), left in zip(live, completions, room):
        took = completion.token_ids[:left]
        sampled_by = int(completion.extras.get("policy_version", version))
        sample.tokens += took
        sample.log_probs += completion.log_probs[:left]
        sample.versions += [sampled_by] * len(took)
        if completion.finish_reason == "stop" and len(completion.token_ids) <= left:
            sample.finish = "stop"
        elif len(sample.tokens) >= params.max_new_tokens or not took:
            sample.finish = "length"


@dataclass
class _Group:
    """One prompt's ``n`` samples, the row it came in (``[1]``), and the trainer's version when it was admitted."""

    seq: int
    row: TensorDict
    samples: list[Sample]
    admitted: int = -1

    @property
    def done(self) -> bool:
        return all(s.finish is not None for s in self.samples)


class FullyAsyncRollout(RolloutWrapper):
    """Generation running continuously beside training, with partial rollouts and a per-sample staleness bound.

    Args:
        rollout: a single-turn rollout with an engine (``HFRollout``, ``VLLMRollout``, ``ServerRollout``, or a
            ``SingleTurnRollout`` with one).
        max_off_policy_threshold: the oldest a group may be when trained, in versions from its admission
            (verl's ``trainer.v1.sampler.max_off_policy_threshold``; ``1``: trained on the weights it was admitted
            under; ``None``: no bound). See the module docstring.
        max_off_policy_strategy: ``"drop"`` or ``"wait"`` for a group over the bound (verl's
            ``trainer.v1.sampler.max_off_policy_strategy``).
        num_warmup_batches: batches admitted ahead of the one the trainer waits for (verl's
            ``trainer.v1.colocate_async.num_warmup_batches``; fractions admit part of a batch).
        chunk_tokens: tokens generated per request between two chances to load new weights (the chunks path).
        pause_mode: ``"keep"`` (requests kept across a weight update, vLLM's ``pause_generation(mode="keep")``;
            refused at ``bind`` where the engine lacks it), ``"chunks"`` (partial rollouts by chunks, every
            engine) or ``"auto"`` (``"keep"`` where the engine has it, else chunks). ``partial_path`` says which.
        placement, start_method, threads, timeout: as :class:`~rlflow.rollout.async_rollout.AsyncRollout`'s
            (``timeout``: seconds the trainer waits without any group completing before the run fails). A dead
            generation process stops the run, naming it (``AsyncRollout`` starts one again; here the driver
            thread would have to fork it, which can deadlock).

    Writes the wrapped rollout's keys and ``policy_version``, ``policy_version_max`` ([B] int64) and
    ``token_policy_version`` ([B, R] int64, -1 on padding). Validation (``with_options``) and a single call
    (``rollout(batch)``) sample in the trainer's process with the wrapped rollout, on the current weights.
    """

    def __init__(self, rollout, max_off_policy_threshold: int | None = 8, max_off_policy_strategy: str = "drop", *,
                 num_warmup_batches: float = 1, chunk_tokens: int = 32, placement: str = "auto",
                 start_method: str | None = None, threads: int | None = None, timeout: float = 3600.0,
                 pause_mode: str = "auto"):
        threshold = max_off_policy_threshold
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1):
            raise ValueError(f"max_off_policy_threshold must be an integer >= 1 (versions from admission to training; "
                             f"1: on the weights it was admitted under) or None, got {threshold!r}")
        if max_off_policy_strategy not in STRATEGIES:
            raise ValueError(f"max_off_policy_strategy must be one of {STRATEGIES}, got {max_off_policy_strategy!r}")
        if isinstance(num_warmup_batches, bool) or not isinstance(num_warmup_batches, (int, float)) \
                or num_warmup_batches < 0:
            raise ValueError(f"num_warmup_batches must be a number >= 0, got {num_warmup_batches!r}")
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be an integer >= 1, got {chunk_tokens!r}")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        super().__init__(single_turn(rollout, "FullyAsyncRollout"))
        self.out_keys = tuple(rollout.out_keys) + (K.POLICY_VERSION, K.POLICY_VERSION_MAX, K.TOKEN_POLICY_VERSION)
        self.threshold, self.strategy = threshold, max_off_policy_strategy
        self.num_warmup_batches, self.chunk_tokens, self.timeout = num_warmup_batches, chunk_tokens, timeout
        self.pause_mode, self.partial_path = pause_mode, None  # "keep" or "chunks" once bound
        self.placement = placement if placement != "auto" else (
            "thread" if rollout.engine.remote else "process")
        # no restarts: a dead process would be forked again from the driver thread, and a fork beside other threads
        # can deadlock in the child (seen: a hung suite); the first death stops the run, naming the process
        self.process_options = {"start_method": start_method, "threads": threads, "max_restarts": 0}
        self.engine = None
        self.rank, self.world, self.device, self._twin = 0, 1, None, None
        self.version, self.restored = 0, False
        self.batch_size: int | None = None
        self.stats: dict[str, float] = {}
        self._cond = threading.Condition()
        self._queue: deque[_Group] = deque()  # drawn, not admitted
        self._active: list[_Group] = []  # admitted, generating
        self._ready: list[_Group] = []  # complete, not taken
        self._seq, self._learning, self._dropped = 0, False, 0
        self._want: int | None = None  # the next take's group count (a top-up of dynamic sampling), once
        self._step: list[_Group] = []  # the groups taken for the current step (with its top-ups)
        self._weights: tuple[int, list] | None = None  # the newest push, not loaded yet
        self._driver: threading.Thread | None = None
        self._stopping, self._error = False, None
        self._engine_version = 0

    @property
    def holds_own_weights(self) -> bool:
        return True

    # ------------------------------------------------------------------ binding
    def bind(self, model, tokenizer) -> None:
        """Start the engine (version 0: ``model``'s weights); the wrapped rollout is bound here too (validation).
        Several processes: the engine runs on rank 0 only (:mod:`rlflow.rollout.ranks`)."""
        self.rank, self.world = ranks()
        self._twin = full_twin(model, "FullyAsyncRollout") if self.world > 1 else None
        model = self._twin if self._twin is not None else model
        self.close_engine()
        self.rollout.bind(model, tokenizer)
        self.device = next(model.parameters()).device
        self.version, self._engine_version, self.restored = 0, 0, False
        if self.rank > 0:  # rank 0 generates for every rank
            return
        if self.placement == "thread":
            if not self.rollout.holds_own_weights:  # it would sample with the module being trained, mid-update
                raise ValueError(f"placement='thread' needs an engine with weights of its own (a server); "
                                 f"{type(self.rollout).__name__} generates with the trained module: use 'process'")
            self.engine = self.rollout.engine
        self.partial_path = self._choose_path()  # before a child process starts: a refusal leaves none behind
        if self.placement != "thread":
            self.engine = ProcessEngine(EngineFactory(self.rollout), model, tokenizer, slots=2,
                                        uses_process_group=self.rollout.holds_own_weights, timeout=self.timeout,
                                        **self.process_options)
        self._clear()

    def _choose_path(self) -> str:
        """``"keep"`` or ``"chunks"`` for the bound engine, said once (a ``pause_mode="keep"`` it lacks: refused)."""
        if self.pause_mode == "chunks":
            why = "pause_mode='chunks'"
        elif self.placement != "thread":
            why = (f"the engine runs in a child process ({type(self.rollout).__name__}): chunks reach it through "
                   "generate and load_weights only")
        else:
            why = keeps_requests(self.engine)
        if why is None:
            log.info("FullyAsyncRollout: partial rollouts keep the requests in flight across weight updates "
                     "(vLLM's pause_generation(mode='keep') at %s; no chunks)", getattr(self.engine, "url", "the engine"))
            return "keep"
        if self.pause_mode == "keep":
            raise ValueError(f"FullyAsyncRollout(pause_mode='keep'): {why}; use pause_mode='auto' or 'chunks'")
        log.info("FullyAsyncRollout: partial rollouts by chunks of %d tokens (%s)", self.chunk_tokens, why)
        return "chunks"

    def close(self) -> None:
        """Stop the driver and the engine (and a server the wrapped rollout started)."""
        self.close_engine()
        self.rollout.close()

    def close_engine(self) -> None:
        self._stop_driver()
        if isinstance(self.engine, ProcessEngine):
            self.engine.close()
        self.engine = None

    # ------------------------------------------------------------------ weights
    def sync_weights(self, trained) -> dict[str, float]:
        """A snapshot of ``trained``'s weights as the next version; the driver loads it between two chunks."""
        if self._twin is not None:  # FSDP2: every rank gathers the shards (validation samples with the copy)
            refresh(trained, self._twin)
            trained = self._twin
        if self.engine is None:
            return {}
        start, copies, pairs = time.perf_counter(), {}, []
        for bucket in hf_weight_buckets(trained, self.rollout.bucket_bytes):
            for name, t in bucket:  # a tied parameter's names share one copy (the source kept: ids stay unique)
                held = copies.setdefault(id(t), (t, t.detach().to("cpu", copy=True)))
                pairs.append((name, held[1]))
        with self._cond:  # the version and its weights change together: admission reads the version
            if self.restored:  # the checkpoint's weights, under the version load_state_dict restored
                self.restored = False
            else:
                self.version += 1
            self._weights, self._learning = (self.version, pairs), False
            self._cond.notify_all()
        gb = sum(c.numel() * c.element_size() for _, c in copies.values()) / 1e9
        return {"weight_sync/gb": gb, "weight_sync/push_s": time.perf_counter() - start}

    def state_dict(self) -> dict:
        """The version and the prompts drawn but not trained (plain tensors and values, in admission order)."""
        with self._cond:
            groups = sorted(self._ready + self._active, key=lambda g: g.seq) + list(self._queue)
        return {"policy_version": self.version, "prompts": [_plain(g.row) for g in groups]}

    def load_state_dict(self, state: dict) -> None:
        """Restore the version; the saved prompts are generated again first, with the restored weights."""
        self._stop_driver()
        self._clear()
        self.version, self.restored = int(state["policy_version"]), True
        for row in state.get("prompts", []):
            self._queue.append(self._group(_row(row)))

    # ------------------------------------------------------------------ sampling
    def forward(self, batch: TensorDict) -> TensorDict:
        """One batch, generated now in the trainer's process with the current weights (nothing ahead)."""
        return self.rollout(batch)

    def stream(self, prompts, pairs: bool = False, split: bool = True):
        """Batches of ``batch_size`` complete groups (the size of the first prompt batch) as they complete, the
        prompts drawn from ``prompts`` as admission needs them; ``pairs``: yield (prompts, samples). ``split=False``
        (several processes, rank 0): every step's groups whole, handed out by the caller (dynamic sampling)."""
        if self.rank > 0:
            yield from follow(self, pairs)
            return
        if self.engine is None:
            raise RuntimeError("FullyAsyncRollout has no engine: call rollout.bind(model, tokenizer) (the Trainer does)")
        prompts = iter(whole(prompts, "FullyAsyncRollout") if self.world > 1 else prompts)  # rank 0 draws for all
        if isinstance(self.engine, ProcessEngine):  # the child samples from the trainer's random stream
            import numpy as np

            self.engine.seed(torch.get_rng_state(), random.getstate(), np.random.get_state())
        self._start_driver()
        world = self.world if split else 1
        steps = lead(self._steps(prompts, world), world)
        try:
            for batch, samples in steps:
                yield (batch, samples) if pairs else samples
        finally:
            steps.close()
            self._stop_driver()

    def _steps(self, prompts, world: int):
        """Every step's complete groups, in one share of whole groups per rank (``world`` shares), with their stats."""
        ended = False
        while True:
            ended = self._draw(prompts, ended)
            groups = self._take(ended)
            if groups is None:
                return
            if groups:  # else prompts to draw first
                yield [self._laid_out(share) for share in shares(groups, world)], self.stats

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

    def _take(self, ended: bool) -> list[_Group] | None:
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
            groups, self._ready = self._ready[:B], self._ready[B:]
            self._learning = True  # until the next sync_weights: admission leaves room for the version it brings
            in_flight, dropped, self._dropped, self._want = len(self._active), self._dropped, 0, None
        self._record(groups, time.perf_counter() - start, dropped, in_flight, topup)
        return groups

    def _age(self, group: _Group) -> int:
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

    def _record(self, groups: list[_Group], waited: float, dropped: int, in_flight: int, topup: bool) -> None:
        """verl's off-policy metrics over the batch's responses, and rlflow's ``async/*`` (a top-up: over every
        group taken for the step, the waits and drops added up)."""
        if topup:
            groups = self._step + groups
            waited += self.stats.get("timing_s/gen_wait", 0.0)
            dropped += int(self.stats.get("async/dropped_groups", 0))
        self._step = groups
        samples = [s for g in groups for s in g.samples]
        oldest = torch.tensor([min(s.versions, default=self.version) for s in samples], dtype=torch.float)
        newest = torch.tensor([max(s.versions, default=self.version) for s in samples], dtype=torch.float)
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
        }

    def _laid_out(self, groups: list[_Group]) -> tuple[TensorDict, TensorDict]:
        """The groups' prompt rows as one batch, and their samples laid out as the wrapped rollout lays them."""
        batch = cat_batches([g.row for g in groups], self.rollout.tokenizer.pad_token_id)
        completions = [[Completion(s.tokens, s.log_probs, s.finish) for s in g.samples] for g in groups]
        samples = self.rollout.samples(batch, completions)
        flat = [s for g in groups for s in g.samples]
        versions = torch.full(samples[K.RESPONSE_IDS].shape, -1, dtype=torch.long)
        for row, s in enumerate(flat):
            versions[row, :len(s.versions)] = torch.tensor(s.versions, dtype=torch.long)
        device = batch[K.PROMPT_IDS].device
        samples[K.TOKEN_POLICY_VERSION] = versions.to(device)
        samples[K.POLICY_VERSION] = torch.tensor([min(s.versions, default=self.version) for s in flat]).to(device)
        samples[K.POLICY_VERSION_MAX] = torch.tensor([max(s.versions, default=self.version) for s in flat]).to(device)
        return batch, samples

    def _group(self, row: TensorDict) -> _Group:
        ids, mask = row[K.PROMPT_IDS].cpu(), row[K.PROMPT_MASK].cpu()
        prompt = unpadded(ids, mask)[0]
        self._seq += 1
        return _Group(self._seq, row, [Sample(list(prompt)) for _ in range(self.rollout.n)])

    def _clear(self) -> None:
        with self._cond:
            self._queue.clear()
            self._active.clear()
            self._ready.clear()
            self._weights, self._learning, self._dropped, self._error = None, False, 0, None
            self._want, self._step = None, []

    # ------------------------------------------------------------------ the driver thread
    def _start_driver(self) -> None:
        if self._driver is not None:
            return
        self._stopping = False
        self._driver = threading.Thread(target=self._drive, name="rlflow-fully-async", daemon=True)
        self._driver.start()

    def _stop_driver(self) -> None:
        """Stop the driver after its current chunk; groups not taken go back to the queue (admitted again)."""
        if self._driver is None:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._driver.join(timeout=self.timeout)
        self._driver = None
        with self._cond:  # a later stream starts them over, in the order they were drawn
            again = sorted(self._active + self._ready, key=lambda g: g.seq)
            self._queue.extendleft(reversed([self._group(g.row) for g in again]))
            self._active.clear()
            self._ready.clear()

    def _drive(self) -> None:
        try:
            if self.partial_path == "keep":
                drive_kept(self)
            else:
                self._drive_chunks()
        except BaseException as e:  # noqa: BLE001 - the trainer raises it from the next take
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _drive_chunks(self) -> None:
        """Load pushed weights between chunks, admit prompts as the pacing allows, generate one chunk, repeat."""
        params = self.rollout.sampling
        while True:
            with self._cond:
                while not self._stopping and self._weights is None and not self._active and not (
                        self._queue and self.batch_size is not None and self._room() > 0):
                    self._cond.wait()
                if self._stopping:
                    return
                weights, self._weights = self._weights, None
                if weights is None:
                    while self._queue and self._room() > 0:  # one group at a time, as the pacing allows
                        group = self._queue.popleft()
                        group.admitted = self.version
                        self._active.append(group)
                live = [s for g in self._active for s in g.samples]
            if weights is not None:
                version, pairs = weights
                if isinstance(self.engine, ProcessEngine):
                    self.engine.load_weights([pairs], version=version)
                else:
                    self.engine.load_weights([pairs])
                self._engine_version = version
                continue
            generate_chunk(self.engine, live, params, self.chunk_tokens, self._engine_version)
            self._hand_over_finished()

    def _hand_over_finished(self) -> None:
        """Move the groups whose samples have all finished from in flight to ready, waking the trainer."""
        with self._cond:
            done = [g for g in self._active if g.done]
            if done:
                self._active = [g for g in self._active if not g.done]
                self._ready += done
                self._cond.notify_all()

    def __repr__(self) -> str:
        return (f"FullyAsyncRollout({self.rollout!r}, max_off_policy_threshold={self.threshold}, "
                f"max_off_policy_strategy={self.strategy!r}, num_warmup_batches={self.num_warmup_batches}, "
                f"chunk_tokens={self.chunk_tokens}, placement={self.placement!r}, pause_mode={self.pause_mode!r})")


def _plain(row: TensorDict) -> dict:
    """A ``[1]`` prompt row as tensors and plain values (a checkpoint loads with ``weights_only=True``)."""
    out = {"tensors": {}, "values": {}}
    for key in row.keys():
        value = row.get(key)
        if isinstance(value, torch.Tensor):
            out["tensors"][key] = value.detach().cpu().clone()
        else:
            out["values"][key] = per_row(row, key)[0]
    return out


def _row(plain: dict) -> TensorDict:
    row = TensorDict(dict(plain["tensors"]), batch_size=[1])
    for key, value in plain["values"].items():
        row.set(key, stack([value]))
    return row


__all__ = ["FullyAsyncRollout", "Sample", "generate_chunk"]
