"""Faults across processes: name the rank that died and the phase every rank was in, instead of a bare
collective error or a hang until the collective timeout.

Each rank of a multi-process run (torchrun on one or several nodes, or Fabric's own launcher) publishes a
heartbeat every ``interval`` seconds to the c10d store its processes met through (``MASTER_ADDR:MASTER_PORT``):
a counter, its phase and its step. A thread on every rank reads the others' heartbeats. Then:

* a peer whose heartbeat has not moved for ``RLFLOW_HEARTBEAT_TIMEOUT`` seconds (default 10) is dead or frozen
  (a peer not heard from yet gets ``RLFLOW_HEARTBEAT_STARTUP`` seconds, default 600: ranks reach ``fit`` at
  different times, one may still be loading a model or starting its engine; one that dies meanwhile is still
  named, by the exception path below, as soon as a collective with it fails):
  this rank prints which peer, the phase it and this rank were in, and exits with code 1, rather than waiting
  in a collective for its timeout (NCCL's is 10 minutes). torchrun then stops the rest of its node.
* an uncaught exception (gloo's "Connection reset by peer" right after a peer died, or a collective timeout)
  is followed by the same report, after waiting a few heartbeats to see which peers went silent: so a
  timeout says whether the others were generating, scoring, updating or syncing weights, and names the live
  ranks that were in another phase than this one (they never reached the collective: e.g. a hung reward).
  (NCCL's own watchdog may abort the process at its time-out without a Python exception: then it is this
  rank the others report, as dead, with its phase.)

The phase is the timing phase (``timing_s/<phase>``: ``gen`` and ``reward``, which the experience stream
marks, ``old_log_prob``, ``update_actor``, ``update_weights``, ..., which :class:`rlflow.trainer.metrics.Timer`
marks; :mod:`rlflow.phases` keeps them) or ``save``. A rank
that left ``fit`` normally says so and is not counted as dead. Every rank reads every other's key each
interval, so the interval grows with the world size (one store serves them all).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time

from rlflow.phases import _failed, _stack, current_phase, phase  # noqa: F401 - phase: this module's API too

TIMEOUT_ENV = "RLFLOW_HEARTBEAT_TIMEOUT"
STARTUP_ENV = "RLFLOW_HEARTBEAT_STARTUP"
INTERVAL = 0.5  # seconds between beats for up to 64 ranks
WHAT = {"gen": "generation", "reward": "reward", "ref": "reference log-probs", "old_log_prob": "old log-probs",
        "values": "critic values", "adv": "advantages", "balance": "batch balancing", "update_critic": "critic update",
        "update_actor": "policy update", "update_weights": "weight sync to the rollout engine", "save": "checkpoint save",
        "fit": "between phases: data loading, validation, logging, callbacks", "setup": "setup"}


def heartbeat_timeout(name: str = TIMEOUT_ENV, default: str = "10") -> float:
    value = os.environ.get(name, default)
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise ValueError(f"{name}={value!r}: seconds without a heartbeat before a rank counts as dead, > 0")
    return seconds


def startup_timeout() -> float:
    """Seconds a peer not heard from yet may take to send its first heartbeat (``RLFLOW_HEARTBEAT_STARTUP``)."""
    return heartbeat_timeout(STARTUP_ENV, "600")


def is_timeout(error: BaseException | None) -> bool:
    """A collective's time-out (gloo: "Timed out waiting 3000ms for recv"; a c10d store: "timeout")."""
    return error is not None and (isinstance(error, TimeoutError)
                                  or any(w in str(error).lower() for w in ("timed out", "timeout")))


def describe(state: dict | None) -> str:
    if state is None:
        return "no heartbeat yet"
    name = state["phase"]
    what = WHAT.get(name.removeprefix("failed in "))
    where = f"'{name}'" + (f" ({what})" if what else "")
    return f"in phase {where} after {state['step']} finished step(s), on {state['host']} (pid {state['pid']})"


class Heartbeat:
    """This rank's beat and its view of the others'; :meth:`start` runs both in a daemon thread."""

    def __init__(self, store, rank: int, world: int, trainer=None, timeout: float | None = None):
        self.store, self.rank, self.world, self.trainer = store, rank, world, trainer
        self.timeout = heartbeat_timeout() if timeout is None else timeout
        self.startup = max(self.timeout, startup_timeout())
        self.interval = INTERVAL * max(1, world // 64)
        self.count, self.done = 0, False
        self.started = time.monotonic()
        self.peers = {r: {"n": None, "moved": self.started, "state": None} for r in range(world) if r != rank}
        self.store_error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlflow-heartbeat", daemon=True)

    def state(self) -> dict:
        step = getattr(self.trainer, "global_step", 0)
        return {"n": self.count, "phase": "done" if self.done else current_phase(), "step": step,
                "host": socket.gethostname(), "pid": os.getpid()}

    def beat(self) -> None:
        self.count += 1
        self.store.set(f"hb/{self.rank}", json.dumps(self.state()))

    def observe(self) -> None:
        now = time.monotonic()
        for r, peer in self.peers.items():
            key = f"hb/{r}"
            if peer["n"] is None and not self.store.check([key]):
                continue  # not started yet (its own grace period is the timeout from our start)
            state = json.loads(self.store.get(key))
            if state["n"] != peer["n"]:
                peer.update(n=state["n"], moved=now)
            peer["state"] = state

    def silent(self, at_least: float, first_beat: float | None = None) -> list[int]:
        """Peers (not done) whose heartbeat has not moved for ``at_least`` seconds (``first_beat`` for a peer not
        heard from yet, if given), longest silent first."""
        now = time.monotonic()
        quiet = [r for r, p in self.peers.items()
                 if now - p["moved"] >= (at_least if p["n"] is not None or first_beat is None else first_beat)
                 and (p["state"] or {}).get("phase") != "done"]
        return sorted(quiet, key=lambda r: self.peers[r]["moved"])

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
                self.observe()
                self.store_error = None
            except Exception as e:  # the store is gone (its host died) or unreachable: report after the timeout
                self.store_error = self.store_error or f"{type(e).__name__}: {e}"
            if self.done:
                return
            dead = self.silent(self.timeout, first_beat=self.startup)
            if dead:
                print(self.report(dead, f"no heartbeat for more than {self.timeout:g} s ({TIMEOUT_ENV})"),
                      file=sys.stderr, flush=True)
                os._exit(1)  # the main thread may be inside a collective that would only end at its timeout

    def report(self, dead: list[int], why: str, timed_out: bool = False) -> str:
        now = time.monotonic()
        lines = [f"[rlflow] rank {r} stopped: {why}; last heard {now - self.peers[r]['moved']:.1f} s ago "
                 f"{describe(self.peers[r]['state'])}" for r in dead]
        if not dead and timed_out:  # the ranks a collective waited for are alive: name those doing something else
            mine = current_phase().removeprefix("failed in ")
            elsewhere = [f"rank {r} is {describe(p['state'])}" for r, p in self.peers.items()
                         if (p["state"] or {}).get("phase", "").removeprefix("failed in ") != mine]
            lines.append(f"[rlflow] a collective timed out on this rank in phase '{mine}' while every other rank "
                         "still sends heartbeats; " + ("; ".join(elsewhere) + ": not at that collective. Look there "
                         "(a reward function, tool or generation that hangs: give it a time-out, e.g. "
                         "reward_model.timeout_s)" if elsewhere else "each in the same phase: the collective itself, "
                         "or the network between ranks, is slower than the time-out"))
        elif not dead:
            lines.append("[rlflow] every other rank is still sending heartbeats: the failure is on this rank, or "
                         "in the network between ranks")
        if self.store_error:
            lines.append(f"[rlflow] the c10d store ({os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}) "
                         f"is unreachable ({self.store_error}): the node that hosts it (node 0's torchrun agent) "
                         "may be down")
        lines.append(f"[rlflow] this rank ({self.rank}) was {describe(self.state())}")
        others = [f"rank {r} {describe(p['state'])}" for r, p in self.peers.items() if r not in dead]
        if others:
            lines.append("[rlflow] the other ranks: " + "; ".join(others))
        lines.append("[rlflow] stopping this rank; start the run again with trainer.resume_mode=auto "
                     "(Trainer(resume='auto')) to continue from the last checkpoint")
        return "\n".join(lines)

    def explain(self, wait: float, error: BaseException | None = None) -> str:
        """After an exception (``error``): wait up to ``wait`` s for peers to fall silent, then the report.

        torchrun's agent may send SIGTERM meanwhile (its peer node ended); it waits 30 s before SIGKILL,
        so the wait goes on: a few seconds to name the dead rank."""
        main = threading.current_thread() is threading.main_thread()  # signal handlers are the main thread's
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN) if main else None
        try:
            suspect = max(4 * self.interval, 1.0)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and not self.silent(suspect):
                time.sleep(self.interval / 2)
            dead = self.silent(suspect)
        finally:
            if main:
                signal.signal(signal.SIGTERM, previous)
        return self.report(dead, "its heartbeat stopped (the process died or froze)", is_timeout(error))

    def start(self) -> None:
        self.beat()
        self._thread.start()

    def stop(self) -> None:
        """This rank left ``fit`` normally: say so (peers do not count it as dead) and stop beating."""
        self.done = True
        try:
            self.beat()
        except Exception:
            pass
        self.join()

    def join(self) -> None:
        """End the thread before the interpreter does: a daemon thread still inside a store call at exit
        aborts the process ("terminate called without an active exception")."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.timeout)


class Watchdog:
    """Fabric callback (a default of every Trainer): the heartbeat from ``on_fit_start`` to ``on_fit_end`` of a
    multi-process run, and the report after an uncaught exception."""

    def __init__(self):
        self.heartbeat: Heartbeat | None = None
        self._hook = None

    def on_fit_start(self, trainer) -> None:
        import torch.distributed as dist

        del _failed[:]  # a failure an earlier fit in this process caught is not this fit's
        _stack[:] = ["fit"]
        if trainer.fabric.world_size == 1 or not dist.is_initialized() or "MASTER_PORT" not in os.environ:
            return
        from datetime import timedelta

        # a client of its own (the default group's store is torch's private object): used by this thread only;
        # a store call that blocks gives up within the heartbeat timeout, so a lost store host is reported too
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        timeout = heartbeat_timeout()
        store = dist.PrefixStore(f"rlflow/{attempt}/", dist.TCPStore(
            os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]), is_master=False,
            timeout=timedelta(seconds=max(timeout / 2, 1.0))))
        self.heartbeat = Heartbeat(store, trainer.fabric.global_rank, trainer.fabric.world_size, trainer, timeout)
        self.heartbeat.start()
        self._hook = sys.excepthook
        sys.excepthook = self._excepthook

    def _excepthook(self, kind, value, tb) -> None:
        (self._hook or sys.__excepthook__)(kind, value, tb)
        if self.heartbeat is not None and not issubclass(kind, KeyboardInterrupt):
            print(self.heartbeat.explain(wait=max(3.0, 8 * self.heartbeat.interval), error=value), file=sys.stderr,
                  flush=True)
            self.heartbeat.join()

    def on_fit_end(self, trainer) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
            sys.excepthook = self._hook or sys.__excepthook__
            self.heartbeat = None
        _stack[:] = ["setup"]
