"""One agent loop, every engine: AgentLoop around VLLMRollout (in-process vLLM) and ServerRollout (a vLLM server),
with the session's shared engine and server (tests/rollout/conftest.py). The sampler's log-probs on the model's
turns equal the policy's recomputation on the concatenated multi-turn sequence, as with transformers.

The session model is the engine tests' char-level model (no Hermes tokens in its alphabet), so the model's every
turn is read as one call of a counting tool by a parser written here: the point is the loop over the engine, not
the call format (tested in test_agent_loop.py).
"""

import pytest
import torch

from rlflow.data import keys as K
from rlflow.data.prompts import collate, load_rows
from rlflow.models.policy import Policy
from rlflow.rollout.agent import AgentLoop
from rlflow.rollout.tools import FunctionTool, ToolCall, ToolParser
from tests.rollout.conftest import ENGINE_OPTIONS, MAX_MODEL_LEN, requires_vllm

PROMPTS = ("12+34=", "5+6=", "99+99=")


class EveryTurnCalls(ToolParser):
    """Each model turn is one call of ``count`` with the turn's text."""

    def parse(self, text):
        return "", [ToolCall("count", {"text": text})]


COUNT = FunctionTool(lambda text: str(len(text)), name="count", description="count characters",
                     parameters={"type": "object", "properties": {"text": {"type": "string"}}})


def run_loop(rollout, policy, **options):
    loop = AgentLoop(rollout, [COUNT], format=EveryTurnCalls(), max_assistant_turns=3,
                     max_response_tokens=MAX_MODEL_LEN - 8, **options)
    rows, _ = load_rows([{"prompt": p, "ground_truth": ""} for p in PROMPTS])
    out = loop(collate(rows, policy.tokenizer))
    mask = out[K.RESPONSE_MASK].bool()
    after_tool = mask & ((~mask).long().cumsum(-1) > 0) & (mask.long().cumsum(-1) > 0)
    assert after_tool.any(), "no model turn followed a tool message"
    with torch.no_grad():
        log_probs, _ = policy.log_probs(out)
    assert (log_probs - out[K.ROLLOUT_LOG_PROBS])[mask].abs().max().item() < 1e-4
    assert (out[K.ROLLOUT_LOG_PROBS][~mask] == 0).all()
    return loop, out


@requires_vllm
def test_agent_loop_over_in_process_vllm(vllm_engine, vllm_model_dir):
    from rlflow.rollout import VLLMRollout

    policy = Policy.from_pretrained(vllm_model_dir)
    # seeded: the session's engine is shared, so unseeded samples would depend on the tests that ran before
    rollout = VLLMRollout(n=2, max_new_tokens=16, seed=1, **ENGINE_OPTIONS)
    rollout.bind(policy.model, policy.tokenizer)
    assert rollout.engine.llm is vllm_engine[0].llm
    loop, out = run_loop(rollout, policy)
    assert loop.stats["agent/tool_calls/mean"] >= 1 and out.batch_size[0] == 6



@requires_vllm
def test_agent_loop_over_in_process_vllm_one_step_off(vllm_engine, vllm_model_dir):
    """AsyncRollout runs the loop over the in-process engine on a thread: the batch generated ahead keeps the
    weights it was submitted under (version 0) though new ones were pushed meanwhile, and its log-probs on the
    model's turns are those weights'; the next batch samples with the pushed ones (version 1)."""
    from rlflow.rollout import AsyncRollout, VLLMRollout

    policy, before = Policy.from_pretrained(vllm_model_dir), Policy.from_pretrained(vllm_model_dir)
    loop = AgentLoop(VLLMRollout(n=2, max_new_tokens=16, seed=1, **ENGINE_OPTIONS), [COUNT], format=EveryTurnCalls(),
                     max_assistant_turns=3, max_response_tokens=MAX_MODEL_LEN - 8)
    rollout = AsyncRollout(loop, max_staleness=1)
    rollout.bind(policy.model, policy.tokenizer)
    rows, _ = load_rows([{"prompt": p, "ground_truth": ""} for p in PROMPTS])
    stream = rollout.stream(collate(rows, policy.tokenizer) for _ in range(3))
    try:
        assert next(stream)[K.POLICY_VERSION].tolist() == [0] * 6 and len(rollout.in_flight) == 1
        with torch.no_grad():
            for p in policy.model.parameters():
                p.mul_(1.05)
        rollout.sync_weights(policy.model)
        for version, sampler, other in ((0, before, policy), (1, policy, before)):
            out = next(stream)
            mask = out[K.RESPONSE_MASK].bool()
            assert out[K.POLICY_VERSION].tolist() == [version] * 6 and rollout.stats["agent/tool_calls/mean"] >= 1
            with torch.no_grad():
                assert (sampler.log_probs(out)[0] - out[K.ROLLOUT_LOG_PROBS])[mask].abs().max().item() < 1e-4
                assert (other.log_probs(out)[0] - out[K.ROLLOUT_LOG_PROBS])[mask].abs().max().item() > 1e-3
    finally:
        stream.close()
        rollout.close()
    assert vllm_engine[0].llm is not None  # the session's shared engine stays open for the other tests


@requires_vllm
def test_agent_loop_over_a_server(vllm_server, vllm_model_dir, tmp_path):
    from rlflow.rollout import ServerRollout

    policy = Policy.from_pretrained(vllm_model_dir)
    rollout = ServerRollout(vllm_server, n=2, max_new_tokens=16, seed=1, checkpoint_dir=tmp_path / "weights")
    rollout.bind(policy.model, policy.tokenizer)
    loop, out = run_loop(rollout, policy, concurrent_requests=True)  # the server batches requests itself
    # seeded, so the same samples reach a tool each run (those whose first turn ends before the budget does)
    assert loop.stats["agent/tool_calls/mean"] > 0 and out.batch_size[0] == 6
