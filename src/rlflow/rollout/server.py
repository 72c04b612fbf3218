"""ServerRollout: the single-turn rollout sampling from an OpenAI-compatible server:
``SingleTurnRollout(ServerEngine(url))`` with the engine's options among its own.

``ServerRollout(url)`` talks to a server that is already running (vLLM's OpenAI server, SGLang, ...);
``ServerRollout(url, launch="command ...")`` starts it at ``bind``, waits until it answers, and stops it when the
process exits. Several URLs (a list, or one string with commas) make a fleet
(:class:`~rlflow.rollout.engines.fleet.FleetEngine`: balanced, health-checked, failing over).
:class:`ServerProcess` (starting and stopping) and :func:`vllm_server_command` (vLLM's server command line with
what rlflow needs) live in :mod:`rlflow.rollout.engines.launch` and are importable from here too.
"""

from __future__ import annotations

from pathlib import Path

from rlflow.rollout.engines.base import Engine
from rlflow.rollout.engines.fleet import FleetEngine
from rlflow.rollout.engines.launch import (VLLM_SERVER_ENV, ServerProcess,  # noqa: F401 - importable from here
                                           has_scale_out, vllm_server_command)
from rlflow.rollout.engines.server import SGLangEngine, ServerEngine
from rlflow.rollout.single_turn import SingleTurnRollout
from rlflow.rollout.weight_sync import DEFAULT_BUCKET_BYTES


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

    engine_class: type[ServerEngine] = ServerEngine

    def __init__(self, url: str | list[str], n: int = 1, *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                 max_new_tokens: int = 512, do_sample: bool = True, seed: int | None = None,
                 stop_token_ids: tuple[int, ...] = (), bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 launch: str | list[str] | None = None, model: str | None = None, max_concurrency: int = 64,
                 timeout: float = 600.0, retries: int = 3, backoff: float = 0.5,
                 checkpoint_dir: str | Path | None = None, logprobs_mode: str = "raw_logprobs",
                 weight_transfer: str | None = "auto", health_interval: float = 1.0, health_timeout: float = 10.0):
        self.urls = [u.strip() for u in url.split(",")] if isinstance(url, str) else [str(u) for u in url]
        self.url, self.launch = url, launch
        if len(self.urls) > 1 and launch is not None and (isinstance(launch, str) or len(launch) != len(self.urls)):
            raise ValueError(f"ServerRollout: {len(self.urls)} URLs need launch=None or a list of as many commands "
                             f"(None for a server already running), got {launch!r}")
        launches = [launch] if len(self.urls) == 1 else launch or [None] * len(self.urls)
        members = [self.engine_class(u, launch=cmd, model=model, max_concurrency=max_concurrency, timeout=timeout,
                                     retries=retries, backoff=backoff, checkpoint_dir=checkpoint_dir,
                                     logprobs_mode=logprobs_mode, weight_transfer=weight_transfer)
                   for u, cmd in zip(self.urls, launches)]
        engine: Engine = members[0] if len(members) == 1 else FleetEngine(
            members, max_concurrency=max_concurrency, health_interval=health_interval, health_timeout=health_timeout,
            checkpoint_dir=checkpoint_dir, weight_transfer=weight_transfer)
        super().__init__(engine, n, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                         do_sample=do_sample, seed=seed, stop_token_ids=stop_token_ids, bucket_bytes=bucket_bytes)

    def close(self) -> None:
        """Close the connection pool and stop a server this rollout started."""
        self.engine.close()


class SGLangRollout(ServerRollout):
    """A :class:`ServerRollout` for an SGLang server (native ``/generate``, ``/update_weights_from_disk``).
    Not run in rlflow's tests: SGLang could not be installed on the CPU machines they run on."""

    engine_class = SGLangEngine
