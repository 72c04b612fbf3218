"""A TorchRL LLM environment (ChatEnv + TorchRL's PythonInterpreter transform) drives the agent loop."""

import pytest

from rlflow.data import keys as K
from rlflow.rollout.agent import AgentLoop, ChatFormat
from rlflow.rollout.agent.torchrl_env import TorchRLEnvironment
from rlflow.tasks.calculator import chat_tokenizer
from rlflow import Batching, Loop, Optim, RunDir
from tests.rollout.agent_helpers import prompts, replay_rollout

llm_envs = pytest.importorskip("torchrl.envs.llm")


def test_torchrl_python_interpreter_answers_the_models_code(tok=None):
    from torchrl.envs.llm.transforms import PythonInterpreter

    tok = chat_tokenizer()

    def script(context):
        if "<|im_start|>tool" not in context:
            question = context.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
            return f"```python\nprint({question})\n```"
        output = context.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0]
        return "answer: " + output.splitlines()[-1]

    env = TorchRLEnvironment(lambda: llm_envs.ChatEnv(batch_size=(1,)).append_transform(PythonInterpreter(timeout=20)))
    loop = AgentLoop(replay_rollout(tok, script), environment=env, max_assistant_turns=3)
    out = loop(prompts(tok, ["6*7", "2**10"]))
    for row, expected in enumerate(["42", "1024"]):
        messages = out[K.EXTRA_INFO][row]["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
        assert messages[2]["content"] == f"Code block 1 executed successfully:\n{expected}\n"  # TorchRL's own text
        assert messages[3]["content"] == f"answer: {expected}"
        assert out[K.EXTRA_INFO][row]["finish_reason"] == "answer"
        # the tool output is in the trajectory, rendered by the chat template, with mask 0
        chat = ChatFormat(tok)
        p, r = out[K.PROMPT_MASK][row].bool(), out[K.RESPONSE_MASK][row]
        last = int(r.nonzero().max()) + 1
        trajectory = out[K.PROMPT_IDS][row][p].tolist() + out[K.RESPONSE_IDS][row][:last].tolist()
        assert trajectory == chat.encode(chat.render(messages, add_generation_prompt=False))[:-1]
        code_output = tok(f"Code block 1 executed successfully:\n{expected}\n", add_special_tokens=False)["input_ids"]
        response = out[K.RESPONSE_IDS][row].tolist()
        start = next(i for i in range(len(response)) if response[i: i + len(code_output)] == code_output)
        assert r[start: start + len(code_output)].sum() == 0
    assert loop.stats["agent/finish/answer"] == 1.0 and loop.stats["num_turns/mean"] == 4


def test_torchrl_reward_transform_scores_the_conversation():
    """TorchRL's GSM8KRewardParser (reading the row's answer, given at reset) writes ("next", "reward") and ends the
    conversation when the model answers; the reward becomes the trajectory's step reward, which WithStepRewards adds
    to the score: a TorchRL environment with its own reward trains as it is."""
    from torchrl.envs.llm.reward import GSM8KRewardParser
    from torchrl.envs.llm.transforms import PythonInterpreter

    from rlflow.rewards import FunctionReward
    from rlflow.rewards.steps import WithStepRewards

    tok = chat_tokenizer()

    def script(context):
        if "<|im_start|>tool" not in context:
            return "```python\nprint(6*7)\n```"
        output = context.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0].splitlines()[-1]
        return f"<think>the code says {output}</think><answer>{output if 'right' in context else 41}</answer>"

    def make_env():
        env = llm_envs.ChatEnv(batch_size=(1,)).append_transform(PythonInterpreter(timeout=20))
        return env.append_transform(GSM8KRewardParser(eos_token="<|im_end|>"))

    env = TorchRLEnvironment(make_env, reset_data=lambda row: {"answer": row["extra_info"]["answer"]})
    loop = AgentLoop(replay_rollout(tok, script), environment=env, max_assistant_turns=4)
    rows = prompts(tok, ["right: 6*7?", "wrong: 6*7?"], [{"answer": "6*7 = 42\n#### 42"}] * 2)
    out = loop(rows)
    # TorchRL's parser: 1.0 for the right answer, its format reward 0.1 for a wrong one in the right format
    assert out[K.STEP_REWARDS].tolist() == pytest.approx([1.0, 0.1])
    assert [i["finish_reason"] for i in out[K.EXTRA_INFO]] == ["environment", "environment"]  # done on an answer
    scored = WithStepRewards(FunctionReward(lambda response, truth: 0.0))(out)
    assert scored[K.SCORES].tolist() == pytest.approx([1.0, 0.1])


# Hermes calls, as the task's chat tokenizer and the Qwen chat templates write them, for SimpleToolTransform's regex.
HERMES_CALL = r'<tool_call>\s*\{"name":\s*"([^"]+)",\s*"arguments":\s*(\{.*?\})\}\s*</tool_call>'


def multiply(expr: str) -> int:
    left, right = expr.split("*")
    return int(left) * int(right)


def test_a_torchrl_tool_environment_trains_a_real_model(tmp_path):
    """A TorchRL user's environment (ChatEnv + TorchRL's SimpleToolTransform) answers the calls a real transformers
    model samples, and the Trainer takes a GRPO step on those trajectories: TorchRL's tool text is in the response
    with mask 0, the policy's log-probs equal the sampler's on model tokens (truncated-IS weights exactly 1), the
    weights move."""
    import copy

    import torch
    from torchrl.envs.llm.transforms import SimpleToolTransform

    from rlflow.algorithms import GRPO, PPOLoss, TruncatedIS
    from rlflow.models.policy import Policy
    from rlflow.module import Chain
    from rlflow.rewards import FunctionReward
    from rlflow.rollout import HFRollout
    from rlflow.tasks.calculator import CalculatorTask
    from rlflow.trainer.trainer import Trainer
    from tests.rollout.agent_helpers import tool_caller

    tok = chat_tokenizer()
    model = tool_caller(tok, steps=60)
    env = TorchRLEnvironment(lambda: llm_envs.ChatEnv(batch_size=(1,)).append_transform(
        SimpleToolTransform({"calc": multiply}, tool_call_pattern=HERMES_CALL)))
    # the task's tools only list calc(expr) in the prompt, as the model learned it: TorchRL runs the calls
    loop = AgentLoop(HFRollout(n=4, temperature=1.0, max_new_tokens=112), CalculatorTask().tools(), environment=env,
                     max_assistant_turns=2)
    loop.bind(model, tok)
    questions, answers = ["12*34", "56*78", "19*91", "40*25"], ["408", "4368", "1729", "1000"]
    torch.manual_seed(0)
    out = loop(prompts(tok, questions, ground_truths=answers))
    ran = [i for i, info in enumerate(out[K.EXTRA_INFO]) if any(m["role"] == "tool" for m in info["messages"])]
    assert ran, "TorchRL's tool never ran"
    for row in ran:
        tool_text = next(m["content"] for m in out[K.EXTRA_INFO][row]["messages"] if m["role"] == "tool")
        assert tool_text.startswith("Tool ")  # TorchRL's own text ("Tool calc executed successfully:" or "... failed:")
        ids, response = tok(tool_text, add_special_tokens=False)["input_ids"], out[K.RESPONSE_IDS][row].tolist()
        start = next(i for i in range(len(response)) if response[i: i + len(ids)] == ids)
        assert out[K.RESPONSE_MASK][row][start: start + len(ids)].sum() == 0
        assert out[K.RESPONSE_MASK][row][start + len(ids):].sum() > 0  # the model answered after it

    def used_the_tool(data_source, solution_str, ground_truth, extra_info):
        messages = extra_info["messages"]
        return float(any(m["role"] == "tool" and "executed successfully" in m["content"] for m in messages))

    before = copy.deepcopy(model.state_dict())
    trainer = Trainer(
        policy=Policy(model, tok), rollout=loop, reward=FunctionReward(used_the_tool),
        estimator=Chain(TruncatedIS(level="token"), GRPO()), loss=PPOLoss(is_weights=True), optim=Optim(lr=1e-3),
        batching=Batching(batch_size=4), loop=Loop(max_steps=1, progress=False), run=RunDir(path=tmp_path, loggers=()),
    )
    metrics = trainer.step(prompts(tok, questions, ground_truths=answers))
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["rollout_corr/rollout_is_min"] == pytest.approx(1.0, abs=1e-4)
    assert 0 < metrics["critic/score/mean"] < 1 and metrics["agent/masked_tokens/mean"] > 0
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
