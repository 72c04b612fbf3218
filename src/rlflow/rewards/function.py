"""Any Python callable as a Reward: verl's ``compute_score``, batch functions, simple functions.

Forms, detected once from the signature (or chosen with ``form=``):

- ``"verl"``: ``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` per
  sample. Chosen when a parameter is named ``data_source`` (called by keyword), or for a
  3-4 argument function that fits no other form (called positionally in that order).
- ``"batch"``: ``compute_reward(responses, ground_truths) -> B results``, one call per batch.
  Chosen when the first parameter has a plural name (``responses``, ``solution_strs``,
  ``completions``, ...) or one is named ``ground_truths``; ``data_sources=`` and
  ``extra_infos=`` are passed too when the function names them.
- ``"sample"``: ``fn(response, ground_truth)`` per sample (``extra_info=`` too if named).
- ``"trl"``: TRL's ``fn(prompts, completions, **columns) -> list[float]``, one call per batch. Chosen when
  a parameter is named ``completions`` and the function takes ``prompts`` or ``**kwargs``. Keywords:
  ``prompts`` (rendered prompt texts), ``completions`` (response texts), ``completion_ids`` (token ids),
  ``ground_truth``, ``data_source``, ``extra_info`` and every key the rows' ``extra_info`` dicts all
  share (TRL passes dataset columns by name); only the names the function takes (all with ``**kwargs``).
  ``None`` in the result means "does not apply to this sample" (TRL): scored 0.0, counted in
  ``reward/not_applicable``, not an error.

A function that names ``rm_score`` (per-sample forms) or ``rm_scores`` (batch forms) also gets the reward
model's score of each sample, from the batch's ``rm_scores`` (see :class:`~rlflow.rewards.WithRMScore`; verl
lets a custom function query the reward model).

A result (per sample, or each item of a batch result) is a number, a bool, or a dict with
``"score"`` whose other keys go to ``self.extras`` (numeric ones are averaged into
``stats["reward/extra/<key>"]``). Coroutine functions and awaitable results are awaited.

Per-sample calls run on ``max_workers`` daemon threads. A call running longer than
``timeout_s`` (counted from its start) is abandoned: its thread is left to finish alone
(an awaited coroutine is cancelled). A batch during which no call finishes for twice
``timeout_s`` gives up on its remaining calls (the running ones are abandoned, the waiting ones
never start), so a scorer that hangs on every sample costs a step about ``2 * timeout_s``, not
``timeout_s`` per wave of ``max_workers`` calls. For the batch forms ``timeout_s`` limits the one
batch call. With ``processes=N`` the calls run in a :class:`~rlflow.rewards.pool.WorkerPool` of N
processes instead: CPU-heavy scorers run in parallel, and a call over its time-out (or given up) has
its process killed and replaced (a thread cannot be stopped).

Nothing fails silently: a call that raises, times out, or returns anything but a finite
number is, with ``on_error="zero"``, scored 0.0, counted in ``stats`` (``reward/errors``,
``reward/timeouts``, ``reward/non_finite``) and reported by a :class:`RewardWarning` naming
the rows, the first row's data_source and the cause (one warning per distinct cause per call).
A batch in which every sample failed (a function that raises on everything, a batch call that
failed, calls that all timed out) raises a :class:`RewardError` instead, as verl stops: there is
nothing to learn from all zeros. With ``on_error="raise"`` any failure raises it. The error names
the first failing row, its data_source, the function and the cause, chained to the function's exception.
"""

from __future__ import annotations

import collections
import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict

from rlflow.data.keys import (DATA_SOURCE, EXTRA_INFO, GROUND_TRUTH, PROMPT_TEXT, RESPONSE_IDS, RESPONSE_MASK,
                              RESPONSE_TEXT, RM_SCORES)
from rlflow.rewards.base import GAVE_UP, Reward, RewardError, RewardWarning, column, run_calls
from rlflow.rewards.pool import WorkerPool

FORMS = ("verl", "sample", "batch", "trl")
BATCH_FORMS = ("batch", "trl")
TRL_COLUMNS = ("prompts", "completions", "completion_ids", "ground_truth", "data_source", "extra_info")
BATCH_NAMES = frozenset({"responses", "ground_truths", "solution_strs", "solutions", "completions", "texts"})
_COUNTERS = {"error": "reward/errors", "timeout": "reward/timeouts", "non_finite": "reward/non_finite"}
_SUPPORTED = (
    "compute_score(data_source, solution_str, ground_truth, extra_info=None), "
    "compute_reward(responses, ground_truths) -> list of B scores, fn(response, ground_truth), "
    "TRL's fn(prompts, completions, **kwargs) -> list of B scores"
)


class FunctionReward(Reward):
    """Score samples with ``fn`` (any form above, sync or async).

    Args:
        fn: the reward function.
        timeout_s: seconds one sample call (or the batch call) may run; ``None``: no limit. A batch in which
            no call finishes for ``2 * timeout_s`` gives up on the rest.
        on_error: ``"zero"`` (score 0.0, count, warn; a batch where every sample failed still raises) or
            ``"raise"`` (:class:`RewardError` at any failure).
        max_workers: threads running per-sample calls at once.
        name: the name used in messages and metrics; defaults to ``fn.__name__``.
        form: ``"verl"``, ``"batch"``, ``"sample"`` or ``"trl"`` to skip detection.
        processes: 0 (default): calls run on threads; N >= 1: in a pool of N worker processes
            (:class:`~rlflow.rewards.pool.WorkerPool`), for CPU-heavy scorers and scorers that may hang.
        start_method: how the pool starts its workers (default ``"fork"`` on Linux; see the pool's docs).
    """

    thread_safe = True  # a CombinedReward may run it beside other rewards

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        timeout_s: float | None = 30.0,
        on_error: str = "zero",
        max_workers: int = 4,
        name: str | None = None,
        form: str | None = None,
        processes: int = 0,
        start_method: str | None = None,
    ) -> None:
        super().__init__()
        if not callable(fn):
            raise TypeError(f"FunctionReward needs a callable, got {type(fn).__name__}")
        if on_error not in ("zero", "raise"):
            raise ValueError(f"on_error must be 'zero' or 'raise', got {on_error!r}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s}")
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if processes < 0:
            raise ValueError(f"processes must be >= 0 (0: threads), got {processes}")
        self.fn, self.timeout_s, self.on_error, self.max_workers = fn, timeout_s, on_error, max_workers
        self.name = name or _fn_name(fn)
        self.form, self._arguments = _plan(fn, form, self.name)
        if self.form == "trl":
            self.in_keys = (*Reward.in_keys, PROMPT_TEXT, RESPONSE_IDS)
        names = _parameter_names(fn)
        self.rm_argument = ("rm_scores" if self.form in BATCH_FORMS else "rm_score") if (
            {"rm_score", "rm_scores"} & names) else None
        if self.rm_argument:
            self.in_keys = (*self.in_keys, RM_SCORES)
        self.processes, self.start_method, self._pool = processes, start_method, None
        if processes:
            self._pool = WorkerPool(self._call, processes, start_method=start_method)

    def __repr__(self) -> str:
        where = f", processes={self.processes}" if self.processes else ""
        return f"FunctionReward({self.name}, form={self.form!r}, timeout_s={self.timeout_s}{where})"

    def close(self) -> None:
        """Stop the worker processes (``processes >= 1``); a later call starts new ones."""
        if self._pool is not None:
            self._pool.close()

    @property
    def give_up_s(self) -> float | None:
        """Seconds without any call finishing after which a batch gives up on its remaining calls: twice
        ``timeout_s``, time for hung calls to time out and for the calls that replace them to show whether
        they hang too (a single hung sample never costs the others)."""
        return None if self.timeout_s is None else 2 * self.timeout_s

    def _run(self, rows: list[tuple]) -> list[tuple[str, Any]]:
        """``self._call(*row)`` for each row: on threads, or in the worker processes."""
        if self._pool is not None:
            return self._pool.map([(row, {}) for row in rows], self.timeout_s, self.give_up_s)
        return run_calls([functools.partial(self._call, *row) for row in rows], self.timeout_s, self.max_workers,
                         self.give_up_s)

    def score(self, batch: TensorDict) -> torch.Tensor:
        keys = (DATA_SOURCE, RESPONSE_TEXT, GROUND_TRUTH, EXTRA_INFO) + ((RM_SCORES,) if self.rm_argument else ())
        rows = list(zip(*(column(batch, k) for k in keys)))
        if self.form in BATCH_FORMS:
            results = self._batch_results(rows, batch)
        else:
            results = self._run(rows)
        scores, failures = [], []
        for i, (status, value) in enumerate(results):
            if status == "ok" and value is None and self.form == "trl":  # TRL: does not apply to this sample
                self.stats["reward/not_applicable"] = self.stats.get("reward/not_applicable", 0.0) + 1
                value = 0.0
            if status == "ok":
                try:
                    value = _to_score(value, self.extras, i, len(rows))
                except _BadResult as bad:
                    status, value = bad.kind, bad
            if status != "ok":
                failures.append((i, status, _cause(status, value, self.timeout_s, self.give_up_s), value))
                value = 0.0
            scores.append(value)
        sources = [row[0] for row in rows]
        if rows and len(failures) == len(rows) and self.on_error == "zero":
            message, exc = self._all_failed(failures, sources)
            raise RewardError(message) from exc
        self._report(failures, sources)
        return torch.tensor(scores, dtype=torch.float32)

    def _call(self, *row: Any) -> Any:
        args, kwargs = self._arguments(*row[:4])
        if len(row) > 4:  # the reward model's score(s): rm_score= / rm_scores=
            kwargs[self.rm_argument] = row[4]
        return self.fn(*args, **kwargs)

    def _batch_results(self, rows: list[tuple], batch: TensorDict) -> list[tuple[str, Any]]:
        """One call for the whole batch; if that call fails, every row fails with it."""
        n = len(rows)
        columns = [list(c) for c in zip(*rows)] or [[]] * (5 if self.rm_argument else 4)
        if self.form == "trl":
            trl = trl_columns(batch, *columns[:4])
            columns = [trl | ({"rm_scores": columns[4]} if self.rm_argument else {})]
        [(status, value)] = self._run([tuple(columns)]) if self._pool else run_calls(
            [functools.partial(self._call, *columns)], self.timeout_s, 1)
        if status == "ok":
            if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__len__"):
                status, value = "error", _BadResult("error", f"returned {type(value).__name__}, not {n} results")
            elif len(value) != n:
                status, value = "error", _BadResult("error", f"returned {len(value)} results for a batch of {n}")
            else:
                return [("ok", v) for v in value]
        cause = f"(batch form) {_cause(status, value, self.timeout_s)}"
        if self.on_error == "raise":
            raise RewardError(f"reward function {self.name!r} {cause}") from _chained(value)
        if not n:
            return []
        # the one call failed, so every row did: stop, as for a per-sample function that fails on every row
        message, exc = self._all_failed([(0, status, _cause(status, value, self.timeout_s), value)], [], n)
        raise RewardError(message) from exc

    def _all_failed(self, failures: list[tuple], sources: list[Any], n: int | None = None
                    ) -> tuple[str, BaseException | None]:
        """Every sample of the batch failed: the message of the error that stops the run (verl stops at a reward
        function's exception; training on all zeros would only hide it) and the exception to chain. It names the
        first row that raised (else the first failing row) and its cause; without ``sources``, the batch call."""
        row, _, cause, value = next((f for f in failures if _chained(f[3]) is not None), failures[0])
        n = len(failures) if n is None else n
        hint = ""
        if all(status == "timeout" for _, status, _, _ in failures):
            hint = (f". Every call timed out or was given up: the function hangs, or needs more than "
                    f"timeout_s={self.timeout_s} s a call (reward_model.timeout_s in a config)")
        where = f"row {row} (data_source={sources[row]!r})" if sources else "the batch call"
        message = (f"reward function {self.name!r} failed on every sample of the batch ({n} of {n}), so there is "
                   f"no reward to learn from; first: {where}: {cause}{hint}")
        return message, _chained(value)

    def _report(self, failures: list[tuple], sources: list[Any]) -> None:
        if failures and self.on_error == "raise":
            row, _, cause, value = failures[0]
            where = f"row {row} (data_source={sources[row]!r})"
            raise RewardError(f"reward function {self.name!r} failed on {where}: {cause}") from _chained(value)
        groups: dict[str, list[int]] = collections.defaultdict(list)
        for row, status, cause, _ in failures:
            self.stats[_COUNTERS[status]] += 1
            groups[cause].append(row)
        for cause, bad in groups.items():
            warnings.warn(
                f"reward function {self.name!r}: {len(bad)} sample(s) {cause}; scored 0.0. "
                f"First: row {bad[0]} (data_source={sources[bad[0]]!r}); rows {bad[:20]}",
                RewardWarning,
                stacklevel=5,  # the line that called the reward
            )


class _BadResult(Exception):
    """A call returned, but not a usable score; ``kind`` is ``"error"`` or ``"non_finite"``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _to_score(value: Any, extras: dict[str, list], row: int, n: int) -> float:
    """A result -> a finite float; a dict's other keys are stored in ``extras[key][row]``."""
    if isinstance(value, dict):
        if "score" not in value:
            raise _BadResult("error", f"returned a dict without 'score' (keys {sorted(map(str, value))})")
        for key, extra in value.items():
            if key != "score":
                extras.setdefault(key, [None] * n)[row] = extra
        value = value["score"]
    try:
        if isinstance(value, (str, bytes)) or value is None:
            raise TypeError
        score = float(value)
    except (TypeError, ValueError):
        kind = type(value).__name__
        raise _BadResult("error", f"returned {kind} {value!r:.60}, not a number, bool or dict with 'score'") from None
    if score != score or abs(score) == float("inf"):
        raise _BadResult("non_finite", f"returned non-finite score {score}")
    return score


def _cause(status: str, value: Any, timeout_s: float | None, give_up_s: float | None = None) -> str:
    if status == "timeout" and value == GAVE_UP:
        return (f"not scored: no call of the batch finished for {give_up_s} s (2 x timeout_s), so the batch gave "
                "up on its remaining calls")
    if status == "timeout":
        return f"timed out after {timeout_s} s"
    return str(value) if isinstance(value, _BadResult) else f"raised {type(value).__name__}: {value}"


def _chained(value: Any) -> BaseException | None:
    """The function's own exception, to chain under a RewardError."""
    return value if isinstance(value, BaseException) and not isinstance(value, _BadResult) else None


def _fn_name(fn: Any) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__


def _parameter_names(fn: Callable[..., Any]) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _plan(fn: Callable[..., Any], form: str | None, name: str) -> tuple[str, Callable[..., tuple]]:
    """Pick the form -> ``(form, arguments)``; ``arguments(data_source, text, gt, extra) -> (args, kwargs)``."""
    if form is not None and form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        if form is None:
            raise TypeError(f"cannot read the signature of {name}; pass form='verl', 'batch' or 'sample'") from None
        sig = None
    params = list(sig.parameters.values()) if sig else []
    names = {p.name for p in params}
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    n_pos = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    if sig is None or any(p.kind is p.VAR_POSITIONAL for p in params):
        n_pos = 4
    if form is not None:
        candidates = [form]
    elif "completions" in names and ("prompts" in names or var_kw) and "ground_truths" not in names:
        candidates = ["trl"]
    elif "data_source" in names:
        candidates = ["verl"]
    elif (params and params[0].name in BATCH_NAMES) or "ground_truths" in names:
        candidates = ["batch"]
    else:
        candidates = ["sample", "verl"]

    def arguments_for(kind: str) -> Callable[..., tuple]:
        if kind == "trl":
            def trl_arguments(columns: dict | None = None, *_: Any) -> tuple:
                columns = columns if isinstance(columns, dict) else dict.fromkeys(TRL_COLUMNS)  # the signature check
                return (), {k: v for k, v in columns.items() if var_kw or k in names}

            return trl_arguments
        if kind == "verl" and {"data_source", "solution_str", "ground_truth"} <= names:
            extra = "extra_info" in names or var_kw
            keys = ("data_source", "solution_str", "ground_truth", "extra_info")[: 4 if extra else 3]
            return lambda *row: ((), dict(zip(keys, row)))
        if kind == "verl":
            return lambda *row: (row[: max(3, min(n_pos, 4))], {})
        if kind == "sample":
            return lambda d, s, g, e: ((s, g), {"extra_info": e} if "extra_info" in names else {})
        keys = [k for k in ("data_sources", "extra_infos") if k in names]
        return lambda d, s, g, e: ((s, g), {k: d if k == "data_sources" else e for k in keys})

    problems = []
    for kind in candidates:
        arguments = arguments_for(kind)
        try:
            if sig is not None:
                args, kwargs = arguments(None, None, None, None)
                kwargs |= {k: None for k in ("rm_score", "rm_scores") if k in names}  # passed when the batch has them
                # a TRL function may also name dataset columns (from extra_info), known only per batch
                (sig.bind_partial if kind == "trl" else sig.bind)(*args, **kwargs)
            return kind, arguments
        except TypeError as exc:
            problems.append(f"as {kind!r}: {exc}")
    raise TypeError(f"cannot call reward function {name}{sig} ({'; '.join(problems)}). Supported forms: {_SUPPORTED}")


def trl_columns(batch: TensorDict, sources: list, texts: list, truths: list, extras: list) -> dict[str, list]:
    """The keywords of a TRL-form call: prompts, completions, completion_ids and the data's columns."""
    mask, ids = batch.get(RESPONSE_MASK), batch.get(RESPONSE_IDS)
    completion_ids = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    columns = {"prompts": column(batch, PROMPT_TEXT), "completions": list(texts), "completion_ids": completion_ids,
               "ground_truth": list(truths), "data_source": list(sources), "extra_info": list(extras)}
    dicts = [e for e in extras if isinstance(e, dict)]
    if dicts and len(dicts) == len(extras):  # TRL passes every dataset column by name
        for key in set.intersection(*(set(d) for d in dicts)):
            columns.setdefault(str(key), [d[key] for d in dicts])
    return columns
