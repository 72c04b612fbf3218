"""Rollout tracing into MLflow (verl's rollout.trace.backend=mlflow): a tiny training run writes one MLflow trace
per traced sample, read back with MLflow's own API: spans, inputs, outputs, the step, and the per-step cap."""

import copy
import os

import pytest

from rlflow import FunctionReward, GRPO, HFRollout, Policy, PPOLoss, PromptData, Trainer
from rlflow.rollout.tracing import TracedRollout
from rlflow.trainer.options import groups
from tests.trainer.helpers import starts_with_digit

mlflow = pytest.importorskip("mlflow", reason="rollout tracing needs mlflow-skinny (pip install 'rlflow[tracing]')")


def test_a_run_writes_one_trace_per_traced_sample_capped_per_step(model, tokenizer, addition_rows, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")  # recorded, so what mlflow.set_tracking_uri writes is undone
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    train, val = addition_rows
    rollout = TracedRollout(HFRollout(n=2, max_new_tokens=4), experiment="tiny", folder=str(tmp_path / "run"),
                            token2text=True, max_samples_per_step=3, run_name="trace-test")
    trainer = Trainer(policy=Policy(copy.deepcopy(model), tokenizer), rollout=rollout,
                      reward=FunctionReward(starts_with_digit), estimator=GRPO(), loss=PPOLoss(),
                      **groups(batch_size=4, lr=1e-3, max_steps=2, run_dir=tmp_path / "run", progress=False))
    trainer.fit(PromptData(train, val=val, seed=0))
    assert rollout.location == (tmp_path / "run" / "mlruns").as_uri()
    # MLflow writes $MLFLOW_TRACKING_URI when pointed at a store; a second run in this process must not find this
    # run's store there and take it for the user's (the suite's next tracing test did)
    assert "MLFLOW_TRACKING_URI" not in os.environ
    mlflow.set_tracking_uri(rollout.location)
    experiment = mlflow.get_experiment_by_name("tiny")
    traces = mlflow.search_traces(locations=[experiment.experiment_id], return_type="list")
    by_step = {}
    for trace in traces:
        root, = [s for s in trace.data.spans if s.parent_id is None]
        generate, = [s for s in trace.data.spans if s.parent_id == root.span_id]
        assert root.name == "rollout" and generate.name == "generate"
        assert root.attributes["experiment"] == "trace-test"
        by_step.setdefault(root.attributes["step"], []).append((root.attributes["sample_index"],
                                                                root.attributes["rollout_n"]))
        prompt, response = root.inputs["prompt"], root.outputs["response"]
        assert generate.inputs["prompt_ids"] == prompt["ids"] and generate.outputs == response
        assert prompt["text"] == tokenizer.decode(prompt["ids"]) and "+" in prompt["text"]
        assert 1 <= len(response["ids"]) <= 4 and response["text"] == tokenizer.decode(response["ids"])
    # 4 prompts x 2 samples per step; 3 prompts traced per step, with both their samples
    assert sorted(by_step) == [1, 2]
    for pairs in by_step.values():
        assert len(pairs) == 6 and len({i for i, _ in pairs}) == 3 and {n for _, n in pairs} == {0, 1}
        assert all(0 <= i < 4 for i, _ in pairs)


def test_a_cap_below_one_is_refused():
    with pytest.raises(ValueError, match="max_samples_per_step=0"):
        TracedRollout(HFRollout(n=2, max_new_tokens=4), max_samples_per_step=0)
