"""Multi-turn agent rollouts in the fully asynchronous mode: FullyAsyncRollout over an AgentLoop with the calculator
tool, on a tiny transformers model taught to call it. A conversation that a weight update lands in has tokens of
two versions, each with the log-prob of the weights that sampled it; tool tokens are masked with version -1; a
training run keeps every sample within the threshold; the prompts in flight survive a checkpoint and a kill."""

import copy

import pytest
import torch

from rlflow import Policy, PromptData
from rlflow.data import keys as K
from rlflow.rollout import FullyAsyncRollout
from rlflow.rollout.engines.base import Engine
from rlflow.tasks.calculator import CalculatorTask
from tests.rollout.test_agent_training import interior_spans
from tests.rollout.test_agent_names import alpha_every_other_row, each_row_ran_its_loop, tagging_loop
from tests.rollout.test_async_agent import agent_loop, caller, make_trainer, rows, tok  # noqa: F401 - fixtures
from tests.rollout.test_async_rollout import Recorder, recomputed
from tests.rollout.test_fully_async import perturbed, trains_every_drawn_prompt_once


class PushAfter(Engine):
    """The driver's engine, pushing ``weights`` to ``rollout`` right after its ``calls``-th chunk, as a trainer
    would while conversations are in flight."""

    def __init__(self, engine, rollout, weights, calls):
        self.engine, self.rollout, self.weights, self.calls, self.count = engine, rollout, weights, calls, 0

    def generate(self, prompts, params):
        out = self.engine.generate(prompts, params)
        self.count += 1
        if self.count == self.calls:
            self.rollout.sync_weights(self.weights)
        return out

    def load_weights(self, buckets):
        return self.engine.load_weights(buckets)


def log_probs(model, tok, batch):
    return Policy(model, tok)(batch.clone())[K.OLD_LOG_PROBS]


def test_a_conversation_a_weight_update_lands_in_has_each_tokens_log_prob_from_the_weights_that_sampled_it(
        tok, caller, rows):
    """v1 is pushed after the third chunk: the conversations in flight go on under it, between turns or within
    one. Their model tokens carry version 0 or 1, each with the log-prob of that version's weights (1e-5); the tool
    tokens between turns are masked, log-prob 0, version -1; policy_version / _max are the oldest / newest."""
    v0, v1 = copy.deepcopy(caller), perturbed(caller, scale=0.05)
    rollout = FullyAsyncRollout(agent_loop(), max_off_policy_threshold=None, chunk_tokens=4)
    rollout.bind(v0, tok)
    assert rollout.placement == "thread" and rollout.partial_path == "chunks" and rollout.max_new_tokens == 64
    assert rollout.driving.rollout.engine.model is not v0  # the driver samples with a copy, never the trained module
    rollout.engine = PushAfter(rollout.engine, rollout, v1, calls=3)
    stream = rollout.stream(PromptData(rows[0], seed=0).loader(2, tok))
    torch.manual_seed(0)
    try:
        batches = [next(stream) for _ in range(3)]
    finally:
        stream.close()
        rollout.close()
    straddling = across = 0
    for batch in batches:
        mask, versions = batch[K.RESPONSE_MASK].bool(), batch[K.TOKEN_POLICY_VERSION]
        sampled = batch[K.ROLLOUT_LOG_PROBS]
        assert (versions[mask] >= 0).all() and (versions[~mask] == -1).all()
        assert (sampled[interior_spans(batch[K.RESPONSE_MASK])] == 0).all()
        assert torch.equal(torch.where(mask, versions, 99).min(-1).values, batch[K.POLICY_VERSION])
        assert torch.equal(versions.max(-1).values, batch[K.POLICY_VERSION_MAX])
        for version, weights in ((0, v0), (1, v1)):
            mine = mask & (versions == version)
            if mine.any():
                assert (log_probs(weights, tok, batch)[mine] - sampled[mine]).abs().max() < 1e-5
        both = (batch[K.POLICY_VERSION] == 0) & (batch[K.POLICY_VERSION_MAX] == 1)
        if both.any():  # v0 would not give the tokens v1 sampled: the check above can fail
            later = mask & (versions == 1) & both[:, None]
            assert (log_probs(v0, tok, batch)[later] - sampled[later]).abs().max() > 1e-3
        straddling += int(both.sum())
        holes = interior_spans(batch[K.RESPONSE_MASK])  # the tool tokens between two model turns
        for row in holes.any(-1).nonzero()[:, 0].tolist():
            first = int(holes[row].nonzero()[0])
            across += bool((versions[row, :first] == 0).any() and (versions[row, first:] == 1).any())
    assert straddling > 0 and across > 0  # v0 before a tool call, v1 after it: the update landed mid-conversation
    assert rollout.stats["async/partial_frac"] >= 0 and "num_turns/mean" in rollout.stats


def test_a_fully_async_multi_turn_run_trains_within_the_threshold(tok, caller, rows, tmp_path):
    """A training run with the tool: every token's rollout log-prob is that of the recorded weights of its own
    version, no trained sample is older than max_off_policy_threshold=2, and verl's off-policy metrics and the
    agent's metrics are logged."""
    recorder, steps = Recorder(), 4
    rollout = FullyAsyncRollout(agent_loop(), max_off_policy_threshold=2, chunk_tokens=8)
    model = copy.deepcopy(caller)
    trainer = make_trainer(model, tok, rollout, tmp_path, steps=steps, callbacks=[recorder])
    torch.manual_seed(0)
    try:
        history = trainer.fit(PromptData(rows[0], seed=0))
    finally:
        rollout.close()
    assert len(history) == steps and any(not torch.equal(w, recorder.weights[-1][k])
                                         for k, w in recorder.weights[0].items())  # it trained
    for step, (batch, metrics) in enumerate(zip(recorder.batches, history)):
        mask, versions = batch[K.RESPONSE_MASK].bool(), batch[K.TOKEN_POLICY_VERSION]
        assert step - int(batch[K.POLICY_VERSION].min()) <= 1 and int(versions.max()) <= step  # age <= 2
        for version in versions[mask].unique().tolist():
            mine = mask & (versions == version)
            expected = recomputed(caller, tok, recorder.weights[version], batch)
            assert (expected[mine] - batch[K.ROLLOUT_LOG_PROBS][mine]).abs().max() < 1e-5
        assert metrics["training/off_policy/trajectory_staleness_worst/max"] == float(
            (step - batch[K.POLICY_VERSION]).max()) <= 1
        assert "tool_call_counts/mean" in metrics and metrics["rollout_corr/rollout_is_mean"] > 0
    assert max(m["training/off_policy/trajectory_staleness_worst/max"] for m in history) == 1  # it ran ahead
    assert sum(m["agent/tool_calls/mean"] for m in history) > 0


def test_an_agent_loop_is_not_placed_in_a_process():
    with pytest.raises(ValueError, match="placement must be 'thread' or 'auto', not 'process'"):
        FullyAsyncRollout(agent_loop(), placement="process")


def test_pause_mode_keep_is_refused_for_an_agent_loop(tok, caller):
    rollout = FullyAsyncRollout(agent_loop(), pause_mode="keep")
    with pytest.raises(ValueError, match="an agent loop's turns are requests of their own, generated by chunks"):
        rollout.bind(copy.deepcopy(caller), tok)
    rollout.close()


def test_a_batch_of_the_wrapped_agent_loop_and_validation_sample_in_the_trainers_process(tok, caller, rows):
    rollout = FullyAsyncRollout(agent_loop(), max_off_policy_threshold=2)
    model = copy.deepcopy(caller)
    rollout.bind(model, tok)
    try:
        greedy = rollout.with_options(n=1, do_sample=False)
        assert greedy.rollout.engine.model is model
        batch = greedy(next(iter(PromptData(rows[1], seed=0).loader(2, tok))))
        assert "num_turns/mean" in greedy.stats and batch[K.NUM_TURNS].shape == (2,)
    finally:
        rollout.close()


def test_a_multi_turn_run_killed_mid_step_and_resumed_trains_every_drawn_prompt_once(tok, caller, tmp_path):
    """SIGKILL in step 3's update, then ``resume="auto"``: the conversations in flight at the checkpoint start over
    from their prompts, the loader resumes after the last prompt drawn; no prompt is lost or trained twice."""
    trains_every_drawn_prompt_once(
        tmp_path, lambda: FullyAsyncRollout(agent_loop(), max_off_policy_threshold=2, max_off_policy_strategy="wait",
                                            chunk_tokens=8),
        lambda: Policy(copy.deepcopy(caller), tok), PromptData(CalculatorTask().splits()[0][:64], seed=0),
        K.RAW_PROMPT, steps=4)



def test_fully_async_runs_each_row_with_the_agent_loop_it_names(tok, caller, rows):
    """verl's per-row agent_name in the fully asynchronous mode: the driver runs each conversation with its row's
    loop (rlflow.rollout.agent.named), and each sample keeps its row's name. The short alpha conversations end
    first, so the first batches may hold only them: every training row's sample is checked."""
    rollout = FullyAsyncRollout(tagging_loop(), max_off_policy_threshold=None)
    rollout.bind(copy.deepcopy(caller), tok)
    stream = rollout.stream(PromptData(alpha_every_other_row(rows[0]), seed=0).loader(4, tok))
    try:
        each_row_ran_its_loop(*[next(stream) for _ in range(len(rows[0]) // 4)])
    finally:
        stream.close()
        rollout.close()
