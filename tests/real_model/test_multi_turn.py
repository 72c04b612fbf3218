"""Multi-turn token continuity with SmolLM2's real chat template: through the AgentLoop, a calculator call, its
result and the final answer are exactly the chat template's rendering of the conversation, token for token.

SmolLM2 writes ``<|im_end|>`` to end a turn and its template follows that with ``"\\n"`` before the next
``<|im_start|>``; a loop that appends only the rendered tool message loses that separator on every tool turn (verl
users lost it so), and the policy is then trained on a sequence the sampler never saw. Two worked examples in the
prompt make the 135M model call the tool (greedy, float32: ``31*4`` -> ``124`` -> "31*4 = 124.").
"""

from __future__ import annotations

import json

import pytest
import torch

from rlflow import HFRollout
from rlflow.data import keys as K
from rlflow.data.prompts import collate, load_rows
from rlflow.rollout.agent import AgentLoop
from rlflow.rollout.tools import Calculator
from tests.real_model.helpers import EOS


def call(expression: str) -> str:
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "</tool_call>"


def worked(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": f"Use the calculator: what is {question}?"},
            {"role": "assistant", "content": call(question)}, {"role": "tool", "content": answer},
            {"role": "assistant", "content": f"{question} = {answer}."}]


PROMPT = worked("12*7", "84") + worked("5+9", "14") + [{"role": "user", "content": "Use the calculator: what is 31*4?"}]


@pytest.fixture(scope="module")
def conversation(policy, tok):
    loop = AgentLoop(HFRollout(n=1, do_sample=False, max_new_tokens=64), [Calculator()], max_assistant_turns=2)
    loop.bind(policy.model, tok)
    rows, _ = load_rows([{"prompt": PROMPT, "ground_truth": "124", "data_source": "real_model"}])
    return policy(loop(collate(rows, tok)))


def test_the_model_calls_the_tool_and_answers(conversation):
    info = conversation[K.EXTRA_INFO][0]
    new = info["messages"][len(PROMPT):]
    assert [m["role"] for m in new] == ["assistant", "tool", "assistant"]
    assert new[0]["content"] == call("31*4") and new[1]["content"] == "124" and "124" in new[2]["content"]
    assert info["tool_calls"] == 1 and info["finish_reason"] == "answer" and int(conversation[K.NUM_TURNS][0]) == 4


def test_trained_tokens_are_the_chat_template_rendering_of_the_conversation(conversation, tok):
    prompt = conversation[K.PROMPT_IDS][0][conversation[K.PROMPT_MASK][0].bool()].tolist()
    mask = conversation[K.RESPONSE_MASK][0]
    last = int(mask.nonzero().max()) + 1
    response, mask = conversation[K.RESPONSE_IDS][0, :last].tolist(), mask[:last].tolist()
    messages = conversation[K.EXTRA_INFO][0]["messages"]
    rendered = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert rendered[-2:] == [EOS, *tok("\n", add_special_tokens=False)["input_ids"]]
    assert prompt + response == rendered[:-1]  # all but the template's "\n" after the final <|im_end|>

    # spans: model turn (mask 1, ends with its EOS) | "\n" + tool message + generation prompt (mask 0) | model turn
    first_end = mask.index(0)
    second = mask.index(1, first_end)
    assert mask == [1] * first_end + [0] * (second - first_end) + [1] * (last - second)
    assert response[first_end - 1] == EOS
    between = tok.decode(response[first_end:second])
    assert between == "\n<|im_start|>tool\n124<|im_end|>\n<|im_start|>assistant\n"  # the separator is there, untrained
    assert response[-1] == EOS


def test_the_policy_scores_the_same_context_the_sampler_saw(conversation):
    """The trajectory is the context each turn was sampled from (the loop appends ids and never re-tokenizes text), so
    the policy, scoring the whole sequence at once, recomputes the sampler's log-probs on every model token."""
    mask = conversation[K.RESPONSE_MASK].bool()
    gap = (conversation[K.ROLLOUT_LOG_PROBS] - conversation[K.OLD_LOG_PROBS])[mask].abs().max()
    assert gap < 1e-4
    assert conversation[K.ROLLOUT_LOG_PROBS][~mask].eq(0).all()
    assert mask.sum() > 30 and (~mask[0, : int(mask[0].nonzero().max())]).sum() > 10
    assert torch.isfinite(conversation[K.OLD_LOG_PROBS]).all()
