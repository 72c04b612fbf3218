"""The reward keys of the verl entry point: reward models, several weighted functions, time-outs, workers."""

import dataclasses
import functools

import pytest

import rlflow.config.verl.devices as devices
from rlflow.config import load_config, make_plan
from rlflow.config.verl.build import build_reward
from rlflow.config.verl.dryrun import dry_run
from rlflow.config.verl.loading import ConfigError, NotSupportedError
from rlflow.config.verl.native import load_native
from rlflow.config.verl.run import unused_notes
from rlflow.config.verl.tree import reward_node
from rlflow.models.tiny import char_tokenizer, tiny_qwen2_reward_model
from rlflow.rewards import (CombinedReward, FunctionReward, ModelReward, RewardError, SandboxFusion, WithRMScore,
                            default_compute_score)
from rlflow.trainer.main_ppo import main

from .conftest import CHAT_TEMPLATE
from .test_main_ppo import steps

FUNCTIONS = '''
import time

def correct(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip() == ground_truth)

def short(completions, **kwargs):
    return [-len(c) / 10 for c in completions]

def with_rm(data_source, solution_str, ground_truth, extra_info=None, rm_score=None):
    return rm_score + 1.0

def hangs(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str[:1] in "0123456789":
        time.sleep(3600)
    return 1.0

def raises(data_source, solution_str, ground_truth, extra_info=None):
    raise ValueError(f"cannot parse {solution_str!r}")

def always_hangs(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(3600)
'''


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-rm")
    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tiny_qwen2_reward_model(len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                            intermediate_size=64, seed=3).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def rewards_py(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(FUNCTIONS)
    return path


def plan_of(tiny, *overrides):
    return make_plan(load_config(tiny + list(overrides)))


def test_reward_model_alone_through_the_entry_point(tiny, rm_dir, capsys):
    rm = [f"reward_model.enable=true", f"reward_model.model.path={rm_dir}", "reward_model.micro_batch_size_per_gpu=3",
          "trainer.total_training_steps=1", "trainer.val_before_train=false"]
    plan = plan_of(tiny, *rm)
    assert plan.reward.mode == "model" and plan.reward.functions == []
    assert any("the reward model's score is the reward, as in verl" in n for n in plan.notes)
    reward = build_reward(plan)
    assert isinstance(reward, ModelReward) and reward.micro_batch_size == 3 and reward.tokenizer is not None
    assert main(tiny + rm) == 0
    logged = steps(capsys.readouterr().out)
    last = logged[max(logged)]
    assert last["critic/score/mean"] != 0.0 and last["reward/errors"] == 0 and "timing_s/reward" in last


def test_the_plan_and_its_reward_are_values_made_once(tiny, rm_dir):
    plan = plan_of(tiny, "reward_model.enable=true", f"reward_model.model.path={rm_dir}")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.notes = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.reward.mode = "sum"
    assert isinstance(plan.notes, tuple)  # building adds notes of its own elsewhere (build.run_notes)


def test_input_tokenizer_null_reads_the_policy_ids(tiny, rm_dir):
    plan = plan_of(tiny, "reward_model.enable=true", f"reward_model.model.path={rm_dir}",
                   "reward_model.model.input_tokenizer=null")
    assert build_reward(plan).tokenizer is None


def test_custom_function_with_the_reward_model(tiny, rm_dir, rewards_py):
    rm = ["reward_model.enable=true", f"reward_model.model.path={rm_dir}", f"custom_reward_function.path={rewards_py}"]
    with pytest.raises(ConfigError, match="alone gives the score.*rm_score.*'correct' does not take"):
        plan_of(tiny, *rm, "custom_reward_function.name=correct")
    plan = plan_of(tiny, *rm, "custom_reward_function.name=with_rm")
    reward = build_reward(plan)
    assert isinstance(reward, WithRMScore) and reward.reward.rm_argument == "rm_score"
    legacy = plan_of(tiny, *rm, "custom_reward_function.name=correct", "reward_model.use_reward_loop=false")
    assert legacy.reward.mode == "model" and any("legacy" in n for n in legacy.notes)
    summed = plan_of(tiny, *rm, "custom_reward_function.name=correct", "reward_model.weight=0.5",
                     "custom_reward_function.weight=2")
    reward = build_reward(summed)
    assert isinstance(reward, CombinedReward)
    assert reward.names == ["reward_model", "correct"] and reward.weights == [0.5, 2.0]


def test_several_weighted_functions(tiny, rewards_py, capsys):
    funcs = [f"custom_reward_function.path={rewards_py}",
             "custom_reward_function.functions=[{name: correct, weight: 1.0},'" + f"{rewards_py}" + ":short']",
             "trainer.total_training_steps=1", "trainer.val_before_train=false"]
    plan = plan_of(tiny, *funcs)
    reward = build_reward(plan)
    assert isinstance(reward, CombinedReward) and reward.names == ["correct", "short"]
    assert [p.form for p in reward.parts] == ["verl", "trl"] and reward.weights == [1.0, 1.0]
    assert main(tiny + funcs) == 0
    last = steps(capsys.readouterr().out)[1]
    assert last["critic/score/mean"] == pytest.approx(last["reward/correct/mean"] + last["reward/short/mean"], abs=1e-6)


@pytest.mark.parametrize("override, message", [
    ("reward_model.timeout_s=0", "reward_model.timeout_s=0: must be > 0"),
    ("reward_model.num_workers=0", "reward_model.num_workers=0: must be >= 1"),
    ("reward_model.weight=1.0", "reward_model.weight=1.0 is set but reward_model.enable=False"),
    ("custom_reward_function.weight=abc", "custom_reward_function.weight"),
    ("custom_reward_function.functions=[{name: correct, wieght: 2}]", "unknown field.*wieght"),
    ("custom_reward_function.functions=[{weight: 2}]", r"functions\[0\]"),
])
def test_bad_reward_values_name_their_key(tiny, rewards_py, override, message):
    with pytest.raises(ConfigError, match=message):
        plan_of(tiny, f"custom_reward_function.path={rewards_py}", "custom_reward_function.name=correct", override)


@pytest.mark.parametrize("override, message", [
    ("reward_model.micro_batch_size_per_gpu=0", "micro_batch_size_per_gpu=0: must be >= 1"),
    ("reward_model.max_length=1", "max_length=1: must be >= 2"),
])
def test_bad_reward_model_values(tiny, rm_dir, override, message):
    with pytest.raises(ConfigError, match=message):
        plan_of(tiny, "reward_model.enable=true", f"reward_model.model.path={rm_dir}", override)
    with pytest.raises(NotSupportedError, match="Megatron reward models"):
        plan_of(tiny, "reward_model.enable=true", f"reward_model.model.path={rm_dir}", "reward_model.strategy=megatron")


def test_workers_and_timeout_reach_the_function_reward(tiny):
    reward = build_reward(plan_of(tiny, "reward_model.num_workers=2", "reward_model.timeout_s=5"))
    assert isinstance(reward, FunctionReward) and reward.processes == 2 and reward.timeout_s == 5
    reward.close()
    assert build_reward(plan_of(tiny)).timeout_s == 30.0  # a default time-out: a hung reward cannot hang the run


def test_a_reward_function_that_never_returns_does_not_hang_the_run(tiny, rewards_py, capsys):
    """Issue 10: the run goes on; timed-out samples score 0, are counted and warned about."""
    args = tiny + [f"custom_reward_function.path={rewards_py}", "custom_reward_function.name=hangs",
                   "reward_model.timeout_s=0.3", "trainer.total_training_steps=1", "trainer.val_before_train=false"]
    with pytest.warns(UserWarning, match="timed out after 0.3 s"):
        assert main(args) == 0
    last = steps(capsys.readouterr().out)[1]
    assert last["reward/timeouts"] > 0


def test_a_reward_function_that_raises_on_every_sample_stops_the_run(tiny, rewards_py):
    """verl stops at the function's exception (rlflow trained on zeros and exited 0); partial failures are
    still scored 0.0, counted and warned about."""
    args = tiny + [f"custom_reward_function.path={rewards_py}", "custom_reward_function.name=raises",
                   "trainer.val_before_train=false"]
    with pytest.raises(RewardError, match=r"'raises' failed on every sample of the batch \(8 of 8\).*first: row 0 "
                                          r"\(data_source='openai/gsm8k'\): raised ValueError: cannot parse") as info:
        main(args)
    assert isinstance(info.value.__cause__, ValueError)


def test_a_reward_function_that_hangs_on_every_sample_stops_the_run(tiny, rewards_py):
    args = tiny + [f"custom_reward_function.path={rewards_py}", "custom_reward_function.name=always_hangs",
                   "reward_model.timeout_s=0.3", "trainer.val_before_train=false"]
    with pytest.raises(RewardError, match=r"every sample of the batch \(8 of 8\).*timed out after 0.3 s.*the "
                                          r"function hangs.*reward_model.timeout_s"):
        main(args)


def test_native_recipe_and_dry_run(tiny, rm_dir, rewards_py, tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"policy: {{path: m}}\nrewards: [{{path: {rewards_py}, name: correct, weight: 2.0}}]\n"
                      f"reward_model: {{path: {rm_dir}, weight: 0.5, micro_batch_size: 4}}\n"
                      "data: {train: t.parquet}\n")
    plan = make_plan(load_native(recipe))
    assert plan.reward.mode == "sum" and plan.reward.model["micro_batch_size"] == 4
    assert [(n, w) for n, _, w in plan.reward.functions] == [("correct", 2.0)] and plan.reward.model_weight == 0.5
    made = reward_node(plan.reward, None, deferred := [])
    assert made["_target_"] == "rlflow.rewards.CombinedReward" and made["weights"] == {"reward_model": 0.5, "correct": 2}
    assert made["rewards"]["reward_model"]["_target_"] == "rlflow.rewards.ModelReward.from_pretrained"
    assert made["rewards"]["correct"]["fn"]["path"].endswith("rewards.py:correct") and deferred == []
    report, problems = dry_run(plan_of(tiny, "reward_model.enable=true", f"reward_model.model.path={rm_dir}"))
    assert problems == [] and "reward=ModelReward.from_pretrained(" in report


def test_functions_by_file_or_module_name(tiny, rewards_py):
    from rlflow.tasks.addition import digit_match

    by_file = plan_of(tiny, f"custom_reward_function.name={rewards_py}:correct")
    assert by_file.reward.custom and by_file.reward.functions[0][0] == "correct"
    by_module = plan_of(tiny, "custom_reward_function.name=rlflow.tasks.addition:digit_match")
    assert by_module.reward.functions[0][1] is digit_match
    both = build_reward(plan_of(tiny, "custom_reward_function.functions=['rlflow.tasks.addition:digit_match',"
                                      f"'{rewards_py}:correct']"))
    assert both.names == ["digit_match", "correct"]
    with pytest.raises(ConfigError, match="no importable module"):
        plan_of(tiny, "custom_reward_function.name=no_such_pkg.rewards:f")


# ------------------------------------------------------------------ verl 0.9's reward.* section

BONUS = '''
def scaled(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
    return scale * float(solution_str.strip() == ground_truth)
'''


def test_verl09_reward_section_custom_function_workers_and_kwargs(tiny, rewards_py, capsys):
    rewards_py.write_text(FUNCTIONS + BONUS)
    new = [f"reward.custom_reward_function.path={rewards_py}", "reward.custom_reward_function.name=scaled",
           "+reward.custom_reward_function.reward_kwargs.scale=3.0", "reward.num_workers=2"]
    reward = build_reward(plan_of(tiny, *new))
    try:
        assert isinstance(reward, FunctionReward) and reward.name == "scaled" and reward.processes == 2
        assert reward.fn("openai/gsm8k", "12", "12") == 3.0  # the bound reward_kwargs
    finally:
        reward.close()
    old = build_reward(plan_of(tiny, f"custom_reward_function.path={rewards_py}", "custom_reward_function.name=scaled",
                               "+custom_reward_function.reward_kwargs.scale=3.0", "reward_model.num_workers=2"))
    try:  # the older names still work, the same way
        assert (old.name, old.processes, old.fn("openai/gsm8k", "12", "12")) == ("scaled", 2, 3.0)
    finally:
        old.close()
    run = tiny + [f"reward.custom_reward_function.path={rewards_py}", "reward.custom_reward_function.name=correct",
                  "trainer.total_training_steps=1", "trainer.val_before_train=false"]
    assert main(run) == 0
    out = capsys.readouterr().out
    assert "reward/errors" in steps(out)[1] and "reward.custom_reward_function" not in out  # used: no note


def test_verl09_reward_manager_and_reward_kwargs_as_verl_examples_write_them(tiny):
    """verl's DAPO scripts: reward.reward_manager.name=dapo +reward.reward_kwargs.overlong_buffer_cfg.* ..."""
    dapo = ["reward.reward_manager.name=dapo", "+reward.reward_kwargs.overlong_buffer_cfg.enable=True",
            "+reward.reward_kwargs.overlong_buffer_cfg.len=2",
            "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
            "+reward.reward_kwargs.overlong_buffer_cfg.log=False", "+reward.reward_kwargs.max_resp_len=4"]
    plan = plan_of(tiny, *dapo)
    assert plan.overlong == {"max_response_length": 4, "buffer_len": 2, "penalty_factor": 0.5}
    assert any("reward_manager=dapo" in n for n in plan.notes)
    assert plan_of(tiny).overlong is None  # source=importlib (a class from a file): test_reward_class_keys.py


def test_verl09_reward_model_keys(tiny, rm_dir):
    plan = plan_of(tiny, "reward.reward_model.enable=true", f"reward.reward_model.model_path={rm_dir}",
                   "reward.reward_model.rollout.name=vllm", "reward.reward_model.rollout.gpu_memory_utilization=0.8",
                   "reward.reward_model.enable_resource_pool=true")
    assert plan.reward.mode == "model" and plan.reward.model["path"] == str(rm_dir)
    assert isinstance(build_reward(plan), ModelReward)
    notes = "\n".join(unused_notes(plan.cfg))
    assert "reward.reward_model.rollout.name='vllm' has no effect in rlflow: settings of verl's reward-model " \
           "inference server" in notes
    assert "reward.reward_model.enable_resource_pool=True has no effect in rlflow: the reward model runs in the " \
           "training processes" in notes
    assert "model_path" not in notes and "reward.reward_model.enable" not in notes.replace("enable_resource", "")


@pytest.mark.parametrize("prefix", ["reward_model.", "reward.", ""])  # verl's older, 0.9 and top-level spellings
def test_sandbox_fusion_keys_make_the_built_in_scorer_use_the_server(tiny, prefix):
    plan = plan_of(tiny, f"{prefix}sandbox_fusion.url=http://127.0.0.1:8080", f"{prefix}sandbox_fusion.max_concurrent=8",
                   f"{prefix}sandbox_fusion.memory_limit_mb=256")
    (_, fn, _), = plan.reward.functions
    assert fn.func is default_compute_score
    assert fn.keywords["sandbox"] == SandboxFusion("http://127.0.0.1:8080/run_code", max_concurrent=8,
                                                   memory_limit_mb=256)
    assert not [n for n in unused_notes(plan.cfg) if "sandbox_fusion" in n]
    alone = plan_of(tiny, f"{prefix}sandbox_fusion.max_concurrent=8")  # no url: the local sandbox, and a note
    assert alone.reward.functions[0][1] is default_compute_score
    assert any(n.startswith(f"{prefix}sandbox_fusion.max_concurrent=8 has no effect in rlflow: only used with ")
               and "sandbox_fusion.url" in n for n in unused_notes(alone.cfg))
    with pytest.raises(ConfigError, match=r"sandbox_fusion.url='ftp://x': not an http\(s\) url"):
        plan_of(tiny, f"{prefix}sandbox_fusion.url=ftp://x")
    with pytest.raises(ConfigError, match=r"sandbox_fusion.max_concurrent=0: must be an integer >= 1"):
        plan_of(tiny, f"{prefix}sandbox_fusion.url=http://x", f"{prefix}sandbox_fusion.max_concurrent=0")


def test_sandbox_fusion_bound_is_shared_by_reward_processes_and_skips_custom_functions(tiny, rewards_py):
    plan = plan_of(tiny, "reward.sandbox_fusion.url=http://x/run_code", "reward.sandbox_fusion.max_concurrent=8",
                   "reward.num_workers=3")
    assert plan.reward.functions[0][1].keywords["sandbox"].max_concurrent == 2  # 3 processes: at most 6 in flight
    assert any("each sends at most 2 requests at once" in n for n in plan.notes)
    custom = plan_of(tiny, "reward.sandbox_fusion.url=http://x/run_code", f"custom_reward_function.path={rewards_py}",
                     "custom_reward_function.name=correct")
    assert not isinstance(custom.reward.functions[0][1], functools.partial)
    assert any("only the built-in scorers (code data sources) send code to the server" in n for n in custom.notes)


def test_verl09_and_older_reward_keys_together(tiny, rewards_py):
    with pytest.raises(ConfigError, match=r"reward.num_workers=3 and reward_model.num_workers=4 set one thing.*"
                                          "set only reward.num_workers"):
        plan_of(tiny, "reward.num_workers=3", "reward_model.num_workers=4")
    with pytest.raises(ConfigError, match=r"reward.custom_reward_function.name='correct' and "
                                          r"custom_reward_function.name='short'"):
        plan_of(tiny, f"custom_reward_function.path={rewards_py}", "reward.custom_reward_function.name=correct",
                "custom_reward_function.name=short")
    same = plan_of(tiny, "reward.num_workers=3", "reward_model.num_workers=3")  # equal values: one setting
    assert same.reward.processes == 3
    with pytest.raises(ConfigError, match=r"reward.num_workers \(read as reward_model.num_workers\): "
                                          r"reward_model.num_workers=0: must be >= 1"):
        plan_of(tiny, "reward.num_workers=0")
