"""Multi-turn agent rollouts one step off: AsyncRollout over an AgentLoop with the calculator tool, on a tiny
transformers model taught to call it. The synchronous loop is reproduced at max_staleness=0; one step off, every
batch says which weights sampled it, its log-probs on model tokens are those weights', tool tokens stay masked,
and no batch trains staler than the bound."""

import copy
import threading
import time

import pytest
import torch

from rlflow import FunctionReward, Policy, PPOLoss, PromptData, Trainer
from rlflow.algorithms import GRPO, TruncatedIS
from rlflow.data import keys as K
from rlflow.module import Chain
from rlflow.rollout import AsyncRollout, HFRollout
from rlflow.rollout.agent import AgentLoop
from rlflow.rollout.engines.base import Completion, Engine, SamplingParams
from rlflow.rollout.engines.threaded import ThreadedEngine
from rlflow.tasks.calculator import CalculatorTask, chat_tokenizer
from rlflow.trainer.options import with_groups
from tests.rollout.agent_helpers import tool_caller
from tests.rollout.test_agent_training import interior_spans
from tests.rollout.test_async_rollout import Recorder, push_two_updates, recomputed


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


@pytest.fixture(scope="module")
def caller(tok):
    return tool_caller(tok)


@pytest.fixture(scope="module")
def rows():
    train, val, _ = CalculatorTask().splits()
    return train[:16], val[:4]


def longer_is_better(solution_str, ground_truth):
    """A reward the barely trained model's samples differ on, so every step updates the weights."""
    return len(solution_str) / 40


def agent_loop():
    return AgentLoop(HFRollout(n=2, temperature=1.0, max_new_tokens=64), CalculatorTask().tools(),
                     max_assistant_turns=3)


def make_trainer(model, tok, rollout, tmp_path, steps, callbacks=()):
    return Trainer(policy=Policy(model, tok), rollout=rollout, reward=FunctionReward(longer_is_better),
                   estimator=Chain(TruncatedIS(), GRPO()), loss=PPOLoss(is_weights=True), callbacks=list(callbacks),
                   **with_groups(batch_size=4, lr=5e-2, max_steps=steps, run_dir=tmp_path, loggers=(), progress=False))


def test_max_staleness_zero_reproduces_the_synchronous_multi_turn_run(tok, caller, rows, tmp_path):
    """The loop on the engine's thread, nothing generated ahead: the same conversations, rewards, losses and
    validation as the loop in the trainer's thread."""
    data = PromptData(rows[0], val=rows[1], seed=0)
    runs = {}
    for name in ("sync", "async"):
        recorder = Recorder()
        rollout = agent_loop() if name == "sync" else AsyncRollout(agent_loop(), max_staleness=0)
        trainer = make_trainer(copy.deepcopy(caller), tok, rollout, tmp_path / name, steps=3, callbacks=[recorder])
        torch.manual_seed(0)
        try:
            runs[name] = trainer.fit(data), trainer.validate(data), recorder.batches
        finally:
            if name == "async":
                rollout.close()
    (sync, sync_val, sync_batches), (got, got_val, got_batches) = runs["sync"], runs["async"]
    for expected, metrics in zip(sync, got):
        shared = [k for k in expected if not k.startswith(("timing_s/", "perf/", "weight_sync/"))
                  and k not in ("agent/gen_s/mean", "agent/tool_s/mean")]  # seconds
        assert "agent/tool_calls/mean" in shared and "actor/pg_loss" in shared
        assert {k: metrics[k] for k in shared} == {k: expected[k] for k in shared}
        assert metrics["async/staleness_max"] == 0
    assert got_val == sync_val
    for expected, batch in zip(sync_batches, got_batches):
        assert torch.equal(batch[K.RESPONSE_IDS], expected[K.RESPONSE_IDS])
        assert torch.equal(batch[K.ROLLOUT_LOG_PROBS], expected[K.ROLLOUT_LOG_PROBS])
        assert torch.equal(batch[K.SCORES], expected[K.SCORES])
    assert sum(b[K.EXTRA_INFO][i]["tool_calls"] for b in got_batches for i in range(len(b))) > 0  # the tool ran


def test_one_step_off_conversations_come_from_the_weights_that_sampled_them(tok, caller, rows, tmp_path):
    """Batch t (t >= 1) was sampled, tool calls and all, while step t-1 trained: with the weights of version t-1,
    which its policy_version names and its rollout log-probs on the model's tokens match (the current weights'
    do not); tool tokens inside a response are masked with log-prob 0; no batch is staler than one version."""
    recorder = Recorder()
    rollout = AsyncRollout(agent_loop(), max_staleness=1)
    model = copy.deepcopy(caller)
    trainer = make_trainer(model, tok, rollout, tmp_path, steps=4, callbacks=[recorder])
    assert rollout.placement == "thread" and rollout.max_new_tokens == 64
    torch.manual_seed(0)
    try:
        history = trainer.fit(PromptData(rows[0], seed=0))
    finally:
        rollout.close()
    spans = []
    for step, (batch, metrics) in enumerate(zip(recorder.batches, history)):
        version = max(step - 1, 0)
        assert batch[K.POLICY_VERSION].tolist() == [version] * 8
        assert metrics["async/staleness_max"] == metrics["async/staleness_mean"] == step - version <= 1
        mask = batch[K.RESPONSE_MASK].bool()
        sampled = batch[K.ROLLOUT_LOG_PROBS]
        assert (recomputed(caller, tok, recorder.weights[version], batch)[mask] - sampled[mask]).abs().max() < 1e-5
        if version < step:
            assert (recomputed(caller, tok, recorder.weights[step], batch)[mask] - sampled[mask]).abs().max() > 1e-3
        holes = interior_spans(batch[K.RESPONSE_MASK])
        assert (sampled[holes] == 0).all()
        spans.append(int(holes.any(-1).sum()))
        assert metrics["rollout_corr/rollout_is_mean"] > 0
    # batch 1, sampled while step 0 trained, called the tool: its results sit between model turns
    assert history[1]["agent/tool_calls/mean"] > 0 and spans[1] > 0
    assert rollout.agent.rollout.engine.model is not model  # the loop sampled with a copy, never the trained module


def test_a_batch_staler_than_the_bound_is_run_again_with_the_newest_weights(tok, caller, rows):
    """Weights pushed twice while a batch was ahead leave it two versions behind: its whole loop runs again with
    the newest weights; validation runs on the engine's thread after the batch ahead, with the newest weights."""
    model = copy.deepcopy(caller)
    rollout = AsyncRollout(agent_loop(), max_staleness=1)
    rollout.bind(model, tok)
    stream = rollout.stream(PromptData(rows[0], seed=0).loader(2, tok))
    try:
        assert next(stream)[K.POLICY_VERSION].tolist() == [0] * 4 and len(rollout.in_flight) == 1
        push_two_updates(rollout, model)
        again = next(stream)
        assert rollout.stats["async/over_bound_frac"] == 1 and rollout.stats["async/regenerated_samples"] == 4
        assert again[K.POLICY_VERSION].tolist() == [2] * 4
        mask = again[K.RESPONSE_MASK].bool()
        assert (Policy(model, tok)(again.clone())[K.OLD_LOG_PROBS] - again[K.ROLLOUT_LOG_PROBS])[mask].abs().max() < 1e-5
        greedy = rollout.with_options(n=1, do_sample=False)
        val = greedy(next(iter(PromptData(rows[1], seed=0).loader(2, tok))))
        assert "num_turns/mean" in greedy.stats
        mask = val[K.RESPONSE_MASK].bool()
        assert (Policy(model, tok)(val.clone())[K.OLD_LOG_PROBS] - val[K.ROLLOUT_LOG_PROBS])[mask].abs().max() < 1e-4
    finally:
        stream.close()
        rollout.close()


class SlowEngine(Engine):
    """Takes ``seconds`` per call and notes when it was closed and whether a call was running then."""

    def __init__(self, seconds):
        self.seconds, self.running, self.closed_while_running = seconds, False, None

    def generate(self, prompts, params):
        self.running = True
        time.sleep(self.seconds)
        self.running = False
        return [[Completion([1], [-0.5])] for _ in prompts]

    def close(self):
        self.closed_while_running = self.running


def test_closing_a_threaded_engine_waits_for_the_running_job():
    engine = SlowEngine(0.3)
    threaded = ThreadedEngine(engine)
    threaded.submit([[1, 2]], SamplingParams(max_new_tokens=1))
    later = threaded.submit([[1, 2]], SamplingParams(max_new_tokens=1))
    while not engine.running:
        time.sleep(0.01)
    threaded.close()
    assert engine.closed_while_running is False and threaded.jobs[later].cancelled()
    assert not any(t.name.startswith("rlflow-async-engine") for t in threading.enumerate())


def test_an_agent_loop_is_not_placed_in_a_process():
    with pytest.raises(ValueError, match="placement must be 'thread' or 'auto', not 'process'"):
        AsyncRollout(agent_loop(), placement="process")


def test_one_step_off_runs_each_row_with_the_agent_loop_it_names(tok, caller, rows):
    """verl's per-row agent_name one step off: the batch's whole loop, a job on the engine's thread, runs each row
    with its loop; so does validation (a copy over the validation rollout, on the same thread)."""
    from tests.rollout.test_agent_names import alpha_every_other_row, each_row_ran_its_loop, tagging_loop

    rollout = AsyncRollout(tagging_loop(), max_staleness=1)
    rollout.bind(copy.deepcopy(caller), tok)
    stream = rollout.stream(PromptData(alpha_every_other_row(rows[0]), seed=0).loader(4, tok))
    try:
        each_row_ran_its_loop(next(stream))
        greedy = rollout.with_options(n=1, do_sample=False)
        each_row_ran_its_loop(greedy(next(iter(PromptData(alpha_every_other_row(rows[1]), seed=0).loader(4, tok)))))
    finally:
        stream.close()
        rollout.close()
