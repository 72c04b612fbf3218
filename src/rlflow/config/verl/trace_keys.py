"""verl's rollout tracing (``actor_rollout_ref.rollout.trace.*``) -> the kwargs of
:class:`rlflow.rollout.tracing.TracedRollout`.

``trace.backend=mlflow``: each traced sample becomes an MLflow trace in the experiment ``trace.project_name``
(verl's ``mlflow.set_experiment(project_name)``; the traces carry ``trace.experiment_name``), at
``$MLFLOW_TRACKING_URI``, else a ``file:`` store in ``<trainer.default_local_dir>/mlruns``.
``trace.backend=trackio``: a ``trackio.Trace`` per traced sample in the Trackio project ``trace.project_name``, run
``trace.experiment_name`` (verl's ``trackio.init(project=, name=)``), in ``$TRACKIO_DIR``, else
``<trainer.default_local_dir>/trackio``. ``trace.token2text`` decodes the token ids to text;
``trace.max_samples_per_step_per_worker`` caps the prompts traced per step (rlflow generates in one worker).
``weave`` is refused in :mod:`rlflow.config.verl.tables`.
"""

from __future__ import annotations

from rlflow.config.errors import ConfigError
from rlflow.config.verl.loading import VerlConfig

T = "actor_rollout_ref.rollout.trace"
TRACE_ONLY = f"only used with {T}.backend=mlflow or trackio (rollout tracing: rlflow.rollout.TracedRollout)"
WHERE = {"mlflow": ("the MLflow experiment", "$MLFLOW_TRACKING_URI", "mlruns"),
         "trackio": ("the Trackio project", "$TRACKIO_DIR", "trackio")}


def trace_plan(cfg: VerlConfig, notes: list[str]) -> dict | None:
    """TracedRollout's kwargs, or None when ``trace.backend`` is unset (the other trace keys then get a note)."""
    if cfg[f"{T}.backend"] is None:
        defaults = {"token2text": False, "max_samples_per_step_per_worker": None,
                    "project_name": cfg["trainer.project_name"], "experiment_name": cfg["trainer.experiment_name"]}
        for key, default in defaults.items():
            if cfg[f"{T}.{key}"] != default:
                notes.append(f"{T}.{key}: {TRACE_ONLY}")
        return None
    cap = cfg[f"{T}.max_samples_per_step_per_worker"]
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ConfigError(f"{T}.max_samples_per_step_per_worker={cap!r}: expected null (trace every sample) or a "
                          "whole number >= 1 (prompts traced per step)")
    backend = cfg[f"{T}.backend"]
    kwargs = {"backend": backend, "experiment": str(cfg[f"{T}.project_name"] or cfg["trainer.project_name"]),
              "run_name": cfg[f"{T}.experiment_name"] or cfg["trainer.experiment_name"],
              "folder": str(cfg["trainer.default_local_dir"]), "token2text": bool(cfg[f"{T}.token2text"]),
              "max_samples_per_step": cap}
    what, env, sub = WHERE[backend]
    notes.append(f"{T}.backend={backend}: rollout traces go to {what} {kwargs['experiment']!r} at {env}, else "
                 f"{kwargs['folder']}/{sub} (needs pip install 'rlflow[tracing]')")
    return kwargs
