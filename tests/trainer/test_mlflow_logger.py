"""The MLflow logger from the Python API (``RunDir(loggers=(..., "mlflow"))``): a tiny run's metrics read back with
MLflow's own client equal the jsonl logger's, step by step; verl's metric-name and config-param rules; the install
hint when its package is missing."""

import importlib.util
import json
import math
import os

import pytest

from rlflow.trainer.generations import LogValidationGenerations
from rlflow.trainer.logger_packages import LOGGER_PACKAGES, install_command
from rlflow.trainer.mlflow_logger import flat_params, sanitize

from .helpers import make_trainer


def jsonl_rows(path) -> dict[int, dict]:
    return {row.pop("step"): row for row in map(json.loads, path.read_text().splitlines())}


def mlflow_metrics(client, run_id, keys) -> dict[int, dict]:
    """step -> {key: value}, each key's history read back with MlflowClient.get_metric_history."""
    out: dict[int, dict] = {}
    for key in keys:
        for m in client.get_metric_history(run_id, sanitize(key)):
            out.setdefault(m.step, {})[key] = m.value
    return out


def assert_same_metrics(jsonl: dict[int, dict], logged: dict[int, dict]) -> None:
    assert sorted(logged) == sorted(jsonl)
    for step, row in jsonl.items():
        numeric = {k: v for k, v in row.items() if v is None or isinstance(v, (int, float))}  # None: not finite
        assert set(logged[step]) == set(numeric), step
        for key, value in numeric.items():
            if value is None:
                assert not math.isfinite(logged[step][key]), key
            else:
                assert logged[step][key] == pytest.approx(value, rel=1e-12), key


def test_a_tiny_run_logs_the_jsonl_loggers_metrics_to_an_mlflow_run_in_the_run_folder(model, tokenizer, addition_rows,
                                                                                       tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow", reason="the mlflow logger needs mlflow-skinny (pip install 'rlflow[tracing]')")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")  # recorded, so what mlflow.set_tracking_uri writes is undone
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path, max_steps=2, loggers=("jsonl", "mlflow"),
                                 val_every=1, callbacks=[LogValidationGenerations(2)])
    trainer.fit(data)
    [logger] = [lg for lg in trainer.fabric.loggers if lg.name == "mlflow"]
    assert logger.tracking_uri == (tmp_path / "mlruns").as_uri()
    mlflow.set_tracking_uri(logger.tracking_uri)
    runs = mlflow.search_runs(experiment_names=["rlflow"], output_format="list")
    assert [(r.info.run_name, r.info.status) for r in runs] == [("run", "FINISHED")]
    client = mlflow.MlflowClient(logger.tracking_uri)
    jsonl = jsonl_rows(tmp_path / "metrics.jsonl")
    assert sorted(jsonl) == [1, 2] and len(jsonl[1]) > 10
    assert_same_metrics(jsonl, mlflow_metrics(client, runs[0].info.run_id, jsonl[1]))
    # the validation samples, as verl's MLflow logger keeps them: an artifact val_step{N}.json per validation
    samples = [json.loads(line) for line in (tmp_path / "val_generations.jsonl").read_text().splitlines()]
    for step in (1, 2):
        artifact = client.download_artifacts(runs[0].info.run_id, f"val_step{step}.json", str(tmp_path / "dl"))
        assert json.loads(open(artifact).read()) == [{k: r[k] for k in ("input", "output", "score")}
                                                     for r in samples if r["step"] == step]


def test_mlflow_tracking_uri_is_honoured_and_restored(model, tokenizer, addition_rows, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow", reason="the mlflow logger needs mlflow-skinny (pip install 'rlflow[tracing]')")
    store = (tmp_path / "elsewhere").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path / "run", max_steps=1, loggers=("mlflow",))
    trainer.fit(data)
    assert not (tmp_path / "run" / "mlruns").exists()
    [run] = mlflow.MlflowClient(store).search_runs(
        [mlflow.MlflowClient(store).get_experiment_by_name("rlflow").experiment_id])
    assert "actor/pg_loss" in run.data.metrics
    assert os.environ["MLFLOW_TRACKING_URI"] == store


def test_mlflow_run_id_attaches_to_an_existing_run_and_leaves_it_running(model, tokenizer, addition_rows, tmp_path,
                                                                          monkeypatch):
    mlflow = pytest.importorskip("mlflow", reason="the mlflow logger needs mlflow-skinny (pip install 'rlflow[tracing]')")
    store = (tmp_path / "store").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = mlflow.MlflowClient(store)
    outer = client.create_run(client.create_experiment("platform")).info.run_id  # as Azure ML or Databricks make it
    monkeypatch.setenv("MLFLOW_RUN_ID", outer)
    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path / "run", max_steps=1, loggers=("mlflow",))
    trainer.fit(data)
    run = client.get_run(outer)
    assert "actor/pg_loss" in run.data.metrics and run.info.status == "RUNNING"
    assert client.get_experiment_by_name("rlflow") is not None and not client.search_runs(
        [client.get_experiment_by_name("rlflow").experiment_id])


def test_metric_names_and_config_params_follow_verls_mlflow_logger():
    assert sanitize("val-core/gsm8k/reward/mean@4") == "val-core/gsm8k/reward/mean_at_4"
    assert sanitize("a//b(c)") == "a/b_c_"
    assert flat_params({"trainer": {"logger": ["console", "mlflow"], "n": 1}, "x": None}) == {
        "trainer/logger/list_len": "2", "trainer/logger/0": "console", "trainer/logger/1": "mlflow",
        "trainer/n": "1", "x": "None"}


def test_the_install_hint_names_the_missing_package():
    installed = importlib.util.find_spec("mlflow") is not None  # rlflow[tracing]; CI installs it
    assert (install_command(LOGGER_PACKAGES["mlflow"]) is None) == installed
    assert install_command({"rlflow_no_such_module": "mlflow-skinny"}) == "pip install mlflow-skinny"
