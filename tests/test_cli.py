import re

import pytest

from rlflow.cli import main


def test_default_job_prints_accuracy_line_and_saves_curve(tmp_path, capsys):
    assert main(["train", "--steps", "3", "--run-dir", str(tmp_path), "--no-progress"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"held-out accuracy: [01]\.\d\d -> [01]\.\d\d", lines[-1]), lines[-1]
    assert re.match(r"3 GRPO steps in \d+ s \(\+ setup and warm start \d+ s, validation \d+ s\); metrics in ", lines[-2])
    assert (tmp_path / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "summary.json").exists() and (tmp_path / "metrics.jsonl").exists()


def test_unknown_subcommand_is_an_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["fly"])
    assert exc.value.code == 2
    assert "invalid choice: 'fly'" in capsys.readouterr().err


def test_prepare_task_writes_the_model_and_parquet_files(tmp_path, monkeypatch, capsys):
    from rlflow.tasks import prepare as export

    monkeypatch.setattr(export, "warm_started_model", lambda task, seed, **_: (task.model(seed), task.tokenizer()))
    assert main(["prepare-task", "addition", str(tmp_path)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert {p.name for p in tmp_path.iterdir()} == {"model", "train.parquet", "test.parquet"}
    assert (tmp_path / "model" / "config.json").exists() and (tmp_path / "model" / "tokenizer.json").exists()


def test_the_vision_job_refuses_the_vllm_rollout(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--task", "vision", "--rollout", "vllm"])
    assert exc.value.code == 2
    assert "--task vision generates with transformers (--rollout hf)" in capsys.readouterr().err
