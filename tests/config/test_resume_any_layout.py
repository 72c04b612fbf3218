"""A checkpoint resumes on any number of processes, through verl's entry point.

One uninterrupted single-process run is the reference. Its one-file checkpoint of step 2 is resumed
by ``trainer.n_gpus_per_node=2`` FSDP2 (torchrun, gloo), which trains step 3 and writes a *sharded*
checkpoint; that is resumed with ``trainer.n_gpus_per_node=1 trainer.resume_mode=auto`` for step 4.
Both legs must give the reference's weights and metrics. Greedy rollouts and REINFORCE++ make a step
independent of how the prompts are split over processes (sampling draws per-rank random numbers).
"""

import json
import shutil

import pytest
import torch

import rlflow.config.verl.devices as devices
from rlflow.trainer import training_state as ckpt
from rlflow.trainer.hf_export import load_policy_state
from rlflow.trainer.main_ppo import main

# Scores that differ between prompts and responses, so every step has a gradient to compare.
VARIED = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return (len(set(solution_str)) + sum(c.isdigit() for c in solution_str) + int(ground_truth[-1]) / 3) / 8 - 0.3
"""


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


def command(model_dir, data_dir, tmp_path, run, steps, procs):
    (tmp_path / "varied.py").write_text(VARIED)
    return [
        f"data.train_files={data_dir}/train.parquet", f"actor_rollout_ref.model.path={model_dir}",
        "trainer.device=cpu", f"trainer.n_gpus_per_node={procs}", "actor_rollout_ref.actor.strategy=fsdp2",
        "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=1",
        "actor_rollout_ref.rollout.do_sample=False", "data.max_prompt_length=8", "data.max_response_length=4",
        "algorithm.adv_estimator=reinforce_plus_plus", "actor_rollout_ref.actor.optim.lr=1e-2",
        f"custom_reward_function.path={tmp_path}/varied.py", f"trainer.total_training_steps={steps}",
        "trainer.save_freq=1", "trainer.resume_mode=auto", f"trainer.default_local_dir={run}",
        "trainer.logger=[file]", "trainer.val_before_train=False", "data.shuffle=False",
    ]


def logged(run) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def assert_same_step(a: dict, b: dict) -> None:
    assert a["critic/score/mean"] == pytest.approx(b["critic/score/mean"], abs=1e-6)
    assert a["actor/pg_loss"] == pytest.approx(b["actor/pg_loss"], abs=1e-5)
    assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=1e-4)


def assert_same_weights(ckpt_a, ckpt_b) -> None:
    a, b = load_policy_state(ckpt_a / "state.ckpt"), load_policy_state(ckpt_b / "state.ckpt")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=2e-5, rtol=1e-4, msg=name)


def test_one_file_to_two_sharded_processes_and_back_to_one(model_dir, data_dir, tmp_path):
    reference = tmp_path / "reference"
    assert main(command(model_dir, data_dir, tmp_path, reference, 4, 1) + [
        f"trainer.rollout_data_dir={tmp_path}/dump_reference"]) == 0
    ref = logged(reference)
    assert ref[4]["actor/grad_norm"] > 0.01 and not (reference / "global_step_4" / "state.ckpt").is_dir()

    run = tmp_path / "run"  # the reference, stopped after step 2
    shutil.copytree(reference / "global_step_2", run / "global_step_2")
    ckpt.mark_latest(run, 2)
    assert main(command(model_dir, data_dir, tmp_path, run, 3, 2) + [  # launches torchrun: 2 processes
        f"trainer.rollout_data_dir={tmp_path}/dump_run", "trainer.max_actor_ckpt_to_keep=1"]) == 0
    assert (run / "global_step_3" / "state.ckpt").is_dir()  # sharded (torch.distributed.checkpoint)
    assert ckpt.complete_steps(run) == [3]  # rotated by rank 0 after the sharded save
    # rank 0 wrote both ranks' samples: the same rows as the one-process run's step 3
    rows = [sorted(map(json.loads, (tmp_path / d / "3.jsonl").read_text().splitlines()), key=json.dumps)
            for d in ("dump_reference", "dump_run")]
    assert len(rows[1]) == 4 and [(r["input"], r["output"]) for r in rows[0]] == [(r["input"], r["output"]) for r in rows[1]]
    assert sorted(logged(run)) == [3]
    assert_same_step(logged(run)[3], ref[3])
    assert_same_weights(run / "global_step_3", reference / "global_step_3")

    assert main(command(model_dir, data_dir, tmp_path, run, 4, 1)) == 0  # the sharded checkpoint on one process
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert sorted(logged(run)) == [3, 4]
    assert_same_step(logged(run)[4], ref[4])
    assert_same_weights(run / "global_step_4", reference / "global_step_4")
