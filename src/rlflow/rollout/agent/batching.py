"""Many trajectories, one engine: their per-turn requests are gathered into batched ``agenerate`` calls.

Each trajectory runs as its own coroutine (generate, call tools, generate again, ...). An engine that
batches internally (transformers ``generate``) is fastest with one call for all trajectories that are
ready, so :class:`TurnBatcher` holds each request until every live trajectory is waiting for the engine,
then sends them together; an engine that schedules requests itself (a server, vLLM's async engine) can
take them one by one (``AgentLoop(..., concurrent_requests=True)``, :class:`DirectRequests`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

from rlflow.rollout.engines.base import Completion, Engine, SamplingParams


def truncated(c: Completion, limit: int) -> Completion:
    """``c`` cut to ``limit`` tokens (finish reason "length" when anything was cut)."""
    if len(c.token_ids) <= limit:
        return c
    return Completion(c.token_ids[:limit], c.log_probs[:limit], "length", dict(c.extras))


class DirectRequests:
    """One engine call per request, all in flight at once."""

    def __init__(self, engine: Engine, params: SamplingParams):
        self.engine, self.params, self.calls = engine, params, 0

    async def generate(self, context: list[int], max_new_tokens: int) -> Completion:
        self.calls += 1
        params = dataclasses.replace(self.params, n=1, max_new_tokens=max_new_tokens,
                                     seed=None if self.params.seed is None else self.params.seed + self.calls)
        (completion,), = await self.engine.agenerate([context], params)
        return truncated(completion, max_new_tokens)

    def retire(self) -> None:
        """A trajectory has finished (nothing to do here)."""


class TurnBatcher(DirectRequests):
    """Sends the pending requests as one engine call once every live trajectory is waiting for one.

    Calls never overlap (the engine's model is used by one call at a time); each call's ``max_new_tokens``
    is the largest request's, and every completion is cut to its own request's limit afterwards (a
    trajectory never exceeds its token budget). With ``params.seed`` set, call ``k`` uses ``seed + k``.
    """

    def __init__(self, engine: Engine, params: SamplingParams, live: int):
        super().__init__(engine, params)
        self.live, self.pending, self.busy = live, [], False

    async def generate(self, context: list[int], max_new_tokens: int) -> Completion:
        future = asyncio.get_running_loop().create_future()
        self.pending.append((context, max_new_tokens, future))
        self._maybe_flush()
        return await future

    def retire(self) -> None:
        self.live -= 1
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if self.busy or not self.pending or len(self.pending) < self.live:
            return
        batch, self.pending, self.busy = self.pending, [], True
        asyncio.get_running_loop().create_task(self._run(batch))

    async def _run(self, batch) -> None:
        self.calls += 1
        try:  # everything that can fail is inside: a waiting trajectory must get the error, never wait forever
            params = dataclasses.replace(self.params, n=1, max_new_tokens=max(m for _, m, _ in batch),
                                         seed=None if self.params.seed is None else self.params.seed + self.calls)
            out = await self.engine.agenerate([ctx for ctx, _, _ in batch], params)
            if len(out) != len(batch) or any(len(c) != 1 for c in out):
                raise RuntimeError(f"{type(self.engine).__name__} returned {[len(c) for c in out]} completions for "
                                   f"{len(batch)} prompts, expected 1 each")
        except BaseException as e:  # noqa: BLE001 - every waiting trajectory gets the engine's error
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(e)
            return
        finally:
            self.busy = False
        for (_, limit, future), (completion,) in zip(batch, out):
            if not future.done():
                future.set_result(truncated(completion, limit))
        self._maybe_flush()


def run_sync(coro):
    """Run a coroutine to completion from synchronous code, also when an event loop is already running
    in this thread (Jupyter): then on a fresh loop in a worker thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    result: dict = {}

    def target():
        try:
            result["value"] = asyncio.run(coro)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            result["error"] = e

    thread = threading.Thread(target=target, name="rlflow-agent-loop")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]
