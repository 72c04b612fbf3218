"""A pool of worker processes for CPU-heavy scorers, where a hung call costs its time-out, never the run.

Threads cannot run pure-Python scorers (math verification, parsers) in parallel (the GIL) and cannot be
stopped when one hangs. :class:`WorkerPool` keeps ``workers`` processes; each call gets a time limit
counted from its start, and a call over its limit has its process killed (SIGKILL) and replaced, so
the batch goes on. A worker that dies (segfault, ``os._exit``) fails its call, is counted and replaced.

Workers are forked from the caller by default (Linux): the scorer need not be importable or
picklable (lambdas, closures and functions loaded from a file work) and a new worker starts in
milliseconds, without importing torch again. Fork copies only the calling thread: scorers that use
torch or threads of their own should run on threads (``FunctionReward(processes=0)``) or use
``start_method="spawn"`` (the scorer must then be importable by name).
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import multiprocessing as mp
import os
import pickle
import signal
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

GAVE_UP = "gave up"  # the value of a ("timeout", ...) result that a batch gave up on (map's give_up_s)


class WorkerDied(RuntimeError):
    """The worker process running a call ended without answering (crash, ``os._exit``, killed)."""


class RemoteError(RuntimeError):
    """A call raised an exception that could not be sent back as it was; the message keeps its text."""


def _serve(fn: Callable[..., Any], conn: Connection) -> None:
    """Worker loop: receive ``(args, kwargs)``, answer ``("ok", result)`` or ``("error", exception)``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    # The objects inherited from the trainer (torch, transformers: millions) are never garbage here; leave
    # them out of the collector's passes, which would otherwise walk them (and copy their pages) again and again.
    gc.freeze()
    while True:
        try:
            args, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            result = fn(*args, **kwargs)
            if inspect.isawaitable(result):
                result = asyncio.run(_awaited(result))
            answer = ("ok", result)
        except BaseException as exc:  # noqa: BLE001 - the scorer's failure is data for the parent
            answer = ("error", exc)
        try:
            conn.send(answer)
        except Exception as exc:  # noqa: BLE001 - unpicklable result or exception
            kind = "result" if answer[0] == "ok" else "exception"
            conn.send(("error", RemoteError(f"{kind} could not be sent back: {type(exc).__name__}: {exc}; "
                                            f"{kind}: {answer[1]!r:.200}")))


async def _awaited(result):
    return await result


class _Worker:
    def __init__(self, ctx, fn):
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_serve, args=(fn, child), daemon=True, name="rlflow-reward-worker")
        self.process.start()
        child.close()
        self.task: int | None = None
        self.started = 0.0

    def kill(self) -> None:
        if self.process.is_alive():
            try:
                os.kill(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.join(timeout=5)
        self.conn.close()


class WorkerPool:
    """``workers`` processes running ``fn``; :meth:`map` returns ``(status, value)`` per call, in order.

    Status is ``"ok"`` (value: the result), ``"error"`` (the exception; :class:`WorkerDied` when the
    process ended) or ``"timeout"`` (value ``None``; the worker was killed and replaced). The pool
    starts lazily and lives until :meth:`close` (or garbage collection, or interpreter exit).
    ``stats`` counts ``restarts`` (workers replaced) over the pool's life.
    """

    def __init__(self, fn: Callable[..., Any], workers: int, *, start_method: str | None = None):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        method = start_method or ("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        if method != "fork":
            try:
                pickle.dumps(fn)
            except Exception as e:  # noqa: BLE001
                raise TypeError(f"start_method={method!r} sends the scorer to each worker by pickling, and "
                                f"{fn!r} cannot be pickled ({e}); use a module-level function or "
                                "start_method='fork'") from None
        self.fn, self.size, self.ctx = fn, workers, mp.get_context(method)
        self.workers: list[_Worker] = []
        self.restarts = 0
        self._finalizer = weakref.finalize(self, _close_all, self.workers)

    def _spawn(self) -> _Worker:
        return _Worker(self.ctx, self.fn)

    def map(self, calls: Sequence[tuple[tuple, dict]], timeout_s: float | None,
            give_up_s: float | None = None) -> list[tuple[str, Any]]:
        """Run ``fn(*args, **kwargs)`` for each ``(args, kwargs)``; each call may run ``timeout_s`` seconds.

        With ``give_up_s``, when no call has answered for that long, the running calls' workers are killed
        and replaced and the waiting calls never start: each comes back as ``("timeout", GAVE_UP)`` (so a
        batch of hanging calls costs about ``give_up_s``, not ``timeout_s`` per wave of workers).
        """
        while len(self.workers) < min(self.size, max(1, len(calls))):
            self.workers.append(self._spawn())
        results: list[tuple[str, Any] | None] = [None] * len(calls)
        pending, left = deque(range(len(calls))), len(calls)
        last_done = time.monotonic()  # when a call last answered (or the batch started)
        while left:
            for w in self.workers:  # hand out work
                if w.task is None and pending:
                    i = pending.popleft()
                    try:
                        w.conn.send(calls[i])
                    except Exception as exc:  # noqa: BLE001 - arguments that cannot be pickled
                        results[i], left = ("error", exc), left - 1
                        continue
                    w.task, w.started = i, time.monotonic()
            busy = [w for w in self.workers if w.task is not None]
            if not busy:
                continue
            wait_s, now = None, time.monotonic()
            if timeout_s is not None:
                wait_s = max(0.0, min(w.started + timeout_s - now for w in busy))
            if give_up_s is not None:
                wait_s = max(0.0, min(wait_s if wait_s is not None else give_up_s, last_done + give_up_s - now))
            ready = wait([w.conn for w in busy] + [w.process.sentinel for w in busy], timeout=wait_s)
            now = time.monotonic()
            for idx, w in enumerate(list(self.workers)):
                if w.task is None:
                    continue
                answer = None
                if w.conn in ready or w.process.sentinel in ready:
                    try:
                        answer = w.conn.recv() if w.conn.poll() else None
                    except (EOFError, OSError):
                        answer = None
                    if answer is None and not w.process.is_alive():
                        code = w.process.exitcode
                        answer = ("error", WorkerDied(f"the worker process ended (exit code {code}) during the call"))
                        self._replace(idx)
                elif timeout_s is not None and now - w.started >= timeout_s:
                    answer = ("timeout", None)
                    self._replace(idx)
                if answer is not None:
                    results[w.task], left = answer, left - 1
                    w.task = None
                    if answer[0] != "timeout":
                        last_done = now
            if give_up_s is not None and left and now - last_done >= give_up_s:
                for idx, w in enumerate(list(self.workers)):
                    if w.task is not None:  # hung: kill it, as at its own time-out
                        results[w.task], w.task = ("timeout", GAVE_UP), None
                        self._replace(idx)
                for i in pending:
                    results[i] = ("timeout", GAVE_UP)
                break
        return results  # type: ignore[return-value]

    def _replace(self, idx: int) -> None:
        self.workers[idx].kill()
        self.workers[idx] = self._spawn()
        self.restarts += 1

    def close(self) -> None:
        """Stop every worker now."""
        self._finalizer()


def _close_all(workers: list[_Worker]) -> None:
    for w in workers:
        w.kill()
    workers.clear()
