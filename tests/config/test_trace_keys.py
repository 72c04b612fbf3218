"""verl's rollout tracing through the verl entry point: trace.backend=mlflow|trackio wraps the rollout in TracedRollout
and a tiny run writes MLflow traces under the run folder, or Trackio traces into $TRACKIO_DIR (capped per step);
weave is refused naming what it needs; the other trace keys without a backend get a note."""

import pytest

from rlflow.config import ConfigError, NotSupportedError, load_config, make_plan
from rlflow.config.verl.build import build_trainer
from rlflow.rollout.tracing import TracedRollout

T = "actor_rollout_ref.rollout.trace"


def test_mlflow_tracing_of_a_tiny_run_writes_capped_traces_under_the_run_folder(tiny, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow", reason="rollout tracing needs mlflow-skinny (pip install 'rlflow[tracing]')")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")  # recorded, so what mlflow.set_tracking_uri writes is undone
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    plan = make_plan(load_config(tiny + [f"{T}.backend=mlflow", f"{T}.token2text=true", "trainer.project_name=p",
                                         "trainer.experiment_name=e", f"{T}.max_samples_per_step_per_worker=1",
                                         "trainer.val_before_train=false", "trainer.test_freq=-1"]))
    assert any(n.startswith(f"{T}.backend=mlflow: rollout traces go to the MLflow experiment 'p'") for n in plan.notes)
    trainer, data = build_trainer(plan)
    assert isinstance(trainer.rollout, TracedRollout)
    trainer.fit(data)
    assert trainer.rollout.location == (tmp_path / "run" / "mlruns").as_uri()
    mlflow.set_tracking_uri(trainer.rollout.location)
    traces = mlflow.search_traces(locations=[mlflow.get_experiment_by_name("p").experiment_id], return_type="list")
    roots = [next(s for s in t.data.spans if s.parent_id is None) for t in traces]
    # 2 steps x 1 traced prompt x rollout.n=2 samples
    assert sorted((r.attributes["step"], r.attributes["rollout_n"]) for r in roots) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(r.attributes["experiment"] == "e" and r.outputs["response"]["text"] for r in roots)


def test_trackio_tracing_of_a_tiny_run_writes_capped_traces_to_the_trackio_project(tiny, trackio_dir, monkeypatch):
    from trackio.sqlite_storage import SQLiteStorage
    monkeypatch.setenv("TRACKIO_DIR", str(trackio_dir))
    plan = make_plan(load_config(tiny + [f"{T}.backend=trackio", f"{T}.token2text=true", "trainer.project_name=tp",
                                         "trainer.experiment_name=te", f"{T}.max_samples_per_step_per_worker=1",
                                         "trainer.val_before_train=false", "trainer.test_freq=-1"]))
    assert any(n.startswith(f"{T}.backend=trackio: rollout traces go to the Trackio project 'tp' at $TRACKIO_DIR")
               for n in plan.notes)
    trainer, data = build_trainer(plan)
    assert isinstance(trainer.rollout, TracedRollout) and trainer.rollout.backend == "trackio"
    trainer.fit(data)
    assert trainer.rollout.location == trackio_dir
    traces = SQLiteStorage.get_traces("tp", run="te")
    # 2 steps x 1 traced prompt x rollout.n=2 samples
    assert sorted((t["step"], t["metadata"]["rollout_n"]) for t in traces) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(t["metadata"]["experiment"] == "te" and t["messages"][1]["content"] for t in traces)


def test_weave_tracing_is_refused_naming_what_it_needs(tiny):
    with pytest.raises(NotSupportedError, match=f"{T}.backend='weave'.*W&B account and server"):
        make_plan(load_config(tiny + [f"{T}.backend=weave"]))


def test_a_bad_cap_is_refused_and_trace_keys_without_a_backend_get_a_note(tiny):
    with pytest.raises(ConfigError, match=f"{T}.max_samples_per_step_per_worker=0: expected null"):
        make_plan(load_config(tiny + [f"{T}.backend=mlflow", f"{T}.max_samples_per_step_per_worker=0"]))
    plan = make_plan(load_config(tiny + [f"{T}.token2text=true"]))
    assert plan.trace is None and f"{T}.token2text: only used with {T}.backend=mlflow or trackio" in "\n".join(plan.notes)
