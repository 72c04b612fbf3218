"""Where :class:`rlflow.rollout.tracing.TracedRollout` writes its traces: one writer per
``rollout.trace.backend``, all with ``write(attributes, prompt, response)`` per traced sample and ``flush()``
per step. ``prompt``/``response`` are ``{"ids": [...]}`` plus ``"text"`` with ``token2text``.

- :class:`MlflowTraceWriter` (``mlflow``): an MLflow trace per sample, root span ``rollout`` with a child span
  ``generate``, in an MLflow experiment (needs ``mlflow-skinny``).
- :class:`TrackioTraceWriter` (``trackio``): a ``trackio.Trace`` per sample under the key
  ``rollout_trace/rollout`` at the step (as verl's ``_log_trackio_trace``), in a local Trackio project: a SQLite
  database in ``$TRACKIO_DIR``, else ``<folder>/trackio`` (needs ``trackio``; no Hugging Face account or server).

Both are in ``pip install 'rlflow[tracing]'``, imported only when a writer opens.
"""

from __future__ import annotations

import atexit
import os
import warnings
from pathlib import Path


def _import(module: str, package: str):
    try:
        return __import__(module)
    except ImportError as e:
        raise ImportError(f"TracedRollout (rollout.trace.backend={module}) needs the {package} package: "
                          "pip install 'rlflow[tracing]'") from e


def open_store(tracking_uri: str | None, folder: str | None, experiment: str):
    """Point MLflow at ``tracking_uri`` (else ``$MLFLOW_TRACKING_URI``, else a ``file:`` store in
    ``folder/mlruns``) and the experiment ``experiment``; returns the mlflow module and the URI used.

    MLflow 3 refuses a ``file:`` store unless ``MLFLOW_ALLOW_FILE_STORE=true`` (its SQL stores need
    SQLAlchemy, which mlflow-skinny lacks), so this sets it for the default store.
    """
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        if folder is None:
            raise ValueError("TracedRollout: give tracking_uri, set MLFLOW_TRACKING_URI or give a folder for mlruns")
        uri = (Path(folder).expanduser().resolve() / "mlruns").as_uri()
    if uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow = _import("mlflow", "mlflow-skinny")
    before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)  # it also writes $MLFLOW_TRACKING_URI for subprocesses: put the user's back, so
    if before is None:            # the next run in this process does not take this run's store for the user's
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before
    mlflow.set_experiment(experiment)
    return mlflow, uri


def import_trackio(folder: str | None, who: str, what: str):
    """The trackio module, pointed at ``folder/trackio`` unless ``$TRACKIO_DIR`` is set, and the folder of its
    databases. Trackio fixes its folder when first imported: an earlier import that fixed another is warned about
    (``who``: the component, ``what``: what it writes, for the messages)."""
    wanted = os.environ.get("TRACKIO_DIR")
    if not wanted:
        if folder is None:
            raise ValueError(f"{who}: set TRACKIO_DIR or give a folder for trackio")
        wanted = str(Path(folder).expanduser().resolve() / "trackio")
        os.environ["TRACKIO_DIR"] = wanted  # read once, when trackio is first imported; then taken back, so
        try:                                # the next run in this process does not take it for the user's
            trackio = _import("trackio", "trackio")
        finally:
            os.environ.pop("TRACKIO_DIR", None)
    else:
        trackio = _import("trackio", "trackio")
    from trackio import utils
    location = Path(utils.TRACKIO_DIR)
    if location.resolve() != Path(wanted).resolve():
        warnings.warn(f"{who}: {what} go to {location}, where trackio was pointed when first imported, not {wanted}",
                      stacklevel=4)
    return trackio, location


def flush_trackio(run) -> None:
    """Write what a trackio run has queued to its database now (its thread writes every 0.5 s; trackio 0.43, pinned,
    flushes inline)."""
    with run._client_lock:
        run._flush_queues_inline()


class MlflowTraceWriter:
    """MLflow traces in ``experiment`` at ``tracking_uri`` (:func:`open_store`); ``location``: the URI used."""

    def __init__(self, experiment: str, tracking_uri: str | None, folder: str | None):
        self.experiment, self.location, self.folder = experiment, tracking_uri, folder
        self._mlflow = None

    def write(self, attributes: dict, prompt: dict, response: dict) -> None:
        if self._mlflow is None:
            self._mlflow, self.location = open_store(self.location, self.folder, self.experiment)
        with self._mlflow.start_span(name="rollout", attributes=attributes) as root:
            root.set_inputs({"prompt": prompt})
            with self._mlflow.start_span(name="generate") as span:
                span.set_inputs({"prompt_ids": prompt["ids"]})
                span.set_outputs(response)
            root.set_outputs({"response": response})

    def flush(self) -> None:
        flush = getattr(self._mlflow, "flush_trace_async_logging", None)
        if flush is not None:
            flush()


class TrackioTraceWriter:
    """Trackio traces in the project ``experiment``, run ``run_name``; ``location``: the folder of its database.

    Trackio fixes its folder when first imported (``$TRACKIO_DIR``, else ``~/.cache/huggingface/trackio``): this
    points it at ``folder/trackio`` unless ``$TRACKIO_DIR`` is set, and warns when an earlier import fixed another.
    The run is this writer's own (the current ``trackio`` run, e.g. a logger's, stays current), finished when the
    process exits; each step is written to the database before ``forward`` returns.
    """

    KEY = "rollout_trace/rollout"

    def __init__(self, experiment: str, folder: str | None, run_name: str | None):
        self.experiment, self.folder, self.run_name = experiment, folder, run_name
        self.location, self._run, self._trackio = None, None, None

    def _open(self) -> None:
        trackio, self.location = import_trackio(self.folder, "TracedRollout(backend='trackio')", "traces")
        from trackio import context_vars
        current = context_vars.current_run.get()
        self._run = trackio.init(project=self.experiment, name=self.run_name, config={"framework": "rlflow"},
                                 embed=False, auto_log_cpu=False, auto_log_gpu=False)
        context_vars.current_run.set(current)
        atexit.register(self._run.finish)  # trackio's own exit hook finishes only the current run
        self._trackio = trackio

    def write(self, attributes: dict, prompt: dict, response: dict) -> None:
        if self._run is None:
            self._open()
        messages = [{"role": "user", "content": prompt.get("text", str(prompt["ids"]))},
                    {"role": "assistant", "content": response.get("text", str(response["ids"]))}]
        metadata = {**attributes, "backend": "trackio", "prompt_ids": prompt["ids"], "response_ids": response["ids"]}
        trace = self._trackio.Trace(messages=messages, metadata=metadata)
        self._run.log({self.KEY: trace}, step=attributes["step"])

    def flush(self) -> None:
        if self._run is not None:  # a step's traces are in the database when the step returns
            flush_trackio(self._run)
