"""verl's GDPO and DPPO example scripts' algorithm keys through the verl entry point
(examples/gdpo_trainer/run_qwen3_8b_fsdp.sh, examples/dppo_trainer/run_qwen3_30b_a3b_megatron.sh)."""

import pytest

from rlflow.algorithms import GDPO, DPPOTVLoss
from rlflow.cli import main as cli_main
from rlflow.config import load_config, make_plan
from rlflow.config.verl.build import build_trainer
from rlflow.data.keys import REWARD_COLUMN

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info, step=0):
    assert extra_info["experiment_name"] == "qwen_gdpo"  # verl's GDPO manager adds it (rlla.py reads it)
    fmt = float(len(solution_str) % 2)
    acc = float(ground_truth in solution_str)
    return {"score": fmt + acc, "format_reward": fmt, "accuracy_reward": acc}
'''


def gdpo_args(tiny, tmp_path):
    (tmp_path / "rlla.py").write_text(REWARD)
    return [a for a in tiny if not a.startswith("algorithm.adv_estimator")] + [
        "algorithm.adv_estimator=gdpo", "+algorithm.gdpo_reward_keys=[accuracy_reward, format_reward]",
        "reward.reward_manager.name=gdpo", f"reward.custom_reward_function.path={tmp_path}/rlla.py",
        "reward.custom_reward_function.name=compute_score", "trainer.experiment_name=qwen_gdpo",
        "trainer.val_before_train=false", "trainer.total_training_steps=1"]


def test_gdpo_example_keys_dry_run_and_train(tiny, tmp_path, capsys):
    args = gdpo_args(tiny, tmp_path)
    assert cli_main(["train", "--dry-run"] + args) == 0
    assert "GDPO(" in capsys.readouterr().out
    trainer, data = build_trainer(make_plan(load_config(args)))
    assert isinstance(trainer.estimator, GDPO)
    assert trainer.estimator.reward_keys == ("accuracy_reward", "format_reward")
    assert trainer.reward.columns == ("accuracy_reward", "format_reward")
    assert trainer.estimator.in_keys[-1] == REWARD_COLUMN + "format_reward"
    history = trainer.fit(data)
    assert "actor/pg_loss" in history[0]
    assert set(trainer.estimator.stats) >= {"gdpo/accuracy_reward/mean", "gdpo/format_reward/max"}


def test_gdpo_without_its_keys_names_the_key(tiny, tmp_path, capsys):
    args = [a for a in gdpo_args(tiny, tmp_path) if "gdpo_reward_keys" not in a]
    assert cli_main(["train", "--dry-run"] + args) != 0
    assert "algorithm.gdpo_reward_keys" in capsys.readouterr().err


@pytest.mark.parametrize("mode,clip", [("dppo_tv", 0.15), ("dppo_kl", 0.05)])
def test_dppo_example_keys_reach_the_loss(tiny, capsys, mode, clip):
    args = tiny + ["algorithm.use_kl_in_reward=False", "algorithm.norm_adv_by_std_in_grpo=False",
                   f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}", f"actor_rollout_ref.actor.clip_ratio_low={clip}",
                   f"actor_rollout_ref.actor.clip_ratio_high={clip}", "actor_rollout_ref.actor.clip_ratio_c=10000.0"]
    assert cli_main(["train", "--dry-run"] + args) == 0
    assert "DPPO" in capsys.readouterr().out
    loss = make_plan(load_config(args))
    assert issubclass(loss.loss_cls, DPPOTVLoss) and loss.loss_kwargs["clip_ratio_c"] == 10000.0
    assert (loss.loss_kwargs["clip_ratio_low"], loss.loss_kwargs["clip_ratio_high"]) == (clip, clip)
