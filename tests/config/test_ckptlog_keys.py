"""verl's checkpoint-rotation, critic warm-up and generation-logging keys through the entry point, on the
tiny local model: each changes what the run writes or trains."""

import json

import pytest

import rlflow.config.verl.devices as devices
from rlflow.config import load_config, make_plan
from rlflow.trainer import training_state as ckpt
from rlflow.trainer.generations import DumpGenerations, LogValidationGenerations
from rlflow.trainer.main_ppo import main

from .test_main_ppo import steps


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_max_ckpt_to_keep_rotates_the_run_folder(tiny, tmp_path):
    base = tiny + ["trainer.save_freq=1", "trainer.val_before_train=false", "trainer.total_training_steps=3"]
    assert main(base + ["trainer.max_actor_ckpt_to_keep=1"]) == 0
    assert ckpt.complete_steps(tmp_path / "run") == [3]
    assert (tmp_path / "run" / ckpt.TRACKER).read_text() == "3"


@pytest.mark.parametrize("actor, critic, keep", [(1, 2, 1), (2, None, 2), (3, 3, 3), (-1, 1, 1), (0, 0, None)])
def test_actor_and_critic_counts_map_to_one_folder(tiny, model_dir, actor, critic, keep):
    plan = make_plan(load_config(tiny + ["algorithm.adv_estimator=gae", f"critic.model.path={model_dir}",
                                         "trainer.save_freq=1", f"trainer.max_actor_ckpt_to_keep={actor}",
                                         f"trainer.max_critic_ckpt_to_keep={'null' if critic is None else critic}"]))
    assert plan.trainer_kwargs["keep_checkpoints"] == keep  # the checkpoints verl keeps both halves of
    noted = any("one global_step_N folder" in n for n in plan.notes)
    counts = [v if v is not None and v > 0 else None for v in (actor, critic)]
    assert noted == (counts[0] != counts[1])


def test_critic_key_without_a_critic_and_without_saves_is_noted(tiny):
    plan = make_plan(load_config(tiny + ["trainer.max_critic_ckpt_to_keep=1", "trainer.max_actor_ckpt_to_keep=2"]))
    assert plan.trainer_kwargs["keep_checkpoints"] == 2
    text = "\n".join(plan.notes)
    assert "max_critic_ckpt_to_keep=1: no effect, this run has no critic" in text
    assert "save_freq=-1 saves no checkpoints" in text


def test_critic_warmup_trains_only_the_critic_first(tiny, model_dir, capsys):
    assert main(tiny + ["algorithm.adv_estimator=gae", f"critic.model.path={model_dir}", "trainer.critic_warmup=2",
                        "trainer.val_before_train=false"]) == 0
    out = capsys.readouterr().out
    logged = steps(out)
    assert logged[1]["actor/critic_warmup"] == 1.0 and "actor/pg_loss" not in logged[1]
    assert logged[2]["actor/critic_warmup"] == 0.0 and "actor/pg_loss" in logged[2]
    assert "critic/vf_loss" in logged[1]
    assert "the first 1 step(s) update only the critic" in out


def test_critic_warmup_without_a_critic(tiny, capsys):
    assert main(tiny + ["trainer.critic_warmup=3", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "trainer.critic_warmup=3 without a critic" in err and "steps 1-2 would train nothing" in err
    plan = make_plan(load_config(tiny + ["trainer.critic_warmup=1"]))  # verl: 1 > global_steps never holds
    assert plan.trainer_kwargs["critic_warmup_steps"] == 0
    assert any("trainer.critic_warmup=1: no effect" in n for n in plan.notes)


def test_generations_dumped_and_logged(tiny, tmp_path, capsys):
    (tmp_path / "length.py").write_text("def compute_reward(responses, ground_truths):\n"
                                        "    return [float(len(r)) for r in responses]\n")
    argv = tiny + [f"trainer.rollout_data_dir={tmp_path}/rollouts", f"trainer.validation_data_dir={tmp_path}/val",
                   "trainer.log_val_generations=2", "trainer.test_freq=1",
                   f"custom_reward_function.path={tmp_path}/length.py", "custom_reward_function.name=compute_reward"]
    plan = make_plan(load_config(argv))
    assert [repr(c) for c in plan.trainer_kwargs["callbacks"]] == [
        repr(DumpGenerations(f"{tmp_path}/rollouts", f"{tmp_path}/val")), repr(LogValidationGenerations(2))]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["1.jsonl", "2.jsonl"]
    rollouts = read_jsonl(tmp_path / "rollouts" / "1.jsonl")
    assert len(rollouts) == 4 * 2 and list(rollouts[0])[:5] == ["input", "output", "gts", "score", "step"]
    assert all(r["score"] == len(r["output"]) for r in rollouts)  # the scorer's score of that very text
    assert sum(r["score"] for r in rollouts) / 8 == pytest.approx(steps(out)[1]["critic/score/mean"])
    assert {r["input"] for r in rollouts} <= {f"{a}+{b}=" for a in range(50) for b in range(50)}  # chat template
    assert all(r["gts"].isdigit() for r in rollouts)  # reward_model.ground_truth of the parquet rows
    # validation before training (step 0), then after each step
    assert sorted(p.name for p in (tmp_path / "val").iterdir()) == ["0.jsonl", "1.jsonl", "2.jsonl"]
    val = read_jsonl(tmp_path / "val" / "2.jsonl")
    assert len(val) == 4 and all(r["reward"] == r["score"] == len(r["output"]) for r in val)
    table = read_jsonl(tmp_path / "run" / "val_generations.jsonl")
    assert [r["step"] for r in table] == [0, 0, 1, 1, 2, 2]
    assert out.count("[val/generations step:2") == 2


def test_validation_keys_without_validation_are_noted(tiny):
    plan = make_plan(load_config(tiny + ["trainer.log_val_generations=2", "trainer.val_before_train=false"]))
    assert any("trainer.log_val_generations: no effect, this run never validates" in n for n in plan.notes)
    plan = make_plan(load_config(tiny + ["trainer.log_val_generations=2"]))  # validates before training
    assert not any("never validates" in n for n in plan.notes)


@pytest.mark.parametrize("override, message", [
    ("trainer.max_actor_ckpt_to_keep=two", "trainer.max_actor_ckpt_to_keep='two': expected an integer"),
    ("trainer.log_val_generations=-1", "trainer.log_val_generations=-1: must be >= 0 (an integer)"),
    ("trainer.critic_warmup=1.5", "trainer.critic_warmup=1.5: expected an integer"),
    ("trainer.rollout_data_dir=5", "trainer.rollout_data_dir=5: expected a folder path"),
])
def test_bad_values_name_the_key(tiny, capsys, override, message):
    assert main(tiny + ["--dry-run", override]) in (1, 2)
    captured = capsys.readouterr()
    assert message in captured.out + captured.err
