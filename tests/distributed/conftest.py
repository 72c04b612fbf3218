"""Launches shared by several test files (each launch starts interpreters that import the trainer: the suite's
cost): the 2-process worker.py jobs of test_fsdp2.py and test_lora.py, and the tiny verl job of the multi-node
tests (test_multinode.py, test_ray.py) with its one-node reference run."""

import os
import signal
import subprocess
import sys

import pandas as pd
import pytest
import torch

from rlflow.models.tiny import char_tokenizer, tiny_qwen2

from ..config.conftest import CHAT_TEMPLATE, verl_rows
from .launch import metrics, torchrun

# The 2-process worker.py jobs that read nothing from another test's run: one launch runs them one after another
# (worker.py's "+"), each writing OUT/result.pt; the failing job comes last in that launch (it ends it).
FSDP2_JOBS = {"fsdp2": ("fsdp2", 1), "ddp": ("ddp", 1), "ddp_samples2": ("ddp", 1, "samples=2"),
              "fsdp2_samples2": ("fsdp2", 1, "samples=2"), "bf16": ("fsdp2", 1, "bf16=1"),
              "lora": ("fsdp2", 2, "lora=1")}


@pytest.fixture(scope="session")
def fsdp2_launch(tmp_path_factory):
    """One launch of FSDP2_JOBS, then a job whose rank 1 fails in its first step: (the launch, its folder). The
    launch's timeout bounds the time the failure takes to end it (a rank left waiting would hang it)."""
    root = tmp_path_factory.mktemp("launched")
    args = [a for name, job in FSDP2_JOBS.items() for a in ("+", root / name, *job)][1:]
    return torchrun(2, *args, "+", root / "failing", "fsdp2", 3, "-", 1, timeout=600), root


@pytest.fixture(scope="session")
def fsdp2_launched(fsdp2_launch):
    """{job: (its steps' records, its run folder)} of FSDP2_JOBS; their checkpoints are read, never written."""
    proc, root = fsdp2_launch
    missing = [name for name in FSDP2_JOBS if not (root / name / "result.pt").exists()]
    assert not missing, (missing, proc.stdout[-3000:] + proc.stderr[-3000:])
    return {name: (torch.load(root / name / "result.pt", weights_only=False), root / name) for name in FSDP2_JOBS}


REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Differs between responses and prompts, so that every step's update is non-zero."""
    return (len(set(solution_str)) + sum(c.isdigit() for c in solution_str) + int(ground_truth[-1]) / 3) / 8 - 0.3
'''
# The reference's steps: as many as any run compared with it (the learning rate is constant, so a longer run
# changes no step; the killed two-node run resumes from step 2 or 3).
REFERENCE_STEPS = 5


@pytest.fixture(scope="session")
def job(tmp_path_factory):
    """verl overrides for a tiny job on local files (as tests/config/conftest.py's ``tiny``), without run dir."""
    root = tmp_path_factory.mktemp("multinode")
    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tiny_qwen2(len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
               seed=0).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    pd.DataFrame(verl_rows(16, "train", 0)).to_parquet(root / "train.parquet")
    (root / "reward.py").write_text(REWARD)
    return [f"data.train_files={root}/train.parquet", f"actor_rollout_ref.model.path={root}/model",
            "trainer.device=cpu", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.rollout.n=2", "data.max_prompt_length=8", "data.max_response_length=4",
            "trainer.logger=[console]", "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.optim.lr=1e-2",
            f"custom_reward_function.path={root}/reward.py", "trainer.save_freq=1"]


class Reference:
    """The job's 2 ranks under torchrun on one node (``trainer.n_gpus_per_node=2``), REFERENCE_STEPS steps,
    running in the background from the first test that asks for it; :meth:`metrics` waits for it."""

    def __init__(self, job, run):
        self.run, self.log = run, open(run.with_suffix(".log"), "w")  # a file, not a pipe nobody reads meanwhile
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlflow.trainer.main_ppo", *job, "trainer.n_gpus_per_node=2",
             f"trainer.total_training_steps={REFERENCE_STEPS}", f"trainer.default_local_dir={run}"],
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}, stdout=self.log,
            stderr=subprocess.STDOUT, start_new_session=True)

    def metrics(self, steps):
        """Steps 1..steps of the reference's metrics (see launch.metrics); it trains really (non-zero gradients)."""
        assert self.proc.wait(timeout=300) == 0, self.run.with_suffix(".log").read_text()[-4000:]
        reference = metrics(self.run)
        assert sorted(reference) == list(range(1, REFERENCE_STEPS + 1)) and steps <= REFERENCE_STEPS, steps
        assert min(r["actor/grad_norm"] for r in reference.values()) > 0.1  # real updates
        return {step: reference[step] for step in range(1, steps + 1)}

    def stop(self):
        if self.proc.poll() is None:  # no test waited for it: torchrun and its workers
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="session")
def one_node_reference(job, tmp_path_factory):
    reference = Reference(job, tmp_path_factory.mktemp("reference") / "run")
    yield reference
    reference.stop()
