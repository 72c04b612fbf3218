"""Code-execution rewards: run the code in each response against test cases in the sandbox.

Test cases (the sample's ``ground_truth``, a dict or its JSON text), in the formats of APPS / CodeContests /
TACO (verl's ``prime_code`` and ``sandbox_fusion``) and of HumanEval / MBPP:

- ``{"inputs": [...], "outputs": [...]}``: each input is fed on stdin; the case passes when stdout equals
  the output (trailing spaces of each line and trailing blank lines ignored).
- ``{"fn_name": "f", "inputs": [[args], ...], "outputs": [...]}``: ``f(*args)`` (or ``Solution().f`` when
  the code defines a ``Solution`` class) must return the output (compared as JSON values).
- ``{"asserts": ["assert f(1) == 2", ...]}`` (or a plain list of them): each statement runs after the code.

The code is the last fenced block of the response (```python ...``` preferred), else the whole response.
Score = the fraction of cases passed (``all_or_nothing=True``: 1.0 only when all pass, and a sample stops at
its first failure). Every case is its own sandbox run, so a program that loops, forks, allocates or floods
costs that case (its limit), never the step; runs go in parallel on ``workers`` threads (each drives one
sandbox process). Results are cached per (code, tests) within a call: the ``n`` samples of a prompt often
write the same program.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from tensordict import TensorDict

from rlflow.data import keys as K
from rlflow.rewards.base import Reward, RewardWarning, column
from rlflow.rewards.sandbox_fusion import SandboxFusion, SandboxFusionError
from rlflow.sandbox import Limits, Sandbox, SandboxResult

FENCE = re.compile(r"```([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)
CALL_HARNESS = """
import json, sys
sys.setrecursionlimit(10000)
from solution import *
args = json.loads(sys.stdin.read())
fn = getattr(Solution(), {name!r}) if "Solution" in globals() else globals()[{name!r}]
print("@@rlflow-result@@" + json.dumps(fn(*args)))
"""
DEFAULT_LIMITS = Limits(wall_s=10, cpu_s=5, memory_mb=512, max_processes=8, max_output_bytes=1 << 20)


def extract_code(response: str) -> str:
    """The last fenced ``python`` block, else the last fenced block of any language, else the text itself."""
    blocks = FENCE.findall(response)
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    if python:
        return python[-1]
    return blocks[-1][1] if blocks else response


def parse_tests(ground_truth: Any) -> list[dict]:
    """Test cases as ``[{"kind": "stdio"|"call"|"assert", ...}]``; ``ValueError`` naming what is wrong."""
    tests = json.loads(ground_truth) if isinstance(ground_truth, (str, bytes)) else ground_truth
    if isinstance(tests, list):
        tests = {"asserts": tests}
    if not isinstance(tests, dict):
        raise ValueError(f"test cases must be a dict (or its JSON), got {type(tests).__name__}")
    if "asserts" in tests:
        return [{"kind": "assert", "code": str(a)} for a in tests["asserts"]]
    inputs, outputs = tests.get("inputs"), tests.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
        raise ValueError("test cases need 'inputs' and 'outputs' lists of one length (or 'asserts')")
    if tests.get("fn_name"):
        return [{"kind": "call", "name": tests["fn_name"], "args": i, "expected": o} for i, o in zip(inputs, outputs)]
    return [{"kind": "stdio", "stdin": _text(i), "expected": _text(o)} for i, o in zip(inputs, outputs)]


def _text(value: Any) -> str:
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def _normalise(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).rstrip()


def run_case(sandbox: Sandbox | SandboxFusion, code: str, case: dict) -> tuple[bool, str]:
    """Run one case -> ``(passed, outcome)``; outcome is the sandbox status, or ``"wrong"`` for a wrong answer."""
    if case["kind"] == "stdio":
        result = sandbox.run_python(code, stdin=case["stdin"])
        return _judged(result, lambda out: _normalise(out) == _normalise(case["expected"]))
    if case["kind"] == "assert":
        return _judged(sandbox.run_python(code + "\n\n" + case["code"] + "\n"), lambda out: True)
    result = sandbox.run_python(CALL_HARNESS.format(name=case["name"]), stdin=json.dumps(case["args"]),
                                files={"solution.py": code})

    def same(out: str) -> bool:
        marked = [line for line in out.splitlines() if line.startswith("@@rlflow-result@@")]
        if not marked:
            return False
        try:
            return json.loads(marked[-1].removeprefix("@@rlflow-result@@")) == case["expected"]
        except ValueError:
            return False

    return _judged(result, same)


def _run_case_counted(sandbox: Sandbox | SandboxFusion, code: str, case: dict) -> tuple[bool, str]:
    """:func:`run_case`; a SandboxFusion request that failed is that case's ``sandbox_error`` (its sample is counted)."""
    try:
        return run_case(sandbox, code, case)
    except SandboxFusionError as e:
        return False, f"sandbox_error: {e}"


def _judged(result: SandboxResult, check) -> tuple[bool, str]:
    if result.status == "sandbox_error":
        return False, f"sandbox_error: {result.stderr.strip()[-300:]}"
    if result.status != "ok":
        return False, result.status
    return (True, "ok") if check(result.stdout) else (False, "wrong")


def compute_score(solution_str: str, ground_truth: Any, sandbox: Sandbox | SandboxFusion | None = None) -> dict:
    """One sample, verl's ``compute_score`` shape: ``{"score": pass fraction, "passed", "total"}``.

    ``sandbox``: where the cases run (default: a local ``Sandbox(DEFAULT_LIMITS)``; a :class:`SandboxFusion`
    client sends them to a SandboxFusion server, whose failures raise :class:`SandboxFusionError`)."""
    sandbox = sandbox or _default_sandbox()
    code, cases = extract_code(solution_str), parse_tests(ground_truth)
    passed = sum(run_case(sandbox, code, case)[0] for case in cases)
    return {"score": passed / len(cases) if cases else 0.0, "passed": passed, "total": len(cases)}


_SANDBOX: Sandbox | None = None


def _default_sandbox() -> Sandbox:
    global _SANDBOX
    if _SANDBOX is None:
        _SANDBOX = Sandbox(DEFAULT_LIMITS)
    return _SANDBOX


class CodeReward(Reward):
    """Pass rate of each response's code on its test cases (module docs above).

    Args:
        sandbox: where programs run (default: ``Sandbox(DEFAULT_LIMITS)``: 10 s wall, 5 s CPU, 512 MiB,
            8 processes per case; no network, no writes outside its folder), or a :class:`SandboxFusion` client
            (a SandboxFusion server runs them; a request that fails counts its sample in ``reward/errors``).
        workers: sandbox runs at once (default: the number of CPUs).
        all_or_nothing: 1.0 when every case passes, else 0.0 (a sample stops at its first failed case).
        max_cases: run at most this many cases per sample (``None``: all).
        name: the name in metrics.

    ``stats``: ``reward/code/cases`` (runs this call), ``reward/code/cached`` (samples answered from the cache),
    and per outcome ``reward/code/<timeout|cpu_limit|memory_limit|output_limit|error|signal|wrong>`` (cases);
    ``reward/errors`` counts samples whose tests could not be read or whose sandbox failed (scored 0.0).
    ``extras``: ``passed`` / ``total`` cases per row, ``pass_rate``.
    """

    thread_safe = True

    def __init__(self, sandbox: Sandbox | SandboxFusion | None = None, *, workers: int | None = None, all_or_nothing: bool = False,
                 max_cases: int | None = None, name: str = "code"):
        super().__init__()
        if workers is not None and workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.sandbox = sandbox or Sandbox(DEFAULT_LIMITS)
        self.workers = workers or os.cpu_count() or 1
        self.all_or_nothing, self.max_cases, self.name = all_or_nothing, max_cases, name

    def __repr__(self) -> str:
        return f"CodeReward({self.sandbox!r}, workers={self.workers}, all_or_nothing={self.all_or_nothing})"

    def score(self, batch: TensorDict) -> torch.Tensor:
        texts, truths, sources = (column(batch, k) for k in (K.RESPONSE_TEXT, K.GROUND_TRUTH, K.DATA_SOURCE))
        jobs: dict[str, tuple[str, list[dict]]] = {}  # cache key -> (code, cases): each distinct job runs once
        keys: list[str | None] = []
        bad: dict[int, str] = {}
        for row, (text, truth) in enumerate(zip(texts, truths)):
            try:
                cases = parse_tests(truth)[: self.max_cases]
            except (ValueError, TypeError) as e:
                bad[row], _ = f"unreadable test cases ({e})", keys.append(None)
                continue
            code = extract_code(text)
            key = hashlib.sha256(json.dumps([code, cases], sort_keys=True, default=str).encode()).hexdigest()
            jobs.setdefault(key, (code, cases))
            keys.append(key)
        self.stats["reward/code/cached"] = float(sum(k is not None for k in keys) - len(jobs))
        outcomes = self._run(jobs)
        scores, counts = [], collections.Counter()
        self.extras.update(passed=[None] * len(texts), total=[None] * len(texts), pass_rate=[None] * len(texts))
        for row, key in enumerate(keys):
            if key is None:
                scores.append(0.0)
                continue
            results = outcomes[key]
            broken = [why for _, why in results if why.startswith("sandbox_error")]
            if broken:
                bad[row] = f"the sandbox could not run the program ({broken[0]})"
            passed, total = sum(ok for ok, _ in results), len(jobs[key][1])
            counts.update(why.split(":")[0] for ok, why in results if not ok)
            rate = passed / total if total else 0.0
            scores.append(float(passed == total) if self.all_or_nothing else rate)
            self.extras["passed"][row], self.extras["total"][row], self.extras["pass_rate"][row] = passed, total, rate
        self.stats["reward/code/cases"] = float(sum(len(r) for r in outcomes.values()))
        for why, n in counts.items():
            self.stats[f"reward/code/{why}"] = float(n)
        self._report(bad, sources, scores)
        return torch.tensor(scores, dtype=torch.float32)

    def _run(self, jobs: dict[str, tuple[str, list[dict]]]) -> dict[str, list[tuple[bool, str]]]:
        """Every case of every job on the thread pool; with ``all_or_nothing`` a job stops at its first failure."""
        results: dict[str, list] = {key: [] for key in jobs}
        if not jobs:
            return results
        with ThreadPoolExecutor(self.workers, thread_name_prefix="rlflow-code") as pool:
            if self.all_or_nothing:  # cases in order, one job per thread
                def serial(key):
                    code, cases = jobs[key]
                    for case in cases:
                        results[key].append(_run_case_counted(self.sandbox, code, case))
                        if not results[key][-1][0]:
                            break
                list(pool.map(serial, jobs))
            else:
                futures = {(key, i): pool.submit(_run_case_counted, self.sandbox, code, case)
                           for key, (code, cases) in jobs.items() for i, case in enumerate(cases)}
                for (key, _), future in futures.items():
                    results[key].append(future.result())
        return results

    def _report(self, bad: dict[int, str], sources: list, scores: list[float]) -> None:
        groups = collections.defaultdict(list)
        for row, cause in bad.items():
            scores[row] = 0.0
            groups[cause].append(row)
        self.stats["reward/errors"] += len(bad)
        for cause, rows in groups.items():
            warnings.warn(f"{self.name}: {len(rows)} sample(s): {cause}; scored 0.0. First: row {rows[0]} "
                          f"(data_source={sources[rows[0]]!r}); rows {rows[:20]}", RewardWarning, stacklevel=4)
