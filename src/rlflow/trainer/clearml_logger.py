"""verl's ``trainer.logger=clearml``: each step's numeric metrics as ClearML scalars and the run's config as its
``Hyperparameters`` configuration, in a ClearML task.

As verl's (``verl/utils/tracking.py``): ``Task.init(project_name=project, task_name=experiment,
continue_last_task=True, output_uri=False)``; a metric ``a/b/c`` is the scalar of title ``a`` and series ``b/c``
(a name without ``/`` is its own title and series). Unlike verl's, two of ClearML's automatic features are off:

- logging of frameworks: it would patch ``torch.save`` and rlflow's checkpoints under it;
- repository detection: ClearML runs ``git`` from a thread while ``Task.init`` forks its reporting process, and the
  fork can inherit the pipe that ``subprocess`` waits on, so the thread never ends. Seen on a 2-core machine: a run's
  end stalled for ClearML's 300 s timeout, and one test run never ended.

The server and credentials are ClearML's (``clearml.conf``, ``$CLEARML_API_*``); ``CLEARML_OFFLINE_MODE=1`` records
the task on this machine (``~/.clearml/cache/offline/<task id>``, uploaded later with ``Task.import_offline_session``).

Needs the ``clearml`` package (``pip install clearml``), imported when the first step is logged.
"""

from __future__ import annotations

import numbers
from pathlib import Path

from lightning_fabric.loggers import Logger
from lightning_fabric.utilities.rank_zero import rank_zero_only


def title_and_series(key: str) -> tuple[str, str]:
    """verl's split of a metric name into ClearML's title and series."""
    title, _, series = key.partition("/")
    return title, series or title


class ClearMLLogger(Logger):
    """Logs to one ClearML task. ``project``: its project; ``experiment``: the task's name."""

    logs_config = True  # verl's entry point gives it the run's config (log_hyperparams): its Hyperparameters

    def __init__(self, root_dir: str | Path, project: str = "rlflow", experiment: str = "run"):
        self._root, self.project, self.experiment, self.task = Path(root_dir), project, experiment, None

    @property
    def name(self) -> str:
        return "clearml"

    @property
    def version(self) -> str:
        return self.task.id if self.task is not None else ""

    @property
    def root_dir(self) -> str:
        return str(self._root)

    # auto_connect_frameworks as a dict: a framework it does not name is connected (clearml.Task.init)
    _AUTO_CONNECT = dict.fromkeys(
        ["hydra", "scikit", "joblib", "matplotlib", "tensorflow", "tensorboard", "tfdefines", "pytorch", "megengine",
         "xgboost", "catboost", "fastai", "lightgbm", "gradio", "detect_repository"], False)

    def _task(self):
        if self.task is None:
            from clearml import Task  # deferred: clearml is optional

            self.task = Task.init(project_name=self.project, task_name=self.experiment, continue_last_task=True,
                                  output_uri=False, auto_connect_frameworks=self._AUTO_CONNECT)
        return self.task

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        report = self._task().get_logger().report_scalar
        for key, value in metrics.items():
            if isinstance(value, numbers.Number):
                title, series = title_and_series(key)
                report(title=title, series=series, value=float(value), iteration=step or 0)

    @rank_zero_only
    def log_hyperparams(self, params, *args, **kwargs) -> None:
        self._task().connect_configuration(params, name="Hyperparameters")

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self.task is not None:
            self.task.close()
            self.task = None
