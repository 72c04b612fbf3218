"""The Trackio logger from the Python API (``RunDir(loggers=(..., "trackio"))``): a tiny run's metrics read back with
Trackio's own SQLite store equal the jsonl logger's, step by step; the run is finished and no longer current; the
install hint when its package is missing."""

import importlib.util

import pytest

from rlflow.trainer.logger_packages import LOGGER_PACKAGES, install_command
from rlflow.trainer.loggers import make_loggers
from rlflow.trainer.trackio_logger import TrackioLogger

from .helpers import make_trainer
from .test_mlflow_logger import assert_same_metrics, jsonl_rows


def trackio_metrics(project: str, run: str) -> dict[int, dict]:
    """step -> {key: value} of a Trackio run, read back with trackio.sqlite_storage.SQLiteStorage.get_logs."""
    from trackio.sqlite_storage import SQLiteStorage
    return {row["step"]: {k: v for k, v in row.items() if k not in ("step", "timestamp")}
            for row in SQLiteStorage.get_logs(project, run=run)}


def test_a_tiny_run_logs_the_jsonl_loggers_metrics_to_a_local_trackio_run(model, tokenizer, addition_rows, tmp_path,
                                                                           trackio_dir, monkeypatch):
    from trackio import context_vars
    monkeypatch.setenv("TRACKIO_DIR", str(trackio_dir))
    logger = TrackioLogger(tmp_path, project="tiny-trackio-logger", experiment="logged")
    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path, max_steps=2, loggers=("jsonl", logger))
    trainer.fit(data)
    assert logger.location == trackio_dir and (trackio_dir / "tiny-trackio-logger.db").is_file()
    assert context_vars.current_run.get() is None  # finished at the end, as verl's trackio.finish()
    jsonl = jsonl_rows(tmp_path / "metrics.jsonl")
    assert sorted(jsonl) == [1, 2] and len(jsonl[1]) > 10
    assert_same_metrics(jsonl, trackio_metrics("tiny-trackio-logger", "logged"))


def test_trackio_is_a_logger_name_and_its_install_hint_names_the_package(tmp_path):
    if importlib.util.find_spec("trackio") is None:  # rlflow[tracing]; CI installs it
        assert install_command(LOGGER_PACKAGES["trackio"]) == "pip install trackio"
        with pytest.raises(ImportError, match="pip install trackio"):
            make_loggers(["trackio"], tmp_path, project="p", experiment="e")
    else:
        [logger] = make_loggers(["trackio"], tmp_path, project="p", experiment="e")
        assert isinstance(logger, TrackioLogger) and (logger.project, logger.experiment) == ("p", "e")
        assert install_command(LOGGER_PACKAGES["trackio"]) is None
    assert install_command({"rlflow_no_such_module": "trackio"}) == "pip install trackio"
