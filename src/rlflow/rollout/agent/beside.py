"""An agent loop run beside the trainer: what ``AsyncRollout(AgentLoop(...), max_staleness)`` needs.

The loop of a whole batch (every conversation's turns, and the tools between them) is one job on the worker
thread of a :class:`~rlflow.rollout.engines.threaded.ThreadedEngine`, in the trainer's process: tools run where
the loop runs, as in the synchronous loop (nothing is pickled, no second process), while the trainer's thread
trains. Weights pushed meanwhile load after the job, so every turn of a batch samples with the weights loaded
when its job started: a batch has one ``policy_version``, as a single-turn batch has.

The engine the loop calls must never be the module being trained (an update would land mid-conversation): a
transformers engine samples with a copy of the model, which pushed weights are loaded into; vLLM's engine and
servers hold weights of their own already.
"""

from __future__ import annotations

import copy

from tensordict import TensorDict

from rlflow.rollout.agent.loop import AgentLoop
from rlflow.rollout.engines.threaded import ThreadedEngine
from rlflow.rollout.wrapper import RolloutWrapper


def engine_beside(agent: AgentLoop, model, tokenizer, timeout: float) -> ThreadedEngine:
    """Bind ``agent`` to ``model`` (a copy of it, when its engine would sample with the module itself) and return
    the worker that runs its jobs; the engine is the wrapped rollout's to close (``rollout.close()``)."""
    own = agent.rollout.holds_own_weights
    agent.bind(model if own else copy.deepcopy(model), tokenizer)
    return ThreadedEngine(agent.rollout.engine, timeout=timeout, closes_engine=False)


def run_loop(agent: AgentLoop, batch: TensorDict) -> tuple[TensorDict, dict[str, float]]:
    """A job: the loop's samples of ``batch`` and its metrics (read on the worker, before another batch runs)."""
    samples = agent(batch)
    return samples, dict(agent.stats)


class OnWorker(RolloutWrapper):
    """``rollout`` (a copy of the loop with other sampling options: validation) run as a job on ``engine``'s
    worker: after the batches in flight, with the newest weights, never beside a weight load."""

    def __init__(self, rollout: AgentLoop, engine: ThreadedEngine):
        super().__init__(rollout)
        self.engine, self.stats = engine, {}

    def forward(self, batch: TensorDict) -> TensorDict:
        samples, self.stats = self.engine.result(self.engine.submit_call(run_loop, self.rollout, batch)).completions
        return samples
