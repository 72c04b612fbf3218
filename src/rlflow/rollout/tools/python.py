"""A Python executor tool: the model's code runs in rlflow's sandbox (:mod:`rlflow.sandbox`).

``{"code": "print(sum(range(10)))"}`` -> ``"45\\n"``. Each call is a fresh process tree in a throw-away
folder under the sandbox's limits (wall time, CPU time, memory, processes, output, file sizes), with no
network and no write outside its folder (the guarantees and the layers that provide them are listed in
:mod:`rlflow.sandbox`, whose tests try each escape). A program that fails, or breaks a limit, gives the
model a clear error (``Error: python: the program used more than its 2 s of CPU time ...``), counted as a
tool error; the rollout goes on.

verl's ``verl.tools.sandbox_fusion_tools.SandboxFusionTool`` (code sent to a remote SandboxFusion service)
maps to this tool in verl tool YAML files: with its ``sandbox_fusion_url`` the code runs on that server
(:class:`rlflow.rewards.SandboxFusion`: ``default_timeout`` as run time, ``memory_limit_mb``, ``rate_limit`` as the
requests in flight at most; a request that fails is a tool error naming the url); without one, locally in
the sandbox.
"""

from __future__ import annotations

import re

from rlflow.rewards.sandbox_fusion import SandboxFusion, SandboxFusionError
from rlflow.rollout.tools.base import Tool, ToolError
from rlflow.sandbox import Limits, Sandbox, SandboxResult

DEFAULT_LIMITS = Limits(wall_s=10.0, cpu_s=5.0, memory_mb=512, max_processes=8, max_output_bytes=64 * 1024,
                        max_file_mb=16, disk_mb=64)
WHY = {"timeout": "ran longer than its {wall_s:g} s of wall time and was stopped",
       "cpu_limit": "used more than its {cpu_s:g} s of CPU time and was stopped",
       "memory_limit": "ran out of its {memory_mb} MiB of memory",
       "output_limit": "printed more than {max_output_bytes} bytes and was stopped",
       "signal": "was killed by signal {signal}",
       "sandbox_error": "could not be run: the sandbox failed on this machine"}
LIMIT_KEYS = tuple(Limits.__dataclass_fields__)
# verl SandboxFusionTool config keys -> rlflow's (None: nothing to set here; sandbox_fusion_url and rate_limit: the
# SandboxFusion client's)
VERL_KEYS = {"default_timeout": "wall_s", "memory_limit_mb": "memory_mb", "num_workers": None,
             "enable_global_rate_limit": None, "default_language": None}


def describe(result: SandboxResult, limits: Limits, tail_chars: int = 800) -> str:
    """Why a run failed, in words, with the end of its stderr (where Python puts the exception)."""
    if result.status == "error":
        text = f"the program exited with code {result.exit_code}"
    else:
        text = "the program " + WHY.get(result.status, result.status).format(signal=result.signal,
                                                                              **limits.__dict__)
    stderr = re.sub(r'File "[^"]*/box/', 'File "', result.stderr.strip())  # the throw-away folder's name is noise
    return text + (":\n" + stderr[-tail_chars:] if stderr else "")


class PythonTool(Tool):
    """Runs the model's Python source in a :class:`~rlflow.sandbox.Sandbox`; returns what it printed.

    Args:
        config: limit overrides (any :class:`~rlflow.sandbox.Limits` field: ``wall_s``, ``cpu_s``, ``memory_mb``,
            ``max_processes``, ``max_output_bytes``, ...), ``require`` (isolation layers that must hold, default
            the sandbox's ``("landlock", "seccomp")``), ``timeout_s``; verl SandboxFusionTool keys are mapped.
        tool_schema: verl's schema (the first required property holds the code; ``code`` by default).
        sandbox: a configured sandbox to use instead of one made from ``config``.
    """

    name = "python"
    description = ("Run a Python program and return what it prints (stdout). Each call starts fresh, without "
                   "network access; print the values you need.")
    parameters = {"type": "object", "properties": {
        "code": {"type": "string", "description": "the Python source to run"}}, "required": ["code"]}

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None, *,
                 sandbox: Sandbox | SandboxFusion | None = None):
        super().__init__(config, tool_schema)
        url, rate_limit = self.config.pop("sandbox_fusion_url", None), self.config.pop("rate_limit", None)
        for key, ours in VERL_KEYS.items():
            if key in self.config:
                value = self.config.pop(key)
                if key == "default_language" and value not in (None, "python"):
                    raise ValueError(f"PythonTool runs Python only, not default_language={value!r}")
                if ours is not None:
                    self.config.setdefault(ours, value)
        require = self.config.pop("require", None)
        limits = {k: self.config.pop(k) for k in LIMIT_KEYS if k in self.config}
        if self.config:
            raise ValueError(f"PythonTool: unknown config key(s) {sorted(self.config)}; limits are {LIMIT_KEYS}")
        if sandbox is None and url:
            other = sorted(set(limits) - {"wall_s", "memory_mb"}) + (["require"] if require is not None else [])
            if other:
                raise ValueError(f"PythonTool: {other} limit the local sandbox; with sandbox_fusion_url the server "
                                 "sets them (default_timeout and memory_limit_mb go with each request)")
            sandbox = SandboxFusion(url, max_concurrent=rate_limit or 64,
                                    memory_limit_mb=limits.get("memory_mb", DEFAULT_LIMITS.memory_mb),
                                    run_timeout=limits.get("wall_s", DEFAULT_LIMITS.wall_s))
        if sandbox is None:
            base = Limits(**{**DEFAULT_LIMITS.__dict__, **limits})
            sandbox = Sandbox(base) if require is None else Sandbox(base, require=tuple(require))
        self.sandbox = sandbox
        # the sandbox stops the program itself; the loop's own timeout only guards the sandbox
        self.timeout_s = max(self.timeout_s or 0.0, self.sandbox.limits.wall_s + 10.0)
        required = self.parameters.get("required") or list(self.parameters.get("properties", {}))
        self.argument = required[0] if required else "code"

    def execute(self, args: dict, **sample_kwargs) -> str:
        """Blocking (a subprocess): the agent loop runs it on a worker thread."""
        try:
            result = self.sandbox.run_python(str(args.get(self.argument, "")))
        except SandboxFusionError as e:  # the server did not run it: a tool error, the rollout goes on
            raise ToolError(f"python: {e}") from None
        if result.status != "ok":
            raise ToolError(f"python: {describe(result, self.sandbox.limits)}")
        out = result.stdout
        if result.truncated:
            out += "\n...(output truncated)"
        return out if out.strip() else "(the program printed nothing)"
