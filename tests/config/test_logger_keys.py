"""verl's trainer.logger=mlflow, clearml and trackio through the verl entry point: a tiny run's per-step metrics in an
MLflow run (read back with MLflow's client), an offline ClearML task or a local Trackio run (read back with Trackio's
SQLite store) equal the jsonl logger's, the config is logged as verl logs it; the loggers rlflow lacks are refused
naming what they need."""

import importlib.util
import json
import os
import shutil

import pytest

from rlflow.config import NotSupportedError, load_config, make_plan
from rlflow.config.verl import tables
from rlflow.trainer.main_ppo import main
from rlflow.trainer.clearml_logger import title_and_series
from rlflow.trainer.mlflow_logger import sanitize


def test_mlflow_logger_of_a_tiny_run_equals_the_jsonl_logger_and_keeps_the_config(tiny, tmp_path, monkeypatch, capsys):
    mlflow = pytest.importorskip("mlflow", reason="the mlflow logger needs mlflow-skinny (pip install 'rlflow[tracing]')")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")  # recorded, so what mlflow.set_tracking_uri writes is undone
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    assert main(tiny + ["trainer.logger=[console,mlflow]", "trainer.project_name=p", "trainer.experiment_name=e",
                        "trainer.test_freq=1"]) == 0
    client = mlflow.MlflowClient((tmp_path / "run" / "mlruns").as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("p").experiment_id])
    assert (run.info.run_name, run.info.status) == ("e", "FINISHED")
    assert run.data.params["trainer/project_name"] == "p" and run.data.params["data/train_batch_size"] == "4"
    assert run.data.params["trainer/logger/list_len"] == "2" and run.data.params["trainer/logger/1"] == "mlflow"
    jsonl = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in jsonl] == [0, 1, 2] and any("@" in key for key in jsonl[0])  # val-core/...mean@1
    for row in jsonl:
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)):
                history = client.get_metric_history(run.info.run_id, sanitize(key))
                assert [m.value for m in history if m.step == row["step"]] == [pytest.approx(value)], (key, row["step"])


def test_clearml_logger_of_a_tiny_run_records_the_jsonl_loggers_metrics_in_an_offline_task(tiny, tmp_path,
                                                                                            monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # ClearML's offline sessions: ~/.clearml/cache/offline
    monkeypatch.setenv("CLEARML_OFFLINE_MODE", "1")
    pytest.importorskip("clearml", reason="the clearml logger needs `pip install clearml`")
    # ClearML's repository detection runs git from a thread while Task.init forks; the logger turns it off (its
    # docstring), so a git that records its calls is never called
    calls, shim = tmp_path / "git-calls", tmp_path / "bin" / "git"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec {shutil.which("git") or "false"} "$@"\n')
    shim.chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim.parent}{os.pathsep}{os.environ['PATH']}")
    assert main(tiny + ["trainer.logger=[console,clearml]", "trainer.project_name=p", "trainer.experiment_name=e",
                        "trainer.test_freq=1"]) == 0
    [folder] = [p.parent for p in (tmp_path / "home").glob(".clearml/cache/offline/*/task.json")]
    task = json.loads((folder / "task.json").read_text())
    assert task["name"] == "e" and "train_batch_size = 4" in task["configuration"]["Hyperparameters"]["value"]
    events = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    scalars = {(e["iter"], e["metric"], e["variant"]): e["value"] for batch in events for e in batch
               if e["type"] == "training_stats_scalar"}
    jsonl = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    expected = {(row["step"], *title_and_series(k)): v for row in jsonl for k, v in row.items()
                if k != "step" and isinstance(v, (int, float))}
    scalars = {key: v for key, v in scalars.items() if not key[1].startswith(":monitor:")}  # ClearML's machine stats
    assert len(expected) > 20 and scalars == pytest.approx(expected)
    assert not calls.exists(), calls.read_text()


def test_trackio_logger_of_a_tiny_run_equals_the_jsonl_logger_and_keeps_the_config(tiny, tmp_path, trackio_dir,
                                                                                     monkeypatch):
    from trackio.sqlite_storage import SQLiteStorage
    monkeypatch.setenv("TRACKIO_DIR", str(trackio_dir))
    assert main(tiny + ["trainer.logger=[console,trackio]", "trainer.project_name=verl-trackio",
                        "trainer.experiment_name=e", "trainer.test_freq=1"]) == 0
    config = SQLiteStorage.get_run_config("verl-trackio", "e")
    assert config["trainer"]["logger"] == ["console", "trackio"] and config["data"]["train_batch_size"] == 4
    logged = {row["step"]: row for row in SQLiteStorage.get_logs("verl-trackio", run="e")}
    jsonl = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in jsonl] == [0, 1, 2] == sorted(logged) and any("@" in key for key in jsonl[0])
    for row in jsonl:
        numeric = {k: v for k, v in row.items() if k != "step" and (v is None or isinstance(v, (int, float)))}
        assert set(logged[row["step"]]) - {"step", "timestamp"} == set(numeric), row["step"]
        for key, value in numeric.items():
            if value is not None:  # None: not finite
                assert logged[row["step"]][key] == pytest.approx(value), (key, row["step"])


@pytest.mark.parametrize("name, needs", [("swanlab", "swanlab package.*SwanLab account"),
                                         ("vemlp_wandb", "Volcano Engine's W&B.*volcengine_ml_platform")])
def test_the_loggers_rlflow_lacks_are_refused_naming_what_they_need(tiny, name, needs):
    with pytest.raises(NotSupportedError, match=f"trainer.logger='{name}'.*{needs}.*metrics.jsonl"):
        make_plan(load_config(tiny + [f"trainer.logger=[console,{name}]"]))


def test_no_pip_command_for_an_installed_logger_or_one_that_needs_nothing():
    assert tables.logger_install("console") is None
    for name in ("mlflow", "trackio"):  # a pip command exactly where the package is missing
        assert (tables.logger_install(name) is None) == (importlib.util.find_spec(name) is not None), name
