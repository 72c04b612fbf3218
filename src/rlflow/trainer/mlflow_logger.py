"""verl's ``trainer.logger=mlflow``: each step's numeric metrics and the run's config in an MLflow run.

As verl's (``verl/utils/tracking.py``): the MLflow experiment is the project name and the run is named after the
experiment name; ``$MLFLOW_RUN_ID`` attaches to an existing run (Azure ML and Databricks set it); the config is
logged as params flattened with ``/`` (a list becomes ``list_len`` and its indices); validation samples
(``LogValidationGenerations``, verl's ``trainer.log_val_generations``) are the artifact ``val_step{N}.json``; metric
names MLflow refuses are sanitized (``@`` -> ``_at_``, repeated ``/`` -> one, other refused characters -> ``_``). The store is
``$MLFLOW_TRACKING_URI`` when set, else a ``file:`` store in ``<run_dir>/mlruns`` (verl's default is a SQLite file
in /tmp, which mlflow-skinny cannot write: it lacks SQLAlchemy), found as rollout tracing finds it
(:func:`rlflow.rollout.trace_writers.open_store`).

Needs ``mlflow-skinny`` (``pip install 'rlflow[tracing]'``), imported when the logger is built.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import numbers
import os
import re
import time
from pathlib import Path

from lightning_fabric.loggers import Logger
from lightning_fabric.utilities.rank_zero import rank_zero_only

from rlflow.rollout.trace_writers import open_store

_REFUSED = re.compile(r"[^/\w.\- :]")  # MLflow takes slashes, alphanumerics, _ . - : and spaces in a name
_BATCH = 100  # MLflow's limit on params per log_batch (metrics: 1000)
_PARAM_CHARS = 6000  # MLflow 3's limit on a param's value


def sanitize(key: str) -> str:
    """A metric name MLflow accepts, as verl's MLflow logger makes it."""
    return _REFUSED.sub("_", re.sub(r"/+", "/", key.replace("@", "_at_")))


def flat_params(config, prefix: str = "") -> dict[str, str]:
    """verl's MLflow params of a config: nested keys joined with ``/``, a list as ``list_len`` and its indices."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    if isinstance(config, (list, tuple)):
        config = {"list_len": len(config), **{str(i): v for i, v in enumerate(config)}}
    if isinstance(config, dict):
        out = {}
        for key, value in config.items():
            out |= flat_params(value, f"{prefix}{key}/")
        return out
    value = config.value if isinstance(config, enum.Enum) else config
    return {prefix[:-1]: str(value)[:_PARAM_CHARS]}


class MLflowLogger(Logger):
    """Logs to one MLflow run (through an ``MlflowClient``: no active run is left in MLflow's global state).

    ``root_dir``: the run folder (its ``mlruns`` is the default store); ``project``: the MLflow experiment;
    ``experiment``: the run's name; ``tracking_uri``: the store (default ``$MLFLOW_TRACKING_URI``, else the folder).
    """

    logs_config = True  # verl's entry point gives it the run's config (log_hyperparams): MLflow params

    def __init__(self, root_dir: str | Path, project: str = "rlflow", experiment: str = "run",
                 tracking_uri: str | None = None):
        self._root, self.project, self.experiment = Path(root_dir), project, experiment
        self.tracking_uri, self.run_id, self._client = tracking_uri, None, None

    @property
    def name(self) -> str:
        return "mlflow"

    @property
    def version(self) -> str:
        return self.run_id or ""

    @property
    def root_dir(self) -> str:
        return str(self._root)

    def _run(self):
        if self._client is None:
            mlflow, self.tracking_uri = open_store(self.tracking_uri, str(self._root), self.project)
            self._client = mlflow.MlflowClient(self.tracking_uri)
            self.run_id = os.environ.get("MLFLOW_RUN_ID")
            if not self.run_id:
                experiment_id = self._client.get_experiment_by_name(self.project).experiment_id
                self.run_id = self._client.create_run(experiment_id, run_name=self.experiment).info.run_id
        return self._client

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        from mlflow.entities import Metric  # deferred: mlflow is optional

        client, now = self._run(), int(time.time() * 1000)
        rows = [Metric(sanitize(k), float(v), now, step or 0) for k, v in metrics.items()
                if isinstance(v, numbers.Number)]
        for start in range(0, len(rows), 1000):
            client.log_batch(self.run_id, metrics=rows[start:start + 1000])

    @rank_zero_only
    def log_hyperparams(self, params, *args, **kwargs) -> None:
        from mlflow.entities import Param  # deferred: mlflow is optional

        client = self._run()
        rows = [Param(sanitize(k), v) for k, v in flat_params(params).items()]
        for start in range(0, len(rows), _BATCH):
            client.log_batch(self.run_id, params=rows[start:start + _BATCH])

    @rank_zero_only
    def log_generations(self, step: int, samples: list[tuple]) -> None:
        """Validation samples (input, output, score) as verl logs them: the artifact ``val_step{step}.json``."""
        rows = [{"input": inp, "output": out, "score": score} for inp, out, score in samples]
        self._run().log_text(self.run_id, json.dumps(rows, default=str), f"val_step{step}.json")

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._client is not None and not os.environ.get("MLFLOW_RUN_ID"):
            self._client.set_terminated(self.run_id, "FINISHED" if status == "success" else "FAILED")
