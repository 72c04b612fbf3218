"""The reward keys of the verl entry point: reward models, several weighted functions, time-outs, workers."""

import pytest

import rlflow.config.devices as devices
from rlflow.config import load_config, make_plan
from rlflow.config.build import build_reward
from rlflow.config.dryrun import dry_run
from rlflow.config.loading import ConfigError, NotSupportedError
from rlflow.config.native import load_native
from rlflow.models.tiny import char_tokenizer, tiny_qwen2_reward_model
from rlflow.rewards import CombinedReward, FunctionReward, ModelReward, RewardError, WithRMScore
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
    text = plan.reward.describe()
    assert text.startswith("CombinedReward({'reward_model': ModelReward.from_pretrained(")
    assert "weights={'reward_model': 0.5, 'correct': 2}" in text
    report, problems = dry_run(plan_of(tiny, "reward_model.enable=true", f"reward_model.model.path={rm_dir}"))
    assert problems == [] and "reward    = ModelReward.from_pretrained(" in report


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
