"""AsyncRollout: generation overlapped with training, with bounded staleness (verl's one-step-off recipe).

In a synchronous step the trainer waits for generation, then the engine waits for the update. Here the
engine runs beside the trainer (in a child process, or a server driven from a thread) and samples the
next ``max_staleness`` batches while the trainer updates on the current one::

    step t   trainer │ wait for batch t │ reward, log-probs, update │ push weights v(t+1) │
             engine  │ ... batch t+1, weights v(t) ...    │ load v(t+1) │ batch t+2 with v(t+1) ...

A sample generated with the weights of version ``g`` and trained at version ``t`` (the number of updates
so far) is ``t - g`` versions stale; batch ``t + k`` is submitted at step ``t`` after the weights ``v(t)``,
so staleness never exceeds ``max_staleness = k`` (``0`` is synchronous, ``1`` one-step-off). The loss
corrects for it with the sampler's log-probs as the behaviour policy: ``rollout_log_probs`` come from the
weights that sampled, and ``TruncatedIS`` (``rlflow.algorithms.correction``) reweights each token by
``min(pi_old / pi_rollout, C)`` (the verl entry point turns it on in this mode).

The Trainer needs nothing new: :meth:`AsyncRollout.stream` reads the upcoming prompt batches from the
experience stream's own iterator (``rlflow.rollout.stream``; ``Prefetch`` is the same as a stage), so the
batches generated ahead are the ones the trainer takes next. ``sync_weights`` pushes weights without
waiting for the engine, and each batch carries ``policy_version`` (the version that sampled it) and
metrics (``stats``): staleness, batches over the bound, and each side's waiting time. Called on one batch
(``rollout(batch)``) it cannot know the next one: it generates that batch and nothing ahead.

Around an ``AgentLoop`` (multi-turn, with tools) the whole loop of a batch is the engine's job, run on a thread
beside the trainer (:mod:`rlflow.rollout.agent.beside`): the same bound, versions and metrics.
"""

from __future__ import annotations

import copy
import random
import time
import warnings
from collections import deque
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from rlflow.data import keys as K
from rlflow.models.policy import lora_module
from rlflow.rollout.agent.beside import OnWorker, engine_beside, run_loop
from rlflow.rollout.agent.loop import AgentLoop
from rlflow.rollout.engines.base import hf_weight_buckets
from rlflow.rollout.engines.process import ProcessEngine
from rlflow.rollout.engines.threaded import ThreadedEngine
from rlflow.rollout.ranks import follow, full_twin, lead, ranks, refresh, row_shares, whole
from rlflow.rollout.single_turn import SingleTurnRollout, unpadded
from rlflow.rollout.wrapper import RolloutWrapper

PLACEMENTS = ("auto", "process", "thread")


@dataclass
class _Job:
    """A batch of prompts handed to the engine, and the ticket its samples come back under."""

    ticket: int
    prompts: TensorDict


class EngineFactory:
    """``(model, tokenizer) -> engine`` for the child process: a copy of the rollout's engine as it is at bind time,
    bound there to the child's model. A child started again after one died (forked mid-run) must not see the
    rollout's engine, which by then is the ProcessEngine itself."""

    def __init__(self, rollout: SingleTurnRollout):
        self.engine = copy.copy(rollout.engine)
        self.__qualname__ = f"{type(rollout).__name__}'s {type(rollout.engine).__name__}"  # how a failure names it

    def __call__(self, model, tokenizer):
        engine = copy.copy(self.engine)
        engine.bind(model, tokenizer)
        return engine


def single_turn(rollout, wrapper: str) -> SingleTurnRollout:
    """``rollout`` if it is a single-turn rollout (whose engine a wrapper can run elsewhere), else a TypeError."""
    if not isinstance(rollout, SingleTurnRollout):
        raise TypeError(f"{wrapper} runs a single-turn rollout's engine (HFRollout, VLLMRollout, ServerRollout, "
                        f"SingleTurnRollout): {type(rollout).__name__} is not one")
    if rollout.engine is None:
        raise TypeError(f"{wrapper}: {type(rollout).__name__} has no engine (SingleTurnRollout(engine, ...))")
    return rollout


class AsyncRollout(RolloutWrapper):
    """Runs a rollout's engine beside the trainer, up to ``max_staleness`` batches ahead.

    Args:
        rollout: the single-turn rollout whose engine samples (``HFRollout``, ``VLLMRollout``, ``ServerRollout``, or a
            ``SingleTurnRollout`` with any engine: a copy of it is bound in the child process); its sampling options
            and batch layout are used as they are. Or an ``AgentLoop`` around one: each batch's whole loop
            (turns and tools) runs on a thread beside the trainer, sampling with a copy of the model (transformers)
            or the engine's own weights (vLLM, a server); ``placement`` is then ``"thread"``.
        max_staleness: batches generated ahead of training, which is also the most versions a sample may lag
            the policy it trains (``0``: synchronous, in the engine's process; ``1``: one-step-off).
        placement: ``"process"`` runs the engine in a child process
            (:class:`~rlflow.rollout.engines.process.ProcessEngine`); ``"thread"`` drives an engine that
            already runs elsewhere from a background thread (a server:
            :class:`~rlflow.rollout.engines.threaded.ThreadedEngine`); ``"auto"`` picks ``"thread"`` for
            an engine that samples elsewhere (``engine.remote``: a server) and ``"process"`` otherwise.
        start_method, threads: for the child process (see ``ProcessEngine``; default fork, one thread).
        timeout: seconds a batch may take before the run fails (a child that stops answering).
        max_engine_restarts: times a child process that died is started again in the run, with the newest
            weights and the batches it had not answered (``rollout/engine_restarts`` counts them; see
            ``ProcessEngine``); one death more fails the run within a second, saying what to check.

    Writes the wrapped rollout's keys and ``policy_version`` ([B] int64). ``stats`` (logged every step):
    ``async/staleness_mean`` and ``async/staleness_max`` (versions behind, over the step's samples),
    ``async/over_bound_frac`` (fraction of the batch that arrived staler than ``max_staleness`` and was
    generated again with the newest weights; by construction 0 when ``sync_weights`` follows every step),
    ``async/regenerated_samples``, ``async/mispredicted_batches`` (always 0 now that the engine reads the
    prompt stream; kept for dashboards that plot it),
    ``async/policy_version``, ``timing_s/gen_wait`` (the trainer waiting for samples) and
    ``timing_s/train_wait`` (the engine waiting for work: its idle time before the batches of this step).
    They cover every batch collected since the last push: with dynamic sampling (``FilterGroups``) the step's
    top-up batches too, which the engine generates ahead like any batch of the stream.

    Checkpoints hold the policy version; in-flight batches are not saved: after a resume the first batch
    is generated with the restored weights and the pipeline refills from there. Several training processes:
rank 0 runs the engine and hands each rank whole groups of every batch (:mod:`rlflow.rollout.ranks`).
    """

    def __init__(self, rollout, max_staleness: int = 1, *, placement: str = "auto", start_method: str | None = None,
                 threads: int | None = None, timeout: float = 3600.0, max_engine_restarts: int = 2):
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"max_staleness must be an integer >= 0 (batches generated ahead), got {max_staleness!r}")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        self.agent = rollout if isinstance(rollout, AgentLoop) else None  # it runs whole on the engine's thread
        if self.agent is not None and placement == "process":
            raise ValueError("AsyncRollout over an AgentLoop runs the loop on a thread beside the trainer (its tools "
                             "run in the trainer's process): placement must be 'thread' or 'auto', not 'process'")
        super().__init__(single_turn(rollout.rollout if self.agent else rollout, "AsyncRollout"))
        self.out_keys = tuple(rollout.out_keys) + (K.POLICY_VERSION,)
        self.max_staleness, self.timeout = max_staleness, timeout
        self.placement = placement if placement != "auto" else (
            "thread" if self.rollout.engine.remote or self.agent else "process")
        self.process_options = {"start_method": start_method, "threads": threads, "max_restarts": max_engine_restarts}
        self.given_engine = self.rollout.engine  # the rollout's own, bound in the child (a copy) or here (a server)
        self.engine: ProcessEngine | ThreadedEngine | None = None
        self.version = 0
        self.in_flight: deque[_Job] = deque()
        self.reseed, self.restored = False, False
        self.stats: dict[str, float] = {}
        self._since_push: list[tuple] = []  # per batch collected since the last push: (versions, over, gen_s, waits)
        self.rank, self.world, self.device, self._twin = 0, 1, None, None

    @property
    def holds_own_weights(self) -> bool:
        return True  # the engine keeps its own copy, loaded by sync_weights

    # ------------------------------------------------------------------ binding
    def bind(self, model, tokenizer) -> None:
        """Start the engine beside the trainer with ``model``'s weights (version 0). Several processes: the engine
        runs on rank 0 only, the others sample validation batches in-process (:mod:`rlflow.rollout.ranks`)."""
        self.rank, self.world = ranks()
        if self.agent is not None:
            return self._bind_agent(model, tokenizer)
        self._twin = full_twin(model, "AsyncRollout") if self.world > 1 else None
        model = self._twin if self._twin is not None else model
        self.device = next(model.parameters()).device
        if self.rank > 0:  # rank 0 generates every rank's batches
            self.rollout.bind(model, tokenizer)
            self.version, self.restored = 0, False
            return
        if lora_module(model) is not None and self.rollout.holds_own_weights:  # pushes carry PEFT names here
            raise NotImplementedError(f"AsyncRollout with a LoRA policy runs the transformers engine (HFRollout) for "
                                      f"now; {type(self.rollout).__name__} needs merged weights, which its "
                                      "synchronous form sends: use it without AsyncRollout")
        self._close_engine()
        if self.placement == "thread":
            self.rollout.bind(model, tokenizer)
            if not self.rollout.holds_own_weights:  # it would sample with the module being trained, mid-update
                raise ValueError(f"placement='thread' needs an engine with weights of its own (a server); "
                                 f"{type(self.rollout).__name__} generates with the trained module: use 'process'")
            self.engine = ThreadedEngine(self.rollout.engine, timeout=self.timeout)
        else:
            # an engine with weights of its own (vLLM) joins torch.distributed when it starts
            self.engine = ProcessEngine(EngineFactory(self.rollout), model, tokenizer, slots=self.max_staleness + 1,
                                        uses_process_group=self.rollout.holds_own_weights, timeout=self.timeout,
                                        **self.process_options)
        self.rollout.sample_with(self.engine, model, tokenizer)  # validation copies (with_options) use it too
        self.engine.loaded_from = model
        self.version, self.restored, self._since_push = 0, False, []
        self.in_flight.clear()

    def _bind_agent(self, model, tokenizer) -> None:
        if self.world > 1 or lora_module(model) is not None:
            raise NotImplementedError("AsyncRollout over an AgentLoop runs on one training process with a full "
                                      "(not LoRA) policy for now: use the AgentLoop without AsyncRollout")
        self._close_engine()
        self.engine = engine_beside(self.agent, model, tokenizer, self.timeout)
        self.engine.loaded_from = model
        self.version, self.restored, self._since_push = 0, False, []
        self.in_flight.clear()

    def with_options(self, **overrides):
        """A copy sampling with other options (validation): an agent loop's runs on the engine's thread, after the
        batches in flight; a single-turn rollout's samples through the engine (``sample_with``)."""
        if self.agent is not None:
            copied = self.agent.with_options(**overrides)
            return OnWorker(copied, self.engine) if self.engine is not None else copied
        return super().with_options(**overrides)

    @property
    def max_new_tokens(self) -> int | None:
        return (self.agent or self.rollout).max_new_tokens

    def bind_prompts(self, loader) -> None:
        """Deprecated, and does nothing: the engine reads the batches ahead from the prompt stream itself
        (:meth:`stream`; ``Trainer.fit`` gives it one)."""
        warnings.warn("AsyncRollout.bind_prompts is deprecated and does nothing: iterate rollout.stream(prompts) "
                      "(or use rlflow.rollout.stream.Experience) to generate ahead", DeprecationWarning, stacklevel=2)

    def close(self) -> None:
        """Stop the engine (its process or thread), and a server the wrapped rollout started."""
        self._close_engine()
        self.rollout.close()

    def _close_engine(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
            self.rollout.sample_with(self.given_engine, self.rollout.model, self.rollout.tokenizer)

    # ------------------------------------------------------------------ weights
    def sync_weights(self, trained) -> dict[str, float]:
        """Push ``trained``'s weights as the next version; the engine loads them after the batches already
        submitted (with the weights they were submitted under) and before any later one."""
        if self._twin is not None:  # FSDP2: every rank gathers the shards (validation samples with the copy)
            refresh(trained, self._twin)
            trained = self._twin
        if self.engine is None:
            return {}
        if self.restored:  # the restored checkpoint's weights: the version load_state_dict set
            self.restored = False
        else:
            self.version += 1
        self._since_push = []
        start = time.perf_counter()
        metrics = self.engine.load_weights(hf_weight_buckets(trained, self.rollout.bucket_bytes), version=self.version)
        self.engine.loaded_from = trained
        return metrics | {"weight_sync/seconds": time.perf_counter() - start}

    def state_dict(self) -> dict:
        return {"policy_version": self.version}

    def load_state_dict(self, state: dict) -> None:
        """Restore the version count; batches in flight are dropped (they are generated again after the
        restored weights arrive with the ``sync_weights`` that follows a checkpoint load)."""
        self.version, self.restored, self.reseed = int(state["policy_version"]), True, True
        self._since_push = []
        self._drop_in_flight()

    # ------------------------------------------------------------------ sampling
    def forward(self, batch: TensorDict) -> TensorDict:
        """One batch, generated now (nothing ahead: the next batch is not known here; a rank > 0: in-process)."""
        if self.rank > 0:
            return self.rollout(batch)
        self._start()
        return self._collect(self._submit(batch))

    def stream(self, prompts, pairs: bool = False, split: bool = True):
        """Samples for every batch of the iterator ``prompts``, keeping the next ``max_staleness`` batches in
        flight on the engine (read from ``prompts`` as they are needed); ``pairs``: yield (prompts, samples).
        ``split=False`` (several processes, rank 0): every whole batch, handed out by the caller (the experience
        stream, after dynamic sampling).

        The engine's random state is set from the trainer's before its first batch, so a stream with
        ``max_staleness=0`` samples what the synchronous run samples. Batches still in flight when the
        stream is closed are cancelled."""
        if self.rank > 0:
            yield from follow(self, pairs)
            return
        self._start(reseed=True)
        world = self.world if split else 1
        steps = lead(self._steps(iter(whole(prompts, "AsyncRollout") if self.world > 1 else prompts), world), world)
        try:
            for batch, samples in steps:
                yield (batch, samples) if pairs else samples
        finally:
            steps.close()
            self._drop_in_flight()

    def _steps(self, prompts, world: int):
        """Every batch's samples, split in one share of whole groups per rank (``world`` shares), with their stats."""
        ended = False
        while True:
            while not ended and len(self.in_flight) <= self.max_staleness:
                upcoming = next(prompts, None)
                ended = upcoming is None
                if not ended:
                    self.in_flight.append(self._submit(upcoming))
            if not self.in_flight:
                return
            job = self.in_flight.popleft()
            samples = self._collect(job)
            yield row_shares(job.prompts, samples, world, self.rollout.n), self.stats

    def _start(self, reseed: bool = False) -> None:
        if self.engine is None:
            raise RuntimeError("AsyncRollout has no engine: call rollout.bind(model, tokenizer) (the Trainer does)")
        if self.reseed or reseed:
            import numpy as np

            self.engine.seed(torch.get_rng_state(), random.getstate(), np.random.get_state())
            self.reseed = False

    def _collect(self, job: _Job) -> TensorDict:
        """Wait for ``job``'s samples; a batch staler than the bound is generated again with the newest weights."""
        start = time.perf_counter()
        generated = [self.engine.result(job.ticket)]
        stale = self.version - generated[0].version
        if stale > self.max_staleness:  # weights were pushed more often than batches were taken
            generated.append(self.engine.result(self._submit(job.prompts).ticket))
        wait = time.perf_counter() - start
        batch, last = job.prompts, generated[-1]
        if self.agent is not None:  # the loop's samples, every turn of them sampled by one version
            samples, loop_stats = last.completions
            versions = torch.full((samples.batch_size[0],), last.version, dtype=torch.long)
        else:
            self._check(last.completions, batch.batch_size[0])
            samples, loop_stats = self.rollout.samples(batch, last.completions), {}
            versions = torch.tensor([c.extras["policy_version"] for per_prompt in last.completions
                                     for c in per_prompt], dtype=torch.long)
        samples[K.POLICY_VERSION] = versions.to(batch[K.PROMPT_IDS].device)
        self._since_push.append((versions, float(stale > self.max_staleness), sum(g.gen_s for g in generated),
                                 wait, sum(g.idle_s for g in generated)))
        self.stats = dict(self.engine.stats) | loop_stats | self._step_stats()
        return samples

    def _step_stats(self) -> dict[str, float]:
        """``async/*`` and the waits over every batch collected since the last push: the step's batches (several
        with dynamic sampling's top-ups, the filtered ones included)."""
        batches = self._since_push
        staleness = (self.version - torch.cat([b[0] for b in batches])).float()
        return {
            "async/staleness_mean": float(staleness.mean()), "async/staleness_max": float(staleness.max()),
            "async/over_bound_frac": sum(b[1] for b in batches) / len(batches),
            "async/regenerated_samples": sum(b[1] * len(b[0]) for b in batches),
            "async/mispredicted_batches": 0.0, "async/policy_version": float(self.version),
            "async/engine_gen_s": sum(b[2] for b in batches),
            "timing_s/gen_wait": sum(b[3] for b in batches), "timing_s/train_wait": sum(b[4] for b in batches),
        }

    def _submit(self, batch: TensorDict) -> _Job:
        if self.agent is not None:
            return _Job(self.engine.submit_call(run_loop, self.agent, batch), batch)
        ids, mask = batch[K.PROMPT_IDS].cpu(), batch[K.PROMPT_MASK].cpu()
        return _Job(self.engine.submit(unpadded(ids, mask), self.rollout.sampling), batch)

    def _drop_in_flight(self) -> None:
        while self.in_flight:
            self.engine.cancel(self.in_flight.popleft().ticket)

    def _check(self, completions, num_prompts: int) -> None:
        n = self.rollout.n
        if len(completions) != num_prompts or any(len(c) != n for c in completions):
            raise RuntimeError(f"the engine returned {[len(c) for c in completions]} completions for {num_prompts} "
                               f"prompts, expected {n} each")

    def __repr__(self) -> str:
        wrapped = self.agent or self.rollout
        return f"AsyncRollout({wrapped!r}, max_staleness={self.max_staleness}, placement={self.placement!r})"
