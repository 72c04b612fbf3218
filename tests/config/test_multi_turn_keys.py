"""verl's multi-turn keys through the verl entry point: the GSM8K-with-tools example runs, errors name keys."""

import json
import shutil
from pathlib import Path

import pytest

import rlflow.config.verl.devices as devices
from rlflow.config import load_config, make_plan
from rlflow.config.verl.build import build_trainer
from rlflow.models.tiny import tiny_qwen2
from rlflow.rollout.agent import AgentLoop
from rlflow.rollout.tools import Calculator, Gsm8kTool
from rlflow.tasks.calculator import chat_tokenizer
from rlflow.trainer.main_ppo import main
from tests.config.test_main_ppo import steps
from tests.real_model.helpers import requires_vllm  # without vLLM the dry run stops at its install hint

ROOT = Path(__file__).parents[2]
MT = "actor_rollout_ref.rollout.multi_turn"


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    """A tiny model whose tokenizer has a ChatML template with tools (rlflow.tasks.calculator)."""
    path = tmp_path_factory.mktemp("tiny-chat-model")
    tok = chat_tokenizer()
    tiny_qwen2(len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
               max_positions=2048, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gsm8k_tool_data(tmp_path_factory):
    """verl-layout GSM8K rows with tools_kwargs, written by scripts/data_preprocess/gsm8k_multiturn_w_tool.py."""
    import importlib.util

    tmp = tmp_path_factory.mktemp("gsm8k-raw")
    rows = [{"question": f"What is {a} times {b}?", "answer": f"{a}*{b} = <<{a}*{b}={a * b}>>{a * b}\n#### {a * b}"}
            for a, b in [(3, 4), (5, 6), (7, 8), (9, 2)]]
    for split in ("train", "test"):
        (tmp / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    path = ROOT / "scripts" / "data_preprocess" / "gsm8k_multiturn_w_tool.py"
    spec = importlib.util.spec_from_file_location("gsm8k_multiturn_w_tool", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--local_dataset_path", str(tmp), "--local_save_dir", str(tmp / "out")]) == 0
    return tmp / "out"


def example_args(config_dir, model_dir, data_dir, run_dir):
    return ["--config-path", str(config_dir), "--config-name", "gsm8k_multiturn_grpo",
            f"data.train_files={data_dir}/train.parquet", f"data.val_files={data_dir}/test.parquet",
            f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.name=hf",
            "trainer.device=cpu", "trainer.n_gpus_per_node=1", "data.train_batch_size=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.n=2",
            "data.max_response_length=32", "trainer.total_training_steps=1", "trainer.val_before_train=false",
            f"trainer.default_local_dir={run_dir}", "actor_rollout_ref.model.enable_gradient_checkpointing=false"]


@pytest.fixture
def example(tmp_path, chat_model_dir, gsm8k_tool_data, monkeypatch):
    """The example YAML, run from the repository root (its tool_config_path is relative, as verl's)."""
    config = tmp_path / "config"
    shutil.copytree(ROOT / "examples" / "config", config)
    monkeypatch.chdir(ROOT)
    return example_args(config, chat_model_dir, gsm8k_tool_data, tmp_path / "run")


def test_gsm8k_multiturn_example_trains_with_its_tools(example, capsys):
    cfg = load_config(example[4:], config_file=Path(example[1]) / "gsm8k_multiturn_grpo.yaml")
    plan = make_plan(cfg)
    assert [type(t) for t in plan.agent["tools"]] == [Calculator, Gsm8kTool]
    assert plan.agent["max_assistant_turns"] == 5 and plan.agent["format"] == "hermes"
    trainer, data = build_trainer(plan)
    assert isinstance(trainer.rollout, AgentLoop) and trainer.rollout.max_new_tokens == 32
    assert data.train[0]["extra_info"]["tools_kwargs"]["calc_gsm8k_reward"]["create_kwargs"]["ground_truth"] == "12"
    assert main(example) == 0
    logged = steps(capsys.readouterr().out)
    for key in ("num_turns/mean", "tool_call_counts/mean", "agent/tool_error_rate", "agent/masked_tokens/mean"):
        assert key in logged[1]


def test_dry_run_shows_the_agent_loop(example, capsys):
    assert main(example + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "rollout=AgentLoop(rollout=HFRollout(" in out
    assert "tools=load_tool_config(path=" in out and "Not said by the tree yet" not in out  # the run loads them so


@pytest.mark.parametrize("override, message", [
    (f"{MT}.format=gpt-oss", "the 'gpt-oss' tool-call format is not supported yet"),
    (f"{MT}.max_parallel_calls=0", f"{MT}.max_parallel_calls=0: must be an integer >= 1"),
    (f"{MT}.max_assistant_turns=0", f"{MT}.max_assistant_turns=0: must be an integer >= 1 or null"),
    (f"{MT}.tool_response_truncate_side=top", "choose from left, right, middle"),
    (f"{MT}.enable=false", f"{MT}.enable=True for multi-turn"),
    (f"{MT}.tool_config_path=/no/such/tools.yaml", f"{MT}.tool_config_path: /no/such/tools.yaml: no such file"),
    ("actor_rollout_ref.rollout.agent.default_agent_loop=react_agent",
     "default_agent_loop='react_agent': not one of rlflow's (single_turn_agent, tool_agent) and not in "
     "actor_rollout_ref.rollout.agent.agent_loop_config_path"),
])
def test_bad_multi_turn_keys_are_named(example, capsys, override, message):
    assert main(example + [override]) == 2
    assert message in capsys.readouterr().err


def test_interaction_config_and_inert_keys(example, capsys):
    interaction = ROOT / "examples" / "config" / "interaction_config" / "gsm8k_interaction_config.yaml"
    assert main(example + ["--dry-run", f"{MT}.interaction_config_path={interaction}",
                           f"{MT}.use_inference_chat_template=true"]) == 0
    out = capsys.readouterr().out
    assert "interaction=['gsm8k']" in out
    assert f"{MT}.use_inference_chat_template=True has no effect in rlflow: rlflow never re-renders" in out


def test_multi_turn_runs_one_step_off(example, capsys):
    """multi_turn.enable with trainer.async_weight_update: the agent loop runs beside the trainer, one step off
    (dry run: the tree; a real run of 2 steps: the second batch was sampled one version back, with its tools)."""
    one_step_off = example + ["trainer.async_weight_update=true"]
    assert main(one_step_off + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "rollout=AsyncRollout(rollout=AgentLoop(rollout=HFRollout(" in out and "max_staleness=1" in out
    assert main(one_step_off + ["trainer.total_training_steps=2"]) == 0
    logged = steps(capsys.readouterr().out)
    assert logged[1]["async/staleness_max"] == 0 and logged[2]["async/staleness_max"] == 1
    assert all("tool_call_counts/mean" in logged[s] and "rollout_corr/rollout_is_mean" in logged[s] for s in (1, 2))


@pytest.mark.parametrize("fully_async", [["trainer.use_v1=true", "trainer.v1.trainer_mode=colocate_async"],
                                         ["trainer.use_v1=true", "trainer.v1.trainer_mode=separate_async"],
                                         ["async_training.partial_rollout=true", "async_training.staleness_threshold=1"]])
def test_multi_turn_with_fully_asynchronous_generation_shows_the_agent_loop_inside(example, capsys, fully_async):
    assert main(example + fully_async + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "rollout=FullyAsyncRollout(rollout=AgentLoop(rollout=HFRollout(" in out
    assert "the rollout is FullyAsyncRollout(AgentLoop(...))" in " ".join(out.split())


def test_multi_turn_runs_fully_asynchronously(example, capsys):
    """verl V1's colocate_async with multi_turn.enable, 2 steps: the conversations (tools and all) are generated
    beside training, and verl's off-policy metrics and the agent's are logged."""
    assert main(example + ["trainer.use_v1=true", "trainer.v1.trainer_mode=colocate_async",
                           "trainer.total_training_steps=2"]) == 0
    logged = steps(capsys.readouterr().out)
    for step in (1, 2):
        assert "tool_call_counts/mean" in logged[step] and "rollout_corr/rollout_is_mean" in logged[step]
        assert "training/off_policy/trajectory_staleness_worst/max" in logged[step]
    assert logged[2]["async/policy_version"] == 1


@pytest.mark.parametrize("override, message", [
    ("async_training.pause_mode=keep", "async_training.pause_mode=keep with multi_turn.enable: an agent loop's turns"),
    pytest.param("actor_rollout_ref.rollout.name=vllm", "(trainer.v1.trainer_mode='colocate_async') on VLLMRollout: "
                 "the conversations are generated from a thread beside the trainer", marks=requires_vllm),
])
def test_multi_turn_fully_async_refusals_name_why(example, capsys, override, message):
    assert main(example + ["trainer.use_v1=true", "trainer.v1.trainer_mode=colocate_async", override]) == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_multi_turn_fully_async_over_a_server(example, capsys):
    """A server takes requests from the driver's thread and the trainer's: accepted (dry run)."""
    assert main(example + ["trainer.use_v1=true", "trainer.v1.trainer_mode=colocate_async", "--dry-run",
                           "actor_rollout_ref.rollout.name=vllm",
                           "actor_rollout_ref.rollout.server.url=http://127.0.0.1:1"]) == 0
    assert "rollout=FullyAsyncRollout(rollout=AgentLoop(rollout=ServerRollout(" in capsys.readouterr().out


# ------------------------------------------------------------------ custom agent loops (agent_loop_config_path)
AGENT = "actor_rollout_ref.rollout.agent"
VERL_LOOP = '''
from typing import Any

from verl.experimental.agent_loop import AgentLoopBase, AgentLoopOutput


class MyAgentLoop(AgentLoopBase):
    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        ...
'''


def test_a_custom_agent_loop_from_the_config_file_runs_each_conversation(example, capsys):
    """examples/agent_loop/agent_loops.yaml lists ThinkTwice: a draft of at most 4 tokens, a user nudge, an answer."""
    loops = [f"{AGENT}.agent_loop_config_path=examples/agent_loop/agent_loops.yaml",
             f"{AGENT}.default_agent_loop=think_twice"]
    trainer, _ = build_trainer(make_plan(load_config(example[4:] + loops,
                                                     config_file=Path(example[1]) / "gsm8k_multiturn_grpo.yaml")))
    assert type(trainer.rollout).__name__ == "ThinkTwice" and trainer.rollout.draft_tokens == 4
    assert isinstance(trainer.rollout, AgentLoop) and trainer.rollout.max_assistant_turns == 5  # the multi-turn keys'
    assert main(example + loops) == 0
    logged = steps(capsys.readouterr().out)[1]
    assert logged["num_turns/min"] == logged["num_turns/max"] == 4  # prompt, draft, nudge, answer (verl's count)


def test_a_verl_agent_loop_is_refused_with_what_to_change(example, tmp_path, capsys):
    (tmp_path / "my_loop.py").write_text(VERL_LOOP)
    (tmp_path / "loops.yaml").write_text(f"- name: mine\n  _target_: {tmp_path}/my_loop.py:MyAgentLoop\n")
    assert main(example + [f"{AGENT}.agent_loop_config_path={tmp_path}/loops.yaml",
                           f"{AGENT}.default_agent_loop=mine"]) == 2
    err = capsys.readouterr().err
    assert (f"mine._target_='{tmp_path}/my_loop.py:MyAgentLoop': class MyAgentLoop in {tmp_path}/my_loop.py is "
            "written against verl's agent-loop interface (it subclasses verl's AgentLoopBase; it implements verl's "
            "run(sampling_params, **kwargs) -> AgentLoopOutput)") in err
    assert "Change it to subclass rlflow.rollout.agent.AgentLoop and override run_one(self, t, sampler)" in err
    (tmp_path / "loops.yaml").write_text("- name: mine\n")
    assert main(example + [f"{AGENT}.agent_loop_config_path={tmp_path}/loops.yaml",
                           f"{AGENT}.default_agent_loop=mine"]) == 2
    assert "entry 0 ({'name': 'mine'}) needs name and _target_" in capsys.readouterr().err
