"""Bad data, model folders and run folders through ``python -m rlflow.trainer.main_ppo``: exit code 2 and one
message naming the key and the culprit (file, row, column, folder)."""

import shutil

import pandas as pd
import pytest

import rlflow.config.verl.devices as devices
from rlflow.trainer.main_ppo import main

from .conftest import verl_rows


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


@pytest.fixture
def gappy_train(tmp_path):
    """verl rows, two of which (rows 5 and 9) have a reward_model without ground_truth."""
    rows = verl_rows(12, "train", 0)
    for i in (5, 9):
        rows[i]["reward_model"] = {"style": "rule"}
    path = tmp_path / "gappy.parquet"
    pd.DataFrame(rows).to_parquet(path)
    return path


def test_rows_without_ground_truth_stop_the_run_at_load(tiny, gappy_train, capsys):
    assert main(tiny + [f"data.train_files={gappy_train}"]) == 2
    err = capsys.readouterr().err
    assert "data.train_files" in err and "gappy.parquet, row 5: no ground truth" in err
    assert "reward_model.ground_truth" in err and "2 of 12 rows" in err and "data.missing_ground_truth=skip" in err


def test_rows_without_ground_truth_skipped_and_counted_on_request(tiny, gappy_train, capsys):
    assert main(tiny + [f"data.train_files={gappy_train}", "data.missing_ground_truth=skip",
                        "trainer.total_training_steps=1", "trainer.val_before_train=False"]) == 0
    assert "dropped 2 training and 0 validation row(s) without reward_model.ground_truth" in capsys.readouterr().out


def test_unwritable_run_folder(tiny, tmp_path, capsys):
    (tmp_path / "taken").write_text("a file")
    assert main(tiny + [f"trainer.default_local_dir={tmp_path}/taken/run"]) == 2
    err = capsys.readouterr().err
    assert "trainer.default_local_dir: run folder" in err and "taken/run is not writable" in err


def test_model_folder_without_weights(tiny, model_dir, tmp_path, capsys):
    broken = tmp_path / "model"
    shutil.copytree(model_dir, broken)
    (broken / "model.safetensors").unlink()
    assert main(tiny + [f"actor_rollout_ref.model.path={broken}"]) == 2
    err = capsys.readouterr().err
    assert "actor_rollout_ref.model.path:" in err and "model: no weights (model.safetensors" in err


def test_chat_data_with_a_tokenizer_without_chat_template(tiny, model_dir, tmp_path, capsys):
    plain = tmp_path / "model"
    shutil.copytree(model_dir, plain)
    config = (plain / "tokenizer_config.json").read_text()
    (plain / "tokenizer_config.json").write_text(__import__("re").sub(r'"chat_template": "[^"]*",?', "", config))
    if (plain / "chat_template.jinja").exists():
        (plain / "chat_template.jinja").unlink()
    assert main(tiny + [f"actor_rollout_ref.model.path={plain}"]) == 2
    err = capsys.readouterr().err
    assert "train.parquet, row 0: the prompt is chat messages but the tokenizer" in err
    assert "actor_rollout_ref.model.custom_chat_template" in err
