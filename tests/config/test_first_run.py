"""What a verl user hits on a first run: the seed's PPO block, verl's default loggers without wandb, a batch
that does not split over the processes, ``enable_vision`` on a text-only model. Each is caught (or works) the
same way in validation, the plan, ``--dry-run`` and the run."""

import importlib.util
import json

import pandas as pd
import pytest

import rlflow.config.devices as devices
from rlflow.config import ConfigError
from rlflow.config.run import load_and_check, parse_args
from rlflow.trainer.main_ppo import main

from .conftest import verl_rows

A, R, C = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "critic"

# The seed's "ワークフロー 2：Critic モデルを使った PPO" block as written, with a local folder for the critic.
SEED_PPO_BLOCK = """\
algorithm:
  adv_estimator: gae  # Use GAE instead of GRPO
  gamma: 0.99
  lam: 0.95

critic:
  model:
    path: {model}  # Can be same or different from actor
  ppo_mini_batch_size: 64

actor_rollout_ref:
  actor:
    use_kl_loss: true
    kl_loss_coef: 0.02
    clip_ratio: 0.2  # PPO clipping
"""


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


def message(argv: list[str]) -> str:
    """The one error message the command line would print for ``argv`` ('' when the config is fine)."""
    try:
        load_and_check(parse_args(argv))
    except ConfigError as e:
        return str(e)
    return ""


def test_a_batch_that_does_not_split_over_the_processes_fails_validation_and_the_dry_run(tiny, capsys):
    argv = tiny + ["trainer.n_gpus_per_node=3"]  # CPU processes; data.train_batch_size=4
    expected = ("data.train_batch_size=4 must be a multiple of the number of processes, trainer.n_gpus_per_node x "
                "trainer.nnodes = 3 x 1 = 3")
    assert expected in message(argv)
    assert main(["--dry-run"] + argv) == 2
    assert expected in capsys.readouterr().err
    assert "processes" not in message(tiny + ["trainer.n_gpus_per_node=2"])  # 4 prompts: 2 per process
