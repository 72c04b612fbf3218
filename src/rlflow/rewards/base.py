"""The Reward role: text in, one score per sample and a per-token reward tensor out.

A subclass implements :meth:`Reward.score`; :meth:`Reward.forward` turns the scores into
the two tensors the rest of the chain reads:

- ``SCORES``: ``[B]`` float32, one score per sample.
- ``TOKEN_REWARDS``: ``[B, R]`` float32, zeros except the sample's score on the LAST
  position where ``RESPONSE_MASK == 1`` (a row without any valid token gets it at
  position 0, so no score is ever dropped). verl places it at ``mask.sum() - 1``, which
  is the same for right-padded single-turn masks but wrong when tool/observation tokens
  put zeros in the middle of the mask.

:func:`run_calls` runs per-sample calls on threads with a per-call timeout (and optionally gives a batch up
when nothing finishes for a while); any reward that calls user code (functions, sandboxes, judges) can use it.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import math
import numbers
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict

from rlflow.data.keys import (
    DATA_SOURCE,
    EXTRA_INFO,
    REWARD_COLUMN,
    GROUND_TRUTH,
    RESPONSE_MASK,
    RESPONSE_TEXT,
    SCORES,
    TOKEN_REWARDS,
)
from rlflow.data.nontensor import column  # noqa: F401 - the rewards' reader of a batch's columns
from rlflow.module import BatchModule
from rlflow.rewards.pool import GAVE_UP


class RewardError(RuntimeError):
    """A reward function failed and the reward was told to raise (``on_error="raise"``)."""


class RewardWarning(UserWarning):
    """A sample's reward failed, timed out or was not finite and was scored 0.0 instead."""


def place_on_last_token(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` scores and a ``[B, R]`` mask -> ``[B, R]`` zeros with each score on its row's
    last position where ``mask == 1`` (position 0 if the row has none)."""
    batch, length = mask.shape
    out = torch.zeros(batch, length, dtype=torch.float32, device=mask.device)
    if length == 0:
        return out
    positions = torch.arange(length, device=mask.device).expand(batch, length)
    last = torch.where(mask.bool(), positions, torch.full_like(positions, -1)).amax(dim=1).clamp(min=0)
    out[torch.arange(batch, device=mask.device), last] = scores.to(out.device, torch.float32)
    return out


class Reward(BatchModule):
    """Base of every reward: implement ``score(batch) -> Tensor[B]``.

    ``self.stats`` (refreshed on every call) holds metrics for the logger:
    ``reward/errors``, ``reward/timeouts``, ``reward/non_finite`` (counts in this batch) and
    ``reward/extra/<key>`` (mean over the rows that have it) for every numeric column a
    subclass put in ``self.extras``. ``self.extras`` maps a key to ``B`` per-row values
    (``None`` where a row has none), e.g. the ``acc``/``pred`` a scorer returned; it is
    refreshed on every call too, and non-numeric columns are kept there for inspection.

    ``columns`` (names of ``self.extras``, default none) are also written to the batch, each as a [B]
    float tensor ``reward_column/<name>`` (``rlflow.data.keys.REWARD_COLUMN``), for an estimator that reads
    them (GDPO's per-key rewards); every row must have a number there, or the call fails naming the key.
    """

    @property
    def columns(self) -> tuple[str, ...]:
        return self.__dict__.get("_columns", ())

    @columns.setter
    def columns(self, names) -> None:  # its keys join out_keys, so the key-flow check sees them
        self._columns = tuple(names)
        self.out_keys = tuple(type(self).out_keys) + tuple(REWARD_COLUMN + n for n in self._columns)

    in_keys = (RESPONSE_TEXT, RESPONSE_MASK, DATA_SOURCE, GROUND_TRUTH, EXTRA_INFO)
    out_keys = (SCORES, TOKEN_REWARDS)

    def __init__(self) -> None:
        self.stats: dict[str, float] = {}
        self.extras: dict[str, list[Any]] = {}

    def score(self, batch: TensorDict) -> torch.Tensor:  # pragma: no cover - interface
        """Return one float per sample, shape ``[B]``. May count events in ``self.stats``."""
        raise NotImplementedError

    def forward(self, batch: TensorDict) -> TensorDict:
        self.stats = {"reward/errors": 0.0, "reward/timeouts": 0.0, "reward/non_finite": 0.0}
        self.extras = {}
        mask = batch.get(RESPONSE_MASK)
        scores = torch.as_tensor(self.score(batch), dtype=torch.float32).reshape(-1).to(mask.device)
        if scores.shape[0] != mask.shape[0]:
            raise ValueError(
                f"{type(self).__name__}.score returned {scores.shape[0]} scores for a batch of {mask.shape[0]}"
            )
        bad = ~torch.isfinite(scores)
        if bad.any():  # a last guard for subclasses that do not check their own scores
            rows = bad.nonzero().flatten().tolist()
            warnings.warn(f"{type(self).__name__}: non-finite score(s) at row(s) {rows}; scored 0.0", RewardWarning, 3)
            self.stats["reward/non_finite"] += len(rows)
            scores = torch.where(bad, torch.zeros_like(scores), scores)
        self.stats.update(self._extra_means())
        for name in self.columns:
            batch.set(REWARD_COLUMN + name, self._column(name).to(mask.device))
        batch.set(SCORES, scores)
        batch.set(TOKEN_REWARDS, place_on_last_token(scores, mask))
        return batch

    def setup(self, fabric) -> None:
        """Place what this reward runs (models) on the Trainer's devices; the Trainer calls it once.

        The default does nothing itself; rewards holding models override it (``ModelReward``).
        """

    def _column(self, name: str) -> torch.Tensor:
        values = self.extras.get(name)
        numbers_ = None if values is None else [None if v is None else _real(v) for v in values]
        if numbers_ is None or None in numbers_:
            have = "no such key" if values is None else "rows without a number there"
            raise KeyError(f"{type(self).__name__}: reward column {name!r} wanted (algorithm.gdpo_reward_keys), but "
                           f"the scorer's result has {have}; its extra keys: {sorted(self.extras)}. Make the "
                           f"reward function return a dict with 'score' and {name!r} for every sample")
        return torch.tensor(numbers_, dtype=torch.float32)

    def _extra_means(self) -> dict[str, float]:
        means = {}
        for key, values in self.extras.items():
            present = [_real(v) for v in values if v is not None]
            if not present or None in present:
                continue  # e.g. a predicted answer string: kept in self.extras, no metric
            finite = [v for v in present if math.isfinite(v)]
            if finite:
                means[f"reward/extra/{key}"] = sum(finite) / len(finite)
        return means


def _real(value: Any) -> float | None:
    """``float(value)`` for a number, bool, numpy scalar or 0-d tensor; ``None`` for anything else."""
    if isinstance(value, (str, bytes)):
        return None
    if isinstance(value, numbers.Real) or getattr(value, "shape", None) == ():
        try:
            return float(value)
        except (TypeError, ValueError):
            return None
    return None


def with_columns(reward: Reward, columns) -> Reward:
    """``reward`` that also writes its extras ``columns`` to the batch (:attr:`Reward.columns`: GDPO reads them);
    a tree's way to set them (``{_target_: rlflow.rewards.with_columns, reward: ..., columns: [...]}``)."""
    reward.columns = columns
    return reward


def setup_rewards(fabric, *roles: Any) -> None:
    """Call ``setup(fabric)`` once on every :class:`Reward` reachable from ``roles`` (:func:`rewards_in`)."""
    for reward in rewards_in(*roles):
        reward.setup(fabric)


def rewards_in(*roles: Any) -> list[Reward]:
    """Every :class:`Reward` reachable from ``roles``, once: the roles themselves and the objects they hold (a
    reward inside ``OverlongPenalty``, ``CombinedReward``, ``DynamicSampling`` or a ``Chain`` of estimator
    modules), found through instance attributes and lists of them."""
    seen: set[int] = set()
    todo, found = list(roles), []
    while todo:
        obj = todo.pop()
        if obj is None or id(obj) in seen or not isinstance(obj, (BatchModule, list, tuple)):
            continue
        seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            todo += list(obj)
            continue
        if isinstance(obj, Reward):
            found.append(obj)
        todo += [v for v in vars(obj).values() if isinstance(v, (BatchModule, list, tuple))]
    return found


class _Timeout(Exception):
    pass


RAMP_S = 0.002  # a further worker thread starts when calls are still waiting after this long


def run_calls(calls: list[Callable[[], Any]], timeout_s: float | None, workers: int,
              give_up_s: float | None = None) -> list[tuple[str, Any]]:
    """Run zero-argument calls on up to ``workers`` daemon threads, each limited to ``timeout_s``.

    Returns, per call in order, ``("ok", result)``, ``("error", exception)`` or ``("timeout", None)``.
    The limit counts from a call's start, not from its queueing. Python cannot kill a thread:
    a timed-out call's thread is abandoned (daemon, so it never blocks exit) and replaced. Awaitable
    results are awaited on a fresh event loop in the worker thread (cancelled at the limit), so this
    also works when the caller runs inside an event loop (Jupyter).

    Hung calls still cost ``timeout_s`` per wave of ``workers``; ``give_up_s`` bounds that: when no call has
    finished (with a result or an exception) for ``give_up_s`` seconds, the running calls are abandoned and
    the waiting ones never start, each coming back as ``("timeout", GAVE_UP)``. A batch of calls that all
    hang then ends after about ``give_up_s``, whatever its size, and leaves no more than ``workers`` threads
    behind per wave it ran.

    Threads start one at a time, a further one each ``RAMP_S`` while calls are still waiting: fast
    scorers (string matches: microseconds a call) finish on one thread without paying for the start-up
    and scheduling of the others; slow or waiting ones (judges, sandboxes) reach ``workers`` threads
    within a few milliseconds. The caller sleeps until the last result or the next deadline.
    """
    run = _CallThreads(calls, timeout_s)
    with run.cond:
        if calls:
            run.spawn()
        while run.left:
            now = time.monotonic()
            wait, replace = None, 0
            if timeout_s is not None:
                replace = run.expire(now)  # their threads are abandoned: new ones take their places
                wait = min((t0 + timeout_s - now for t0 in run.started.values()), default=timeout_s)
            if give_up_s is not None and run.left and now - run.last_done >= give_up_s:
                run.give_up()
                break
            for _ in range(replace):
                run.spawn()
            if give_up_s is not None:
                wait = min(wait if wait is not None else give_up_s, run.last_done + give_up_s - now)
            if run.pending and run.alive < workers:  # calls still waiting: one more thread every RAMP_S
                if now - run.last_start >= RAMP_S:
                    run.spawn()
                ramp = max(run.last_start + RAMP_S - now, 0.0)
                wait = ramp if wait is None else min(wait, ramp)
            if run.left:
                run.cond.wait(timeout=wait)
    return run.results  # type: ignore[return-value]


class _CallThreads:
    """The calls of one :func:`run_calls` and the daemon threads taking them, under one condition (``cond``)."""

    def __init__(self, calls: list[Callable[[], Any]], timeout_s: float | None):
        self.calls, self.timeout_s = calls, timeout_s
        self.results: list[tuple[str, Any] | None] = [None] * len(calls)
        self.pending, self.started, self.left = collections.deque(range(len(calls))), {}, len(calls)
        self.cond = threading.Condition()
        self.alive, self.last_start = 0, 0.0  # threads taking calls (not counting abandoned ones); the last start
        self.last_done = time.monotonic()  # when a call last finished (or the batch started)

    def worker(self) -> None:
        """Take waiting calls until none is left; a call that timed out meanwhile ends this (replaced) thread."""
        while True:
            with self.cond:
                if not self.pending:
                    self.alive -= 1
                    return
                i = self.pending.popleft()
                self.started[i] = time.monotonic()
            try:
                out = ("ok", _resolve(self.calls[i](), self.timeout_s))
            except _Timeout:
                out = ("timeout", None)
            except BaseException as exc:  # noqa: BLE001 - a scorer's failure is data, not a crash
                out = ("error", exc)
            with self.cond:
                if self.results[i] is not None:  # timed out meanwhile: this thread was replaced
                    return
                self.results[i], self.left, self.last_done = out, self.left - 1, time.monotonic()
                del self.started[i]
                if not self.left:
                    self.cond.notify()

    def spawn(self) -> None:
        self.alive, self.last_start = self.alive + 1, time.monotonic()
        threading.Thread(target=self.worker, daemon=True, name="rlflow-reward").start()

    def expire(self, now: float) -> int:
        """Time out the running calls past ``timeout_s``; returns how many threads that abandoned."""
        over = [i for i, t0 in self.started.items() if now - t0 >= self.timeout_s]
        for i in over:
            self.results[i], self.left = ("timeout", None), self.left - 1
            del self.started[i]
        self.alive -= len(over)
        return len(over)

    def give_up(self) -> None:
        """Every call not finished comes back as ``("timeout", GAVE_UP)``: the threads still running calls are
        abandoned, idle ones find nothing to do."""
        for i in [*self.started, *self.pending]:
            self.results[i] = ("timeout", GAVE_UP)
        self.started.clear()
        self.pending.clear()


def _resolve(result: Any, timeout_s: float | None) -> Any:
    """Await an awaitable result on a fresh event loop in this thread, cancelling it at the timeout."""
    if not inspect.isawaitable(result):
        return result

    async def wait() -> Any:
        task = asyncio.ensure_future(result)
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
        if not done:
            task.cancel()
            raise _Timeout
        return task.result()

    return asyncio.run(wait())
