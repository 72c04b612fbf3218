"""ThreadedEngine: an engine that already runs elsewhere (a server), driven from a background thread.

A server engine spends the trainer's time waiting on HTTP, not computing, so asynchronous RL needs no
process of its own for it: one worker thread runs the jobs, in the order they were asked for, while the
trainer's thread trains. It offers the same pipelined calls as
:class:`~rlflow.rollout.engines.process.ProcessEngine` (``submit``, ``result``, ``cancel``, ``seed``).

Weights are snapshotted (copied) in the trainer's thread when pushed, so later optimizer steps cannot
change them before the worker sends them; the worker then writes and reloads them (the server engine's
own ``load_weights``) before the jobs submitted after the push.

Any work can be a job (:meth:`ThreadedEngine.submit_call`): an agent loop's whole batch of conversations runs
on the worker that way (``AsyncRollout`` over an ``AgentLoop``), its turns and tools under one weight version.
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from rlflow.rollout.engines.base import Completion, Engine, SamplingParams, WeightBuckets, counted
from rlflow.rollout.engines.process import EngineProcessError, Generated


class ThreadedEngine(Engine):
    """Runs ``engine``'s calls on one worker thread, first in, first out.

    Args:
        engine: the engine to drive (e.g. a :class:`~rlflow.rollout.engines.server.ServerEngine`).
        timeout: seconds :meth:`result` waits for one job before raising :class:`EngineProcessError`.
        closes_engine: :meth:`close` closes ``engine`` too (``False``: its rollout decides, e.g. vLLM's shared
            in-process engine stays for other rollouts).
    """

    holds_own_weights = True

    def __init__(self, engine: Engine, *, timeout: float = 3600.0, closes_engine: bool = True):
        self.engine, self.timeout, self.closes_engine = engine, timeout, closes_engine
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlflow-async-engine")
        self.tickets = itertools.count()
        self.jobs: dict[int, Future] = {}
        self.version, self.loaded_version = 0, 0
        self.loaded_from = engine.loaded_from
        self.idle_since = time.perf_counter()
        self.failure: EngineProcessError | None = None  # a failed weight load: every later job raises it

    @property
    def stats(self) -> dict[str, float]:
        return dict(self.engine.stats)

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> int:
        return self.submit_call(self._generate, prompts, params)

    def submit_call(self, work, *args) -> int:
        """Run ``work(*args)`` on the worker, after the jobs and weight loads asked for before; :meth:`result`
        gives its return value as ``Generated.completions``, with the weight version it ran under."""
        ticket = next(self.tickets)
        self.jobs[ticket] = self.worker.submit(self._run, work, args)
        return ticket

    def _run(self, work, args) -> Generated:
        if self.failure is not None:
            raise self.failure
        start = time.perf_counter()
        idle = start - self.idle_since
        out = work(*args)
        done = time.perf_counter()
        self.idle_since = done
        return Generated(out, self.loaded_version, done - start, idle)

    def _generate(self, prompts, params) -> list[list[Completion]]:
        completions = self.engine.generate(prompts, params)
        for per_prompt in completions:
            for c in per_prompt:
                c.extras["policy_version"] = self.loaded_version  # weights load on this thread: it cannot change here
        return completions

    def result(self, ticket: int) -> Generated:
        try:
            return self.jobs.pop(ticket).result(timeout=self.timeout)
        except FutureTimeout:
            raise EngineProcessError(f"{type(self.engine).__name__} gave no answer within {self.timeout:.0f} s") from None

    def cancel(self, ticket: int) -> None:
        job = self.jobs.pop(ticket, None)
        if job is not None:
            job.cancel()  # a job already running finishes; its answer is dropped

    def seed(self, *states) -> None:
        """A server samples with its own random state: nothing to set."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        return self.result(self.submit(prompts, params)).completions

    def load_weights(self, buckets: WeightBuckets, version: int | None = None) -> dict[str, float]:
        """Snapshot the weights now; the worker loads them after the jobs already queued."""
        start, totals = time.perf_counter(), {}
        snapshot = [(name, tensor.detach().clone()) for name, tensor in counted(buckets, totals)]
        version = self.version + 1 if version is None else version
        self.version = version

        def load():
            try:
                self.engine.load_weights([snapshot])
            except Exception as e:  # noqa: BLE001 - old weights must never be sampled as if they were new
                self.failure = EngineProcessError(f"loading weights version {version} into "
                                                  f"{type(self.engine).__name__} failed: {e}")
                raise
            self.loaded_version = version
            self.idle_since = time.perf_counter()  # loading is work, not waiting

        self.worker.submit(load)
        return totals | {"weight_sync/push_s": time.perf_counter() - start}

    def close(self) -> None:
        """Cancel the jobs not started, wait for the one running (an engine must not close under a running call),
        then close the engine (``closes_engine``)."""
        self.worker.shutdown(wait=True, cancel_futures=True)
        if self.closes_engine:
            self.engine.close()

