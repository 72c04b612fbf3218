"""An agent loop in the fully asynchronous mode: what ``FullyAsyncRollout(AgentLoop(...))`` runs on its driver thread.

Each admitted prompt becomes ``n`` conversations (:class:`~rlflow.rollout.agent.trajectory.Trajectory`), each a
coroutine of :meth:`AgentLoop.run_one` (of the loop its row names, verl's ``agent_name``) on the driver thread's
event loop. A model turn is a :class:`~rlflow.rollout.chunks.Sample` handed to the driver (:class:`ChunkedTurns`),
which extends every pending turn by one chunk per engine call (the turns of all conversations batched together)
and loads the weights pushed meanwhile between two chunks, as for single-turn samples; tools run between turns
on the same event loop while the engine generates other conversations' chunks. A conversation can therefore span
several versions, across turns and within one: each model token keeps the log-prob and the version of the weights
that sampled it, the tool tokens between turns are masked with version -1. A group is complete when its ``n``
conversations ended.

The driver's loop never samples with the module being trained: a transformers engine gets a copy of the model
(loaded with every push); a server holds weights of its own. The agent loop itself stays bound to the trained
model and samples validation batches in the trainer's thread, on the current weights.
"""

from __future__ import annotations

import asyncio
import copy

from rlflow.models.policy import lora_module
from rlflow.rollout.agent.loop import AgentLoop
from rlflow.rollout.chunks import Sample, generate_chunk
from rlflow.rollout.engines.base import Completion

IDLE_S = 0.005  # while every conversation is between turns (its tools running), how often the driver looks again


def driving_loop(agent: AgentLoop, model, tokenizer, world: int) -> AgentLoop:
    """Bind ``agent`` to ``model`` and return the loop the driver runs: ``agent`` itself over a server (it takes
    requests from two threads), else a copy whose transformers engine samples with a copy of ``model``."""
    if world > 1 or lora_module(model) is not None:
        raise NotImplementedError("FullyAsyncRollout over an AgentLoop runs on one training process with a full "
                                  "(not LoRA) policy for now: use the AgentLoop without FullyAsyncRollout")
    agent.bind(model, tokenizer)
    engine = agent.rollout.engine
    if engine.remote:
        return agent
    if agent.rollout.holds_own_weights:
        raise ValueError(f"FullyAsyncRollout over an AgentLoop drives the engine from a thread while the trainer "
                         f"validates from its own, which {type(engine).__name__} (in this process, one caller at a "
                         "time) does not allow: use a server (ServerRollout) or HFRollout, or AsyncRollout(AgentLoop"
                         "(...)) (one step off)")
    driving = copy.copy(agent)
    driving.rollout = copy.copy(agent.rollout)
    driving.rollout.engine = copy.copy(engine)
    driving.rollout.bind(copy.deepcopy(model), tokenizer)
    return driving


class ChunkedTurns:
    """The loop's sampler (as ``batching.DirectRequests``): a turn waits until the driver has generated it."""

    def __init__(self):
        self.pending: list[tuple[Sample, asyncio.Future]] = []

    async def generate(self, context: list[int], max_new_tokens: int) -> Completion:
        sample, generated = Sample(list(context), limit=max_new_tokens), asyncio.get_running_loop().create_future()
        self.pending.append((sample, generated))
        await generated
        return Completion(sample.tokens, sample.log_probs, sample.finish, {"token_versions": sample.versions})

    def retire(self) -> None:
        """A conversation ended (the driver sees its task end)."""

    def answer_finished(self) -> None:
        """Wake the conversations whose turn is complete."""
        for sample, generated in self.pending:
            if sample.finish is not None:
                generated.set_result(None)
        self.pending = [(s, g) for s, g in self.pending if s.finish is None]


def drive_agent(fa) -> None:
    """The driver loop of ``fa`` (a FullyAsyncRollout over an AgentLoop, its state under ``fa._cond``) on an event
    loop of its own. Returns when ``fa`` stops; raises what a conversation raised."""
    asyncio.run(_drive(fa))


async def _drive(fa) -> None:
    agent, turns, running = fa.driving, ChunkedTurns(), {}  # running: seq -> (group, its conversations' tasks)
    try:
        while True:
            with fa._cond:
                while not running and not fa._stopping and fa._weights is None and not (
                        fa._queue and fa.batch_size is not None and fa._room() > 0):
                    fa._cond.wait()  # nothing in flight: wait for a push or room to admit
                if fa._stopping:
                    return
                weights, fa._weights = fa._weights, None
                admitted = fa._admit() if weights is None else []
            if weights is not None:  # between two chunks: the turns in flight go on under the new weights
                fa._load(weights)
                continue
            for group in admitted:
                group.samples = agent.trajectories(group.row)
                running[group.seq] = group, [asyncio.create_task(agent.loop_for(t.agent_name).run_one(t, turns))
                                             for t in group.samples]
            await asyncio.sleep(0)  # the new conversations ask for their first turn
            if turns.pending:
                await asyncio.to_thread(generate_chunk, fa.engine, [s for s, _ in turns.pending],
                                        fa.rollout.sampling, fa.chunk_tokens, fa._engine_version)
                turns.answer_finished()
            await asyncio.sleep(0 if turns.pending else IDLE_S)  # tools run meanwhile
            ended = [seq for seq, (_, tasks) in running.items() if all(t.done() for t in tasks)]
            ended = [running.pop(seq) for seq in ended]
            for _, tasks in ended:
                for task in tasks:
                    task.result()  # a conversation's error stops the run
            if ended:
                fa._hand_over_finished([group for group, _ in ended])
    finally:  # a stopped run: its groups go back to the queue and start over
        tasks = [t for _, group in running.values() for t in group]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
