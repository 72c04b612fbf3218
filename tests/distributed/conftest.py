"""The tiny verl job of the multi-node tests (test_multinode.py, test_ray.py) and its one-node reference run,
shared by both files: each launch starts interpreters that import the trainer (the suite's cost). (The shared
launch of worker.py jobs is tests/conftest.py's ``fsdp2_launched``.)"""

import os
import signal
import subprocess
import sys

import pandas as pd
import pytest

from rlflow.models.tiny import char_tokenizer, tiny_qwen2

from ..config.conftest import CHAT_TEMPLATE, verl_rows
from .launch import metrics

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
