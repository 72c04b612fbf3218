"""Partial rollouts by chunks: a response generated a few tokens per request, so that new weights can be loaded
between two requests and the response continues under them (:class:`~rlflow.rollout.fully_async.FullyAsyncRollout`,
and the agent loop it drives, :mod:`rlflow.rollout.agent.fully_async`). Every token keeps the log-prob and the
version of the weights that sampled it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from rlflow.rollout.engines.base import SamplingParams


@dataclass
class Sample:
    """One response being generated: the tokens so far, each one's log-prob and the version that sampled it."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None  # "stop" or "length" once complete
    limit: int | None = None  # the most tokens (None: the sampling's max_new_tokens), e.g. an agent turn's budget


def generate_chunk(engine, samples: list[Sample], params: SamplingParams, chunk_tokens: int, version: int) -> None:
    """Extend every unfinished sample by up to ``chunk_tokens`` tokens with ``engine``'s current weights
    (``version``, or the version the engine reports in ``extras["policy_version"]``).

    Each sample is one request of its prompt and its tokens so far (``n=1``); a completion that ends in a stop
    token finishes the sample, one that reaches the sample's limit (``params.max_new_tokens`` unless it has its
    own) in all finishes it as ``"length"``."""
    live = [s for s in samples if s.finish is None]
    if not live:
        return
    room = [(params.max_new_tokens if s.limit is None else s.limit) - len(s.tokens) for s in live]
    chunk = dataclasses.replace(params, n=1, max_new_tokens=max(1, min(chunk_tokens, max(room))))
    completions = engine.generate([s.prompt + s.tokens for s in live], chunk)
    if len(completions) != len(live) or any(len(c) != 1 for c in completions):
        raise RuntimeError(f"{type(engine).__name__} returned {[len(c) for c in completions]} completions for "
                           f"{len(live)} requests of one sample each")
    for sample, (completion,), left in zip(live, completions, room):
        took = completion.token_ids[:left]
        sampled_by = int(completion.extras.get("policy_version", version))
        sample.tokens += took
        sample.log_probs += completion.log_probs[:left]
        sample.versions += [sampled_by] * len(took)
        if completion.finish_reason == "stop" and len(completion.token_ids) <= left:
            sample.finish = "stop"
        elif len(took) >= left or not took:
            sample.finish = "length"


__all__ = ["Sample", "generate_chunk"]
