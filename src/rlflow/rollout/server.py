"""ServerRollout: the single-turn rollout sampling from an OpenAI-compatible server; starting such a server.

``ServerRollout(url)`` talks to a server that is already running (vLLM's OpenAI server, SGLang, ...);
``ServerRollout(url, launch="command ...")`` starts it first, waits until it answers, and stops it when the
process exits. Several URLs (a list, or one string with commas) make a fleet
(:class:`~rlflow.rollout.engines.fleet.FleetEngine`: balanced, health-checked, failing over). :class:`ServerProcess` does the starting and stopping, and :func:`vllm_server_command` writes
the command line for vLLM's server with what rlflow needs (weight updates, log-probs, a bounded KV cache).
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

from rlflow.rollout.engines.base import Engine
from rlflow.rollout.engines.fleet import FleetEngine
from rlflow.rollout.engines.server import SGLangEngine, ServerEngine, ServerError
from rlflow.rollout.engines.weight_transfer import server_arguments
from rlflow.rollout.single_turn import SingleTurnRollout
from rlflow.rollout.weight_sync import DEFAULT_BUCKET_BYTES


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
                        weight_transfer: str | None = "auto") -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server`` for ``model_dir`` (it needs the tokenizer files too).

    ``enable_prefix_caching``: ``--enable-prefix-caching`` or ``--no-enable-prefix-caching`` (verl's
    ``rollout.enable_prefix_caching``; rlflow resets the cache after every weight update either way).
    ``weight_transfer``: the server takes weights through vLLM's weight-transfer protocol (``"auto"``:
    rlflow's shared-memory backend on CPU, registered in the server's worker by a worker extension; NCCL on
    CUDA); ``"reload"``: from disk only.

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
    return cmd + (["--enforce-eager"] if enforce_eager else []) + server_arguments(weight_transfer) + list(extra)


def has_scale_out() -> bool:
    """Whether the installed vLLM has ``--enable-scale-out`` (its ``entrypoints/scale_out``), found without
    importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and any((Path(p) / "entrypoints" / "scale_out").is_dir()
                                    for p in spec.submodule_search_locations or ())


# Weight updates need the dev endpoints; one engine-core process instead of two starts ~30 s sooner on CPU.
VLLM_SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


class ServerRollout(SingleTurnRollout):
    """Turns prompts into ``n`` samples each by asking an OpenAI-compatible completions server.

    Same contract as :class:`~rlflow.rollout.hf.HFRollout`. The server holds its own weights: ``bind`` and
    ``sync_weights`` write the policy's weights to ``checkpoint_dir`` and ask the server to reload them
    (vLLM with ``VLLM_SERVER_DEV_MODE=1``; a server without an update endpoint is refused at ``bind``).

    Args:
        url: the server's base URL; several (a list, or one string with commas) sample as one fleet
            (:class:`~rlflow.rollout.engines.fleet.FleetEngine`).
        n, temperature, top_p, top_k, max_new_tokens, do_sample, seed, stop_token_ids, bucket_bytes: as ``HFRollout``.
        launch: a command that starts the server (rlflow starts it, waits until it answers, stops it at exit);
            for a fleet, a list with one command (or ``None``: already running) per URL.
        health_interval, health_timeout: a fleet's health checks (see ``FleetEngine``).
        model, max_concurrency, timeout, retries, backoff, checkpoint_dir, logprobs_mode, weight_transfer: see
            :class:`~rlflow.rollout.engines.server.ServerEngine`. A fleet takes ``weight_transfer="rlflow_gloo"``
            (one gloo broadcast per bucket to all its servers) or, for any other value, ``checkpoint_dir``.
    """

    holds_own_weights = True
    remote_engine = True  # the engine runs in the server: AsyncRollout drives it from a thread, not a process
    engine_class: type[ServerEngine] = ServerEngine

    def __init__(self, url: str | list[str], n: int = 1, *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                 max_new_tokens: int = 512, do_sample: bool = True, seed: int | None = None,
                 stop_token_ids: tuple[int, ...] = (), bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 launch: str | list[str] | None = None, model: str | None = None, max_concurrency: int = 64,
                 timeout: float = 600.0, retries: int = 3, backoff: float = 0.5,
                 checkpoint_dir: str | Path | None = None, logprobs_mode: str = "raw_logprobs",
                 weight_transfer: str | None = "auto", health_interval: float = 1.0, health_timeout: float = 10.0):
        super().__init__(None, n, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                         do_sample=do_sample, seed=seed, stop_token_ids=stop_token_ids, bucket_bytes=bucket_bytes)
        self.url, self.launch = url, launch
        self.urls = [u.strip() for u in url.split(",")] if isinstance(url, str) else [str(u) for u in url]
        if len(self.urls) > 1 and launch is not None and (isinstance(launch, str) or len(launch) != len(self.urls)):
            raise ValueError(f"ServerRollout: {len(self.urls)} URLs need launch=None or a list of as many commands "
                             f"(None for a server already running), got {launch!r}")
        self.engine_options = dict(model=model, max_concurrency=max_concurrency, timeout=timeout, retries=retries,
                                   backoff=backoff, checkpoint_dir=checkpoint_dir, logprobs_mode=logprobs_mode,
                                   weight_transfer=weight_transfer)
        self.fleet_options = dict(max_concurrency=max_concurrency, health_interval=health_interval,
                                  health_timeout=health_timeout, checkpoint_dir=checkpoint_dir,
                                  weight_transfer=weight_transfer)
        self.server: ServerProcess | None = None
        self.fleet_servers: list[ServerProcess] = []

    def make_engine(self, model, tokenizer) -> Engine:
        if self.engine is not None:
            return self.engine
        eos = tokenizer.eos_token_id
        eos = () if eos is None else (eos,)
        if len(self.urls) > 1:
            return self.make_fleet(eos)
        if self.launch and self.server is None:
            self.server = ServerProcess(self.launch, self.urls[0], env=VLLM_SERVER_ENV).wait()
        return self.engine_class(self.urls[0], eos_token_ids=eos, **self.engine_options)

    def make_fleet(self, eos: tuple[int, ...]) -> FleetEngine:
        if self.launch and not self.fleet_servers:  # all start at once, then each is waited for
            self.fleet_servers = [ServerProcess(cmd, url, env=VLLM_SERVER_ENV)
                                  for cmd, url in zip(self.launch, self.urls) if cmd]
            for server in self.fleet_servers:
                server.wait()
        members = [self.engine_class(url, eos_token_ids=eos, **self.engine_options) for url in self.urls]
        return FleetEngine(members, **self.fleet_options)

    def close(self) -> None:
        """Close the connection pool and stop a server this rollout started."""
        if self.engine is not None:
            self.engine.close()
        for server in [self.server, *self.fleet_servers]:
            if server is not None:
                server.stop()


class SGLangRollout(ServerRollout):
    """A :class:`ServerRollout` for an SGLang server (native ``/generate``, ``/update_weights_from_disk``).
    Not run in rlflow's tests: SGLang could not be installed on the CPU machines they run on."""

    engine_class = SGLangEngine
