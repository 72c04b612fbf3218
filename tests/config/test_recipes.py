"""The YAML recipes in recipes/yaml, the built-in task as files (prepare-task), and filter_groups via config."""

import sys
from pathlib import Path

import pytest

import rlflow.algorithms as A
from rlflow.config import load_config, make_plan
from rlflow.config.verl.build import build_data, build_trainer, load_tokenizer
from rlflow.config.verl.dryrun import dry_run
from rlflow.config.verl.loading import ConfigError, NotSupportedError
from rlflow.config.verl.native import load_native
from rlflow.config.verl.run import train
from rlflow.data.prompts import render_prompt
from rlflow.rewards import OverlongPenalty, default_compute_score
from rlflow.rollout.stream import FilterGroups
from rlflow.tasks import prepare as export
from rlflow.tasks.addition import DATA_SOURCE, AdditionTask

RECIPES = Path(__file__).parents[2] / "recipes" / "yaml"
# recipe -> (estimator class, loss class, the estimator slot: a class or a Chain of them)
EXPECTED = {
    "ppo": ("GAE", "PPOLoss", "GAE"),
    "grpo": ("GRPO", "PPOLoss", "GRPO"),
    "drgrpo": ("GRPO", "PPOLoss", "GRPO"),
    "rloo": ("RLOO", "PPOLoss", "Chain(KLInReward, RLOO)"),
    "reinforce_plus_plus": ("ReinforcePlusPlus", "PPOLoss", "ReinforcePlusPlus"),
    "reinforce_plus_plus_baseline": ("ReinforcePlusPlusBaseline", "PPOLoss", "ReinforcePlusPlusBaseline"),
    "remax": ("ReMax", "PPOLoss", "ReMax"),  # and the stage GreedyBaseline (test_filter_groups_builds_...)
    "opo": ("OPO", "PPOLoss", "OPO"),
    "gpg": ("GPG", "ReinforceLoss", "GPG"),
    "grpo_passk": ("GRPOPassK", "PPOLoss", "GRPOPassK"),
    "dapo": ("GRPO", "PPOLoss", "GRPO"),
    "gspo": ("GRPO", "GSPOLoss", "GRPO"),
    "cispo": ("GRPO", "CISPOLoss", "GRPO"),
    "sapo": ("GRPO", "SAPOLoss", "GRPO"),
    "clip_cov": ("GRPO", "ClipCovLoss", "Chain(GRPO, CovSelection)"),
    "kl_cov": ("GRPO", "KLCovLoss", "Chain(GRPO, CovSelection)"),
    "gmpo": ("GRPO", "GMPOLoss", "GRPO"),
    "rollout_correction": ("GRPO", "PPOLoss", "Chain(GRPO, TruncatedIS)"),
    "lora": ("GRPO", "PPOLoss", "GRPO"),
    "grpo_async": ("GRPO", "PPOLoss", "Chain(GRPO, TruncatedIS)"),  # AsyncRollout around the rollout
}
# A reward that a random tiny model's samples get both values of (so groups differ and advantages are not 0).
PARITY = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" \
         "    return float(sum(map(ord, solution_str)) % 2)\n"
CONSTANT = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"


def tiny_warm_start(task, seed, **_):
    """An untrained tiny model instead of the supervised warm start (seconds saved)."""
    return task.model(seed), task.tokenizer()


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """`rlflow prepare-task addition` output for a small task (operands 0..5) and a tiny untrained model."""
    out = tmp_path_factory.mktemp("task")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(export, "warm_started_model", tiny_warm_start)
        export.export_task(out, task=AdditionTask(max_operand=5, held_out=8, warm_val=4, hidden_size=32, num_layers=1))
    (out / "parity.py").write_text(PARITY)
    (out / "constant.py").write_text(CONSTANT)
    return out


def tiny(task_dir, run_dir, reward="parity") -> list[str]:
    """Native overrides: the recipe on the small task files, 4 prompts x 2 samples, 1 step, no files but the run's."""
    return [f"policy.path={task_dir}/model", f"data.train={task_dir}/train.parquet",
            f"data.val={task_dir}/test.parquet", f"reward.path={task_dir}/{reward}.py", "reward.name=compute_score",
            "trainer.batch_size=4", "trainer.mini_batch_size=2", "rollout.n=2", "rollout.max_new_tokens=4",
            "trainer.max_steps=1", "trainer.val_before_train=false", "trainer.loggers=[console]",
            f"trainer.run_dir={run_dir}"]


# recipes whose engine needs a model vLLM's CPU attention supports: tested in tests/rollout/test_vllm_config.py
ENGINE_RECIPES = ("grpo_vllm",)


def test_every_recipe_is_tested():
    assert sorted(p.stem for p in RECIPES.glob("*.yaml")) == sorted([*EXPECTED, *ENGINE_RECIPES])


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_recipe_dry_runs_builds_and_trains(name, task_dir, tmp_path):
    overrides = tiny(task_dir, tmp_path / "run") + ([f"critic.path={task_dir}/model"] if name == "ppo" else [])
    plan = make_plan(load_native(RECIPES / f"{name}.yaml", overrides))
    estimator, loss, chain = EXPECTED[name]
    assert (plan.estimator_cls.__name__, plan.loss_cls.__name__) == (estimator, loss)
    report, problems = dry_run(plan)
    assert not problems and "Dry run: config and data are valid" in report
    if name == "dapo":  # the objects section shows the stages of the experience stream
        assert "rollout=HFRollout(" in report and "reward=OverlongPenalty(reward=FunctionReward(" in report
        assert "stages=[FilterGroups(metric='acc')]" in report
    trainer, data = build_trainer(plan)
    modules = getattr(trainer.estimator, "modules", None)
    assert (repr(trainer.estimator) if modules else type(trainer.estimator).__name__) == chain
    history = trainer.fit(data)
    assert len(history) == 1 and "actor/pg_loss" in history[0]
    assert any(k.startswith("val-core/rlflow/addition/") for k in history[-1])  # validated at the last step


def test_recipe_arguments_reach_the_objects(task_dir, tmp_path):
    """Spot checks of what the short keys set: Dr.GRPO, PPO's critic, SAPO, Clip-Cov, truncated IS, KL in reward."""
    def plan(name, *extra):
        return make_plan(load_native(RECIPES / f"{name}.yaml", tiny(task_dir, tmp_path) + list(extra)))

    assert plan("drgrpo").estimator_kwargs == {"norm_by_std": False}
    assert plan("drgrpo").loss_kwargs["agg"] == "seq-mean-token-sum-norm"
    ppo = plan("ppo", f"critic.path={task_dir}/model")
    assert ppo.estimator_kwargs == {"gamma": 1.0, "lam": 0.95} and ppo.value_loss_kwargs["clip_range"] == 0.5
    assert ppo.trainer_kwargs["critic_lr"] == 1e-3
    assert {k: plan("sapo").loss_kwargs[k] for k in ("tau_pos", "tau_neg")} == {"tau_pos": 1.0, "tau_neg": 1.05}
    assert plan("clip_cov").loss_kwargs["clip_cov_ratio"] == 2e-4 and plan("kl_cov").loss_kwargs["ppo_kl_coef"] == 1.0
    assert plan("rollout_correction").after == [(A.TruncatedIS, {"level": "token", "threshold": 2.0})]
    rloo = plan("rloo")
    assert rloo.before[0][0] is A.KLInReward and rloo.kl_controller == (A.FixedKLController, {"coef": 0.001})


def test_prepared_task_is_read_by_the_config_path_and_scored_by_the_dispatch(task_dir, tmp_path):
    plan = make_plan(load_native(RECIPES / "grpo.yaml", tiny(task_dir, tmp_path)[:3]))  # the default reward
    assert plan.reward_fn is default_compute_score and not plan.custom_reward
    tokenizer = load_tokenizer(plan)
    data = build_data(plan, tokenizer)  # checks that the built-in reward covers every data_source
    train_rows, _, test_rows = AdditionTask(max_operand=5, held_out=8, warm_val=4).splits()
    assert (len(data.train), len(data.val)) == (len(train_rows), len(test_rows))
    row, task_row = data.val[0], test_rows[0]
    assert (row["data_source"], row["ground_truth"]) == (DATA_SOURCE, task_row["ground_truth"])
    text = render_prompt(row["prompt"], tokenizer)
    assert text == task_row["prompt"]  # the chat template renders the message as is: encoded as in the default job
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == \
        AdditionTask().tokenizer()(task_row["prompt"], add_special_tokens=False)["input_ids"]
    truth = row["ground_truth"]
    assert plan.reward_fn(row["data_source"], truth, truth) == 1.0
    assert plan.reward_fn(row["data_source"], f" {truth} ", truth) == 1.0
    assert plan.reward_fn(row["data_source"], truth + "1", truth) == 0.0


def test_filter_groups_builds_dynamic_sampling(task_dir, tmp_path):
    plan = make_plan(load_native(RECIPES / "dapo.yaml", tiny(task_dir, tmp_path)))
    assert plan.dynamic_sampling == {"metric": "acc", "max_gen_batches": 10}
    assert plan.overlong == {"max_response_length": 4, "buffer_len": 2, "penalty_factor": 1.0}
    assert plan.cfg["algorithm.filter_groups.enable"] and plan.cfg["reward_model.reward_manager"] == "dapo"
    trainer, _ = build_trainer(plan)
    (stage,) = trainer.experience.stages
    assert isinstance(stage, FilterGroups) and (stage.metric, stage.max_gen_batches) == ("acc", 10)
    assert isinstance(trainer.reward, OverlongPenalty) and trainer.reward.buffer_len == 2
    remax, _ = build_trainer(make_plan(load_native(RECIPES / "remax.yaml", tiny(task_dir, tmp_path))))
    (stage,) = remax.experience.stages  # ReMax's greedy pass: a stage on the run's rollout, with a reward of its own
    assert isinstance(stage.module, A.GreedyBaseline) and stage.module.rollout is remax.rollout
    assert stage.module.reward is not remax.reward
    assert (trainer.loss.clip_low, trainer.loss.clip_high, trainer.loss.agg) == (0.2, 0.28, "token-mean")


def test_filter_groups_verl_keys():
    """verl's own keys: seq_final_reward is seq_reward (no KL in the reward), max_num_gen_batches=0 is no cap."""
    base = ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m", "trainer.device=cpu",
            "trainer.n_gpus_per_node=1", "algorithm.filter_groups.enable=true", "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8"]
    plan = make_plan(load_config(base + ["algorithm.filter_groups.metric=seq_final_reward"]))
    assert plan.dynamic_sampling == {"metric": "seq_reward", "max_gen_batches": sys.maxsize}
    assert any("max_num_gen_batches=0: no cap" in n for n in plan.notes)
    with pytest.raises(ConfigError, match="needs algorithm.filter_groups.metric"):
        make_plan(load_config(base))
    with pytest.raises(NotSupportedError, match="KL-penalised"):
        make_plan(load_config(base + ["algorithm.filter_groups.metric=seq_final_reward",
                                      "algorithm.use_kl_in_reward=true"]))
    with pytest.raises(ConfigError, match="reward_manager=dapo"):
        make_plan(load_config(base[:-3] + ["+reward_model.reward_kwargs.overlong_buffer_cfg.enable=true"]))


def test_filter_groups_trains_two_steps(task_dir, tmp_path):
    over = tiny(task_dir, tmp_path / "run") + ["trainer.max_steps=2", "rollout.n=4", "dynamic_sampling.metric=score",
                                               "dynamic_sampling.max_gen_batches=20"]
    history = train(make_plan(load_native(RECIPES / "dapo.yaml", over)))
    assert len(history) == 2
    assert all(m["dapo/num_gen_batches"] >= 1 and m["dapo/kept_group_frac"] > 0 for m in history)


def test_filter_groups_cap_exhausted_is_a_clear_error(task_dir, tmp_path):
    over = tiny(task_dir, tmp_path / "run", reward="constant") + ["dynamic_sampling.max_gen_batches=2"]
    trainer, data = build_trainer(make_plan(load_native(RECIPES / "dapo.yaml", over)))
    with pytest.raises(RuntimeError, match=r"2 generation batches \(max_gen_batches\) gave only 0 prompt groups"):
        trainer.fit(data)
