"""ProcessEngine: any in-process engine (transformers, vLLM) run in a process of its own.

Asynchronous RL (:class:`rlflow.rollout.AsyncRollout`) samples the next batches while the trainer updates
on the current one. Here the engine lives in a child process: prompts go in and completions come back
through a pipe, and weights go through shared memory, so the trainer never waits for a weight transfer
and the engine never waits for an optimizer step.

Everything the child does happens in the order the trainer asked for it (one pipe, one job at a time):

    parent -> child                               child -> parent
    ("generate", ticket, prompts, params)         ("done", ticket, completions, version, gen_s, idle_s)
    ("weights", version, slot)                    ("loaded", version)   after copying slot ``slot`` in
    ("rng", torch, python, numpy states)          ("error", ticket or None, traceback text)
    ("close",)

so a batch submitted after the weights of version ``v`` were pushed is sampled with exactly those
weights. Weights are written into one of ``slots`` shared-memory copies of the parameters
(``version % slots``). A slot is written again only once the child has acknowledged loading the version
it held; with ``slots = max_staleness + 1`` that has always happened already in the trainer's loop, so a
push is one memory copy and never waits.

**Start.** The child is forked from the trainer (milliseconds; it inherits the model, the tokenizer and
the engine factory) unless CUDA is initialised in the parent, or the engine joins ``torch.distributed``
(vLLM) while the parent has a process group: a forked child could use neither. Then it is spawned (a
fresh interpreter that imports torch again, and receives a copy of the model). A forked child computes on
one thread by default: GNU OpenMP cannot start a new thread team after a fork.

**Failure.** A child that dies (killed, crashed, out of memory) is noticed within ``poll_s`` by the call
waiting on it. Up to ``max_restarts`` times in the engine's life a new child is started (one warning
naming the cause; ``stats["rollout/engine_restarts"]`` counts them), given the newest weights pushed
(the slot of the last version) and every job not answered yet, under the same tickets: no batch is lost
and none is answered twice (what the dead child sent before dying is read first). Jobs submitted under
older weights are then sampled with the newest and report that version; the new child's random stream
starts afresh. One death more raises :class:`EngineProcessError` with the exit code or signal, what to check
and the restarts already made. A child that stops answering raises after ``timeout`` seconds (it is
stopped, not restarted). The child exits on its own when the trainer's process is gone.
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import pickle
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait

import torch
import torch.multiprocessing as mp
from torch import nn

from rlflow.rollout.engines.base import Completion, Engine, SamplingParams, WeightBuckets, counted, tied_aliases

log = logging.getLogger("rlflow.rollout.engines")


class EngineProcessError(RuntimeError):
    """The generation process died, stopped answering, or failed; the message says which and how."""


@dataclass
class Generated:
    """One finished job: the completions and what the child reports about them."""

    completions: list[list[Completion]]
    version: int  # the weight version the child sampled with
    gen_s: float  # seconds the child spent generating
    idle_s: float  # seconds the child waited for work before this job


def default_start_method(uses_process_group: bool = False) -> str:
    """``fork`` where it is safe and cheap, else ``spawn``: when CUDA is initialised in the parent (a forked
    child cannot use it), or when the engine joins ``torch.distributed`` at start (vLLM does) and the parent
    already has a process group (a forked child would share its store's connection)."""
    inherited_group = uses_process_group and torch.distributed.is_available() and torch.distributed.is_initialized()
    if "fork" not in mp.get_all_start_methods() or torch.cuda.is_initialized() or inherited_group:
        return "spawn"
    return "fork"


class ProcessEngine(Engine):
    """Runs ``make_engine(model, tokenizer)`` in a child process and talks to it.

    Besides the :class:`~rlflow.rollout.engines.base.Engine` methods (``generate`` waits for its answer;
    ``load_weights`` returns as soon as the weights are in shared memory) it offers the pipelined calls
    :meth:`submit` / :meth:`result` / :meth:`cancel`, and :meth:`seed` for the child's random state.

    Args:
        make_engine: ``(model, tokenizer) -> Engine``, called in the child: an engine class (``HFEngine``), or
            ``AsyncRollout``'s factory, which binds there a copy of the rollout's engine (built without a model).
            With ``spawn`` it is pickled, so it must be importable (a class, or the factory with its engine, is).
        model: the model whose weights the engine starts from (version 0); the child gets its own copy.
        tokenizer: passed to ``make_engine``.
        slots: shared-memory copies of the weights (pushes in flight at once, see the module docstring).
        start_method: ``"fork"`` or ``"spawn"`` (default: :func:`default_start_method`).
        uses_process_group: the engine joins ``torch.distributed`` when it starts (vLLM); decides the default
            start method.
        threads: the child's torch threads (default: 1 when forked, the parent's count when spawned).
        device: where the child puts its copy (default: where ``model`` is).
        timeout: seconds a call may wait for an answer (engine start-up included) before the child is
            stopped and :class:`EngineProcessError` raised.
        poll_s: how often a waiting call checks that the child is alive.
        max_restarts: children started again after one died (see the module docstring); one death more
            ends the run with :class:`EngineProcessError`.
    """

    holds_own_weights = True

    def __init__(self, make_engine: Callable[[nn.Module, object], Engine], model: nn.Module, tokenizer, *,
                 slots: int = 2, start_method: str | None = None, uses_process_group: bool = False,
                 threads: int | None = None,
                 device: str | torch.device | None = None, timeout: float = 3600.0, poll_s: float = 0.5,
                 max_restarts: int = 2):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_engine_restarts must be an integer >= 0, got {max_restarts!r}")
        method = start_method or default_start_method(uses_process_group)
        ctx = mp.get_context(method)
        self.timeout, self.poll_s, self.method = timeout, poll_s, method
        self.aliases = tied_aliases(model)
        self.alias_of = {alias: name for name, names in self.aliases.items() for alias in names}
        # version 0 is the copy the child starts from; the slots receive the pushes that follow
        self.slots = [{name: p.detach().to("cpu", copy=True).share_memory_() for name, p in model.named_parameters()}
                      for _ in range(slots)]
        self.slot_version: list[int | None] = [None] * slots
        self.acked, self.version = 0, 0
        self.tickets = itertools.count()
        self.finished: dict[int, Generated | EngineProcessError] = {}
        self.cancelled: set[int] = set()
        self.pending: dict[int, tuple] = {}  # ticket -> (prompts, params) sent and not answered: a new child redoes them
        self.ready, self.loaded_from, self.stats = False, None, {}
        self.max_restarts, self.restarts = max_restarts, 0
        self.engine_name = getattr(make_engine, "__qualname__", type(make_engine).__name__)
        device = device or next(model.parameters()).device
        threads = threads or (1 if method == "fork" else torch.get_num_threads())
        self._child = (ctx, make_engine, model, tokenizer, threads, str(device))
        self._start_child()

    def _start_child(self) -> None:
        ctx, make_engine, model, tokenizer, threads, device = self._child
        child_model = model if self.method == "fork" else _cpu_copy(model)  # spawn: pickled, so never the trained one
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_serve, name="rlflow-engine", daemon=False, args=(
            child_conn, make_engine, child_model, tokenizer, self.slots, self.aliases, threads, device, os.getpid()))
        self.process.start()
        child_conn.close()
        self._finalizer = weakref.finalize(self, _stop, self.process, self.conn)

    # ------------------------------------------------------------------ pipelined calls
    def submit(self, prompts: list[list[int]], params: SamplingParams) -> int:
        """Queue a generation; returns its ticket (answers come in submission order)."""
        ticket = next(self.tickets)
        self.pending[ticket] = (prompts, params)
        self._send(("generate", ticket, prompts, params))
        return ticket

    def result(self, ticket: int) -> Generated:
        """Wait for ``ticket``'s completions (each tagged ``extras["policy_version"]``)."""
        deadline = time.monotonic() + self.timeout
        while ticket not in self.finished:
            self._receive(deadline, f"the completions of job {ticket}")
        answer = self.finished.pop(ticket)
        if isinstance(answer, EngineProcessError):
            raise answer
        return answer

    def cancel(self, ticket: int) -> None:
        """Forget ``ticket``: its completions are dropped when they arrive."""
        if self.finished.pop(ticket, None) is None and self.pending.pop(ticket, None) is not None:
            self.cancelled.add(ticket)  # the child still answers it (a restarted one does not: it is not resent)

    def seed(self, torch_state: torch.Tensor, python_state: tuple, numpy_state: tuple) -> None:
        """Set the child's global random state (the stream an HF engine samples from)."""
        self._send(("rng", torch_state, python_state, numpy_state))

    # ------------------------------------------------------------------ the Engine interface
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        return self.result(self.submit(prompts, params)).completions

    def load_weights(self, buckets: WeightBuckets, version: int | None = None) -> dict[str, float]:
        """Copy the buckets into the next shared slot and tell the child, which loads them before its next job.

        ``version`` tags the weights (default: one more than the last); completions sampled with them report it.
        """
        version = self.version + 1 if version is None else version
        slot = version % len(self.slots)
        start = time.perf_counter()
        held = self.slot_version[slot]
        deadline = time.monotonic() + self.timeout
        while held is not None and self.acked < held and self.process.is_alive():  # only when pushes outrun jobs
            self._receive(deadline, f"the child to load weights version {held} before slot {slot} is reused")
        waited = time.perf_counter() - start
        totals: dict[str, float] = {}
        tensors = self.slots[slot]
        for name, tensor in counted(buckets, totals):
            target = tensors.get(name)
            if target is None:
                if name in self.alias_of:
                    continue  # a tied parameter's second name: the same tensor arrived (or will) under its first
                raise KeyError(f"weight sync: the engine's model has no parameter '{name}'")
            target.copy_(tensor.detach())
        self.slot_version[slot], self.version = version, version
        self._send(("weights", version, slot))
        return totals | {"weight_sync/wait_s": waited, "weight_sync/push_s": time.perf_counter() - start - waited}

    def close(self) -> None:
        """Stop the child (asked to exit, then terminated, then killed)."""
        self._finalizer()

    # ------------------------------------------------------------------ plumbing
    def _send(self, message) -> None:
        """Send ``message``; to a dead child, restart it instead (the restart replays what this one carried:
        the newest weights and every unanswered job), or raise."""
        try:
            self.conn.send(message)
        except (BrokenPipeError, ConnectionResetError, OSError):
            self._restart(self._died("while sending it work"))

    def _receive(self, deadline: float, waiting_for: str) -> None:
        """Take one message from the child (waiting until ``deadline``), or raise if it died or went silent."""
        while True:
            if self.conn.poll():
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):
                    self._restart(self._died(f"while the trainer waited for {waiting_for}"))
                    return
                self._handle(message)
                return
            if not self.process.is_alive():
                self._restart(self._died(f"while the trainer waited for {waiting_for}"))
                return
            left = deadline - time.monotonic()
            if left <= 0:
                self.process.kill()  # it did not answer: asking it to exit would wait on it again
                self.process.join(timeout=5)
                self.close()
                raise EngineProcessError(f"the generation process (pid {self.process.pid}) gave no answer within "
                                         f"{self.timeout:.0f} s while the trainer waited for {waiting_for}; it was "
                                         "stopped (raise the timeout if generation is that slow)")
            wait([self.conn, self.process.sentinel], timeout=min(left, self.poll_s))

    def _handle(self, message) -> None:
        kind = message[0]
        if kind in ("done", "error") and message[1] is not None:
            self.pending.pop(message[1], None)
        if kind == "done":
            _, ticket, completions, version, gen_s, idle_s = message
            for per_prompt in completions:
                for c in per_prompt:
                    c.extras["policy_version"] = version
            if ticket not in self.cancelled:
                self.finished[ticket] = Generated(completions, version, gen_s, idle_s)
            self.cancelled.discard(ticket)
        elif kind == "loaded":
            self.acked = max(self.acked, message[1])
        elif kind == "ready":
            self.ready = True
        elif kind == "error":
            _, ticket, text = message
            error = EngineProcessError(f"the generation process (pid {self.process.pid}) failed"
                                       f"{'' if ticket is None else f' on job {ticket}'}:\n{text}")
            if ticket is None:
                raise error  # a failed start or weight load: every later answer would be suspect
            if ticket in self.cancelled:
                self.cancelled.discard(ticket)
            else:
                self.finished[ticket] = error

    def _died(self, when: str) -> EngineProcessError:
        self.process.join(timeout=5)
        code = self.process.exitcode
        how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exited with code {code}" if code is not None else "closed its pipe")
        stage = "" if self.ready else " before its engine was ready"
        return EngineProcessError(f"the generation process (pid {self.process.pid}) {how}{stage} {when} (its engine: "
                                  f"{self.engine_name})")

    def _restart(self, error: EngineProcessError) -> None:
        """The child died: start a new one with the newest weights and every unanswered job, or raise ``error``
        once ``max_restarts`` restarts were made."""
        while True:
            if self.restarts >= self.max_restarts:
                raise EngineProcessError(
                    f"{error}; restarted {self.restarts} time(s) in this run already (max_engine_restarts="
                    f"{self.max_restarts}): stopping. Check the machine's memory (the kernel log, `dmesg`, names the "
                    "processes the OOM killer ended) and the engine's own output in this run's log; resume from the "
                    "last checkpoint (in-flight samples are generated again)") from None
            self._drain()
            self.restarts += 1
            self.stats["rollout/engine_restarts"] = float(self.restarts)
            log.warning("%s; starting a new one with weights version %d and %d unanswered job(s) (restart %d of at "
                        "most %d, max_engine_restarts)", error, self.version, len(self.pending), self.restarts,
                        self.max_restarts)
            self._finalizer()
            self.ready = False
            self.cancelled &= set(self.pending)  # only resent jobs can still be answered
            self._start_child()
            try:
                if self.version:  # the slot of the newest version still holds it (it was written last)
                    self.conn.send(("weights", self.version, self.version % len(self.slots)))
                for ticket, (prompts, params) in self.pending.items():
                    self.conn.send(("generate", ticket, prompts, params))
                return
            except (BrokenPipeError, ConnectionResetError, OSError):
                error = self._died("while the restarted engine was given its weights and jobs")

    def _drain(self) -> None:
        """Read what a dead child sent before it died (answers that need not be generated again)."""
        try:
            while self.conn.poll():
                message = self.conn.recv()
                if message[0] != "error" or message[1] is not None:
                    self._handle(message)
        except (EOFError, OSError):
            pass


def _cpu_copy(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model).to("cpu")


def _stop(process, conn) -> None:
    """Ask the child to exit; terminate it, then kill it, if it does not."""
    if process.is_alive():
        try:
            conn.send(("close",))
        except OSError:
            pass
        process.join(timeout=10)
    if process.is_alive():
        process.terminate()
        process.join(timeout=5)
    if process.is_alive():
        process.kill()
        process.join(timeout=5)
    conn.close()


# ---------------------------------------------------------------------------------------- the child
def _exit_with(parent_pid: int) -> None:
    """A watchdog: the child ends within a second of the trainer's process (SIGKILL leaves no one to close it)."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="rlflow-engine-watchdog").start()


def _forget_inherited_engines() -> None:
    """A forked child must start engines of its own, never use copies of the parent's live ones."""
    import sys

    vllm_module = sys.modules.get("rlflow.rollout.engines.vllm")
    if vllm_module is not None:
        vllm_module._POOL.clear()


def _serve(conn, make_engine, model, tokenizer, slots, aliases: dict[str, list[str]], threads: int, device: str,
           parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    _exit_with(parent_pid)
    torch.set_num_threads(threads)
    gc.freeze()  # the inherited objects are never garbage: keep the collector off their pages
    try:
        _forget_inherited_engines()
        model = model.to(device)
        engine = make_engine(model, tokenizer)
    except BaseException:  # noqa: BLE001 - the parent reports it
        conn.send(("error", None, traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    loaded, idle_since = 0, time.perf_counter()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        kind = message[0]
        if kind == "close":
            engine.close()
            return
        try:
            if kind == "weights":
                _, version, slot = message
                tensors = slots[slot]
                # every name of a tied parameter (vLLM's in-place reload keeps a stale head otherwise)
                pairs = list(tensors.items()) + [(a, tensors[name]) for name, names in aliases.items() for a in names]
                engine.load_weights([pairs])
                loaded = version
                conn.send(("loaded", version))
            elif kind == "rng":
                _set_rng(*message[1:])
            elif kind == "generate":
                _, ticket, prompts, params = message
                start = time.perf_counter()
                completions = engine.generate(prompts, params)
                done = time.perf_counter()
                conn.send(("done", ticket, completions, loaded, done - start, start - idle_since))
                idle_since = time.perf_counter()
        except BaseException:  # noqa: BLE001 - the parent reports it
            ticket = message[1] if kind == "generate" else None
            try:
                conn.send(("error", ticket, traceback.format_exc()))
            except (OSError, pickle.PicklingError):
                return
            idle_since = time.perf_counter()


def _set_rng(torch_state, python_state, numpy_state) -> None:
    import random

    import numpy as np

    torch.set_rng_state(torch_state)
    random.setstate(python_state)
    np.random.set_state(numpy_state)
