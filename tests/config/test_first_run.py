"""What a verl user hits on a first run: the seed's PPO block, verl's default loggers without wandb, a batch
that does not split over the processes, ``enable_vision`` on a text-only model. Each is caught (or works) the
same way in validation, the plan, ``--dry-run`` and the run."""

import importlib.util
import json

import pandas as pd
import pytest

import rlflow.config.verl.devices as devices
from rlflow.config.verl import tables
from rlflow.trainer.main_ppo import main

from .conftest import verl_rows
from .test_loading import SEED_PPO_YAML
from .test_validate import message

A, R, C = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "critic"

# The seed's "ワークフロー 2：Critic モデルを使った PPO" block as written, with a local folder for the critic.
SEED_PPO_BLOCK = SEED_PPO_YAML.replace("Qwen/Qwen2.5-7B-Instruct", "{model}")


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


@pytest.fixture
def seed_ppo(model_dir, tmp_path):
    """The seed's PPO block as a config file, 128 training prompts, and what makes it tiny and CPU-only."""
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "ppo.yaml").write_text(SEED_PPO_BLOCK.format(model=model_dir))
    pd.DataFrame(verl_rows(128, "train", 0)).to_parquet(tmp_path / "train.parquet")
    return ["--config-path", str(tmp_path / "config"), "--config-name", "ppo",
            f"data.train_files={tmp_path}/train.parquet", f"actor_rollout_ref.model.path={model_dir}",
            "trainer.device=cpu", "trainer.n_gpus_per_node=1", "data.max_prompt_length=8",
            "data.max_response_length=4", "trainer.logger=[console]", f"trainer.default_local_dir={tmp_path}/run"]


@pytest.mark.parametrize("batch", [64, 128])
def test_seed_ppo_block_critic_mini_batch_applies_to_the_actor(seed_ppo, batch, capsys):
    """Only critic.ppo_mini_batch_size=64 is set: the Trainer's one mini-batch size is 64 for actor and critic, and
    validation checks that value, not the actor's unset verl default (256), as the dry run says."""
    argv = seed_ppo + [f"data.train_batch_size={batch}"]
    assert message(argv) == ""
    assert main(argv + ["--dry-run"]) == 0
    report = capsys.readouterr().out
    assert f"train_batch_size / ppo_mini_batch_size = {batch} / 64" in report
    assert f"{C}.ppo_mini_batch_size=64 applies to the actor too" in report


def test_seed_ppo_block_with_a_batch_smaller_than_the_critic_mini_batch_names_the_critic_key(seed_ppo):
    text = message(seed_ppo + ["data.train_batch_size=32"])
    assert f"data.train_batch_size=32 must be a multiple of {C}.ppo_mini_batch_size=64" in text
    assert f"applies to the actor too, whose {A}.ppo_mini_batch_size is not set" in text
    assert f"{A}.ppo_mini_batch_size=256" not in text
    # the actor's own value, when set, is the one checked (and the critic's then follows it)
    text = message(seed_ppo + ["data.train_batch_size=32", f"{A}.ppo_mini_batch_size=48", f"{C}.ppo_mini_batch_size=48"])
    assert f"data.train_batch_size=32 must be a multiple of {A}.ppo_mini_batch_size=48" in text


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_verl_default_loggers_without_wandb_still_write_metrics_jsonl(tiny, tmp_path, capsys):
    """No trainer.logger: verl's default [console, wandb]; wandb is not installed: a note names the install
    command, the run writes metrics.jsonl, and the last line points at it."""
    argv = [a for a in tiny if not a.startswith("trainer.logger=")] + ["trainer.val_before_train=false"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "[rlflow] note: trainer.logger: wandb" in out and f"`{tables.wandb_install()}`" in out
    metrics = tmp_path / "run" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and "actor/pg_loss" in rows[-1]
    assert out.rstrip().splitlines()[-1].endswith(f"metrics in {metrics}")
    assert "step:2 " in out  # the console logger is still there


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_wandb_asked_for_and_not_installed_is_an_error(tiny, capsys):
    assert main(tiny + ["trainer.logger=[console,wandb]"]) == 2
    assert "trainer.logger contains wandb, which is not installed: pip install wandb" in capsys.readouterr().err


def test_a_batch_that_does_not_split_over_the_processes_fails_validation_and_the_dry_run(tiny, capsys):
    argv = tiny + ["trainer.n_gpus_per_node=3"]  # CPU processes; data.train_batch_size=4
    expected = ("data.train_batch_size=4 must be a multiple of the number of processes, trainer.n_gpus_per_node x "
                "trainer.nnodes = 3 x 1 = 3")
    assert expected in message(argv)
    assert main(["--dry-run"] + argv) == 2
    assert expected in capsys.readouterr().err
    assert "processes" not in message(tiny + ["trainer.n_gpus_per_node=2"])  # 4 prompts: 2 per process


def test_enable_vision_on_a_text_only_model_fails_validation(tiny, model_dir, capsys):
    argv = tiny + [f"{R}.enable_vision=true"]
    expected = (f"{R}.enable_vision=True but actor_rollout_ref.model.path='{model_dir}' is a text-only model "
                "(its config.json has no vision_config; model_type='qwen2')")
    assert expected in message(argv)
    assert main(["--dry-run"] + argv) == 2
    assert expected in capsys.readouterr().err
