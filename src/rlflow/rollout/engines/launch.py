"""Starting an inference server from a command line and stopping it (:class:`ServerProcess`), and the command
line of vLLM's OpenAI server with what rlflow needs (:func:`vllm_server_command`: weight updates, log-probs, a
bounded KV cache). A :class:`~rlflow.rollout.engines.server.ServerEngine` given ``launch=`` starts its server
with these at ``bind``.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from rlflow.rollout.engines.errors import ServerError
from rlflow.rollout.engines.quantization import server_flags
from rlflow.rollout.engines.weight_transfer import server_arguments


class ServerProcess:
    """A server started from a command line, stopped by :meth:`stop` (and at interpreter exit).

    Args:
        command: the command (a string is split like a shell would).
        url: where it answers; ``health_path`` is polled until it returns 200.
        env: extra environment variables.
        log: a file for the server's output (default: discarded).
    """

    def __init__(self, command: str | list[str], url: str, *, health_path: str = "/health", env: dict | None = None,
                 log: str | Path | None = None):
        self.command = shlex.split(command) if isinstance(command, str) else list(command)
        self.url, self.health_path = url.rstrip("/"), health_path
        self.log = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(self.command, env={**os.environ, **(env or {})}, stdout=self.log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        atexit.register(self.stop)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}{self.health_path}", timeout=5) as answer:
                return answer.status == 200
        except OSError:
            return False

    def wait(self, timeout: float = 600.0) -> "ServerProcess":
        """Block until the server answers; raise (naming the command) if it exits or takes too long."""
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.process.poll() is not None:
                raise ServerError(f"the server command exited with code {self.process.returncode} before "
                                  f"answering at {self.url}: {shlex.join(self.command)}")
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(f"the server at {self.url} did not answer within {timeout:.0f} s: "
                                  f"{shlex.join(self.command)}")
            time.sleep(0.5)
        return self

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.log is not subprocess.DEVNULL and not self.log.closed:
            self.log.close()


def vllm_server_command(model_dir: str | Path, port: int, *, host: str = "127.0.0.1", dtype: str = "auto",
                        max_model_len: int | None = None, kv_cache_memory_bytes: int | None = None,
                        enforce_eager: bool = False, logprobs_mode: str = "raw_logprobs", seed: int = 0,
                        enable_prefix_caching: bool = True, extra: tuple[str, ...] = (),
                        weight_transfer: str | None = "auto", quantization: str | None = None) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server`` for ``model_dir`` (it needs the tokenizer files too).

    ``enable_prefix_caching``: ``--enable-prefix-caching`` or ``--no-enable-prefix-caching`` (verl's
    ``rollout.enable_prefix_caching``; rlflow resets the cache after every weight update either way).
    ``weight_transfer``: the server takes weights through vLLM's weight-transfer protocol (``"auto"``:
    rlflow's shared-memory backend on CPU, registered in the server's worker by a worker extension; NCCL on
    CUDA); ``"reload"``: from disk only.
    ``quantization``: ``"fp8"`` serves fp8 weights as ``VLLMEngine(quantization="fp8")`` does (vLLM's
    ``--quantization fp8_per_block``, MoE routers kept; CUDA GPUs), requantized at every weight update.

    Run it with ``VLLM_SERVER_DEV_MODE=1`` in the environment so rlflow can send weights
    (:data:`VLLM_SERVER_ENV` holds that and the in-process engine core setting). ``--enable-scale-out`` (where
    the vLLM has it) opens ``/inference/v1/generate``, through which FullyAsyncRollout keeps requests across
    weight updates (:mod:`rlflow.rollout.kept`)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", host,
           "--port", str(port), "--dtype", dtype, "--logprobs-mode", logprobs_mode, "--seed", str(seed),
           "--disable-log-stats", "--uvicorn-log-level", "warning",
           "--enable-prefix-caching" if enable_prefix_caching else "--no-enable-prefix-caching"]
    cmd += ["--max-model-len", str(max_model_len)] if max_model_len else []
    cmd += ["--kv-cache-memory-bytes", str(kv_cache_memory_bytes)] if kv_cache_memory_bytes else []
    cmd += ["--enable-scale-out"] if has_scale_out() else []
    cmd += server_flags(quantization)
    return cmd + (["--enforce-eager"] if enforce_eager else []) + server_arguments(weight_transfer) + list(extra)


def has_scale_out() -> bool:
    """Whether the installed vLLM has ``--enable-scale-out`` (its ``entrypoints/scale_out``), found without
    importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and any((Path(p) / "entrypoints" / "scale_out").is_dir()
                                    for p in spec.submodule_search_locations or ())


# Weight updates need the dev endpoints; one engine-core process instead of two starts ~30 s sooner on CPU.
VLLM_SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
