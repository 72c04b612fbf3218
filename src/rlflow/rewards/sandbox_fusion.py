"""A SandboxFusion client: programs run on a SandboxFusion server (``POST {url}/run_code``) instead of the local sandbox.

verl's ``reward_model.sandbox_fusion.url`` (verl 0.9: ``reward.sandbox_fusion.url``) sends the code of the code
data sources (``codecontests``, ``apps``, ``codeforces``, ``taco``) to a SandboxFusion server
(https://github.com/bytedance/SandboxFusion): rlflow does the same with this client, which stands in for
:class:`rlflow.sandbox.Sandbox` wherever code is run (``rlflow.rewards.code``, ``CodeReward(sandbox=...)``)::

    from rlflow.rewards import SandboxFusion, default_compute_score

    box = SandboxFusion("http://127.0.0.1:8080/run_code", max_concurrent=16, memory_limit_mb=1024)
    box.run_python("print(int(input()) * 2)", stdin="21").stdout        # "42\\n"
    default_compute_score("apps", response, ground_truth, sandbox=box)  # verl's default_compute_score with the url

The scoring is rlflow's (the same test-case formats, harness and output comparison as the local sandbox), so a
server that runs programs as the local sandbox does gives the same scores; only where the program runs changes.

The protocol (SandboxFusion's ``RunCodeRequest`` / ``RunCodeResponse``, as verl sends it): a JSON body
``{code, language, stdin, compile_timeout, run_timeout, memory_limit_MB, files: {name: base64}, fetch_files}``;
the answer ``{status: Success|Failed|SandboxError, message, compile_result, run_result: {status:
Finished|TimeLimitExceeded|Error, return_code, stdout, stderr, execution_time}, files}``. ``url`` is verl's: the
``/run_code`` endpoint itself; a url without a path (``http://host:8080``) gets ``/run_code`` added, as the
official client's endpoint does.

- ``max_concurrent`` bounds the requests in flight from this client (a semaphore shared by every thread that
  scores with it), as verl's ``concurrent_semaphore``.
- ``memory_limit_mb`` goes with every request (``memory_limit_MB``).
- A request that fails (server unreachable, an HTTP error, no answer in time, a ``SandboxError``) raises
  :class:`SandboxFusionError` naming the url and the cause: the reward counts that sample as an error (scored
  0.0, ``reward/errors``, a warning naming the rows) and the run goes on; when every sample of a batch fails
  the reward stops the run with that message. A ``504 Gateway Timeout`` is retried, as verl does (3 tries).
"""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

from rlflow.sandbox import _MEMORY_MARKERS, Limits, SandboxResult

RETRIES = 3  # verl's MAX_RETRIES, for 504 answers
RETRY_DELAY_S = 1.0  # verl's INITIAL_RETRY_DELAY: 1 s, then 2 s
API_TIMEOUT_S = 10.0  # verl's API_TIMEOUT: the request may take run + compile time + this


class SandboxFusionError(RuntimeError):
    """A request to the SandboxFusion server failed; the message names the url and the cause."""


def endpoint(url: str) -> str:
    """verl's url is the ``/run_code`` endpoint; a bare ``http://host:port`` gets it added."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"sandbox_fusion.url={url!r}: not an http(s) url (e.g. http://127.0.0.1:8080/run_code)")
    return url.rstrip("/") + "/run_code" if parsed.path in ("", "/") else url


@dataclass
class SandboxFusion:
    """Runs programs on the SandboxFusion server at ``url``; thread-safe; a drop-in for :class:`rlflow.sandbox.Sandbox`
    where Python is run (``run_python``).

    Args:
        url: the server's ``/run_code`` endpoint (verl's ``sandbox_fusion.url``).
        max_concurrent: requests in flight at most (verl's ``sandbox_fusion.max_concurrent``, default 64).
        memory_limit_mb: memory of each run in MiB (verl's ``sandbox_fusion.memory_limit_mb``, default 1024).
        run_timeout: seconds a run may take (``run_timeout``; a run's ``limits.wall_s`` replaces it), 10 as
            rlflow's local code sandbox (``rlflow.rewards.code.DEFAULT_LIMITS``) and verl.
        language: SandboxFusion's language of ``run_python`` (``python``).
    """

    url: str
    max_concurrent: int = 64
    memory_limit_mb: int = 1024
    run_timeout: float = 10.0
    language: str = "python"
    _slots: threading.BoundedSemaphore = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        self.url = endpoint(self.url)
        for name in ("max_concurrent", "memory_limit_mb", "run_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"sandbox_fusion.{name}={value!r}: must be a number > 0")
        self._slots = threading.BoundedSemaphore(int(self.max_concurrent))

    @property
    def limits(self) -> Limits:
        """What a run may use, as the local sandbox's :class:`~rlflow.sandbox.Limits` (wall time, memory; the rest
        is the server's)."""
        return Limits(wall_s=self.run_timeout, memory_mb=int(self.memory_limit_mb))

    def __getstate__(self):  # a reward process (reward_model.num_workers) gets its own semaphore
        return {k: v for k, v in self.__dict__.items() if k != "_slots"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._slots = threading.BoundedSemaphore(int(self.max_concurrent))

    def run_python(self, code: str, *, stdin: str | bytes = "", args: list[str] = (),
                   files: dict[str, str | bytes] | None = None, limits: Limits | None = None,
                   collect: tuple[str, ...] = ()) -> SandboxResult:
        """Run Python source on the server -> :class:`~rlflow.sandbox.SandboxResult` (raises :class:`SandboxFusionError`
        when the server does not run it)."""
        if args:
            raise ValueError("SandboxFusion runs a program without command-line arguments (args=)")
        run_timeout = limits.wall_s if limits is not None else self.run_timeout
        request = {"code": code, "language": self.language,
                   "stdin": stdin.decode(errors="replace") if isinstance(stdin, bytes) else stdin,
                   "compile_timeout": run_timeout, "run_timeout": run_timeout,
                   "memory_limit_MB": int(limits.memory_mb if limits is not None else self.memory_limit_mb),
                   "files": {name: base64.b64encode(data.encode() if isinstance(data, str) else data).decode()
                             for name, data in (files or {}).items()},
                   "fetch_files": list(collect)}
        with self._slots:
            answer = self._post(request, timeout=2 * run_timeout + API_TIMEOUT_S)
        return result_of(answer, self.url)

    def _post(self, request: dict, timeout: float) -> dict:
        body = json.dumps(request).encode()
        for attempt in range(RETRIES):
            req = urllib.request.Request(self.url, data=body, method="POST", headers={
                "Content-Type": "application/json", "Accept": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=timeout) as response:
                    text = response.read()
            except urllib.error.HTTPError as e:
                detail = e.read()[:300].decode(errors="replace")
                if e.code == 504 and attempt < RETRIES - 1:
                    time.sleep(RETRY_DELAY_S * (attempt + 1))
                    continue
                raise SandboxFusionError(f"SandboxFusion server {self.url} answered HTTP {e.code} {e.reason}"
                                         f"{': ' + detail if detail else ''}") from None
            except (urllib.error.URLError, ConnectionError) as e:
                reason = getattr(e, "reason", e)
                if isinstance(reason, (socket.timeout, TimeoutError)):
                    raise SandboxFusionError(f"SandboxFusion server {self.url}: no answer within {timeout:g} s") from None
                raise SandboxFusionError(f"SandboxFusion server {self.url} is unreachable ({reason})") from None
            except (socket.timeout, TimeoutError):
                raise SandboxFusionError(f"SandboxFusion server {self.url}: no answer within {timeout:g} s") from None
            try:
                answer = json.loads(text)
            except ValueError:
                raise SandboxFusionError(f"SandboxFusion server {self.url} answered with no JSON: "
                                         f"{text[:200]!r}") from None
            if not isinstance(answer, dict):
                raise SandboxFusionError(f"SandboxFusion server {self.url} answered {answer!r}, not an object")
            return answer
        raise SandboxFusionError(f"SandboxFusion server {self.url} answered HTTP 504 Gateway Timeout {RETRIES} times")


def result_of(answer: dict, url: str) -> SandboxResult:
    """A ``RunCodeResponse`` as a :class:`~rlflow.sandbox.SandboxResult` (``SandboxError``: :class:`SandboxFusionError`)."""
    status = answer.get("status")
    if status == "SandboxError":
        raise SandboxFusionError(f"SandboxFusion server {url} could not run the program: {answer.get('message')}")
    if status not in ("Success", "Failed"):
        raise SandboxFusionError(f"SandboxFusion server {url} answered status {status!r} (expected Success, Failed "
                                 "or SandboxError)")
    files = {name: base64.b64decode(data) for name, data in (answer.get("files") or {}).items() if data is not None}
    run, compiled = answer.get("run_result"), answer.get("compile_result")
    if run is None:  # the program did not start: it failed to compile (or the compiler ran out of time)
        compiled = compiled or {}
        why = "timeout" if compiled.get("status") == "TimeLimitExceeded" else "error"
        return SandboxResult(why, exit_code=compiled.get("return_code"), stdout=compiled.get("stdout") or "",
                             stderr=compiled.get("stderr") or "", files=files)
    code, stdout, stderr = run.get("return_code"), run.get("stdout") or "", run.get("stderr") or ""
    common = dict(exit_code=code, stdout=stdout, stderr=stderr, wall_s=run.get("execution_time") or 0.0, files=files)
    if run.get("status") == "TimeLimitExceeded":
        return SandboxResult("timeout", **common)
    if run.get("status") == "Finished" and code == 0 and status == "Success":
        return SandboxResult("ok", **common)
    if isinstance(code, int) and code < 0:
        return SandboxResult("signal", signal=-code, **common)
    if any(marker in stderr for marker in _MEMORY_MARKERS):
        return SandboxResult("memory_limit", **common)
    return SandboxResult("error", **common)
