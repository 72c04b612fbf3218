"""verl's ``trainer.logger=trackio``: each step's numeric metrics, at that step, in a Trackio run.

As verl's (``verl/utils/tracking.py``): ``trackio.init(project=project_name, name=experiment_name, config=config)``,
``log(metrics, step=step)`` each step, ``finish()`` at the end; the run is the current ``trackio`` run. The store is
Trackio's local SQLite database ``<project>.db`` in ``$TRACKIO_DIR`` when set, else in ``<run_dir>/trackio`` (no
Hugging Face account, no server), found as rollout tracing finds it
(:func:`rlflow.rollout.trace_writers.import_trackio`). Read it back with ``trackio show`` or
``trackio.sqlite_storage.SQLiteStorage.get_logs(project, run)``.

Needs ``trackio`` (``pip install 'rlflow[tracing]'``), imported when the run opens.
"""

from __future__ import annotations

import numbers
from pathlib import Path

from lightning_fabric.loggers import Logger
from lightning_fabric.utilities.rank_zero import rank_zero_only

from rlflow.rollout.trace_writers import flush_trackio, import_trackio


class TrackioLogger(Logger):
    """Logs to one Trackio run, opened at the first call (with the run's config when ``log_hyperparams`` comes
    first, as verl's entry point calls it).

    ``root_dir``: the run folder (its ``trackio`` is the default store); ``project``: the Trackio project;
    ``experiment``: the run's name. ``location``: the folder of the database, once open.
    """

    logs_config = True  # verl's entry point gives it the run's config (log_hyperparams): trackio.init's config

    def __init__(self, root_dir: str | Path, project: str = "rlflow", experiment: str = "run"):
        self._root, self.project, self.experiment = Path(root_dir), project, experiment
        self.location, self._run = None, None

    @property
    def name(self) -> str:
        return "trackio"

    @property
    def version(self) -> str:
        return ""

    def _open(self, config: dict | None = None):
        if self._run is None:
            trackio, self.location = import_trackio(str(self._root), "logger 'trackio'", "metrics")
            self._run = trackio.init(project=self.project, name=self.experiment, config=config, embed=False,
                                     auto_log_cpu=False, auto_log_gpu=False)
        return self._run

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        run = self._open()
        run.log({k: v for k, v in metrics.items() if isinstance(v, numbers.Number)}, step=step)
        flush_trackio(run)  # the step is in the database when it returns

    @rank_zero_only
    def log_hyperparams(self, params, *args, **kwargs) -> None:
        self._open(dict(params))

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._run is not None:
            from trackio import context_vars  # deferred: trackio is optional
            if context_vars.current_run.get() is self._run:
                context_vars.current_run.set(None)  # as trackio.finish() leaves it
            self._run.finish()
            self._run = None
