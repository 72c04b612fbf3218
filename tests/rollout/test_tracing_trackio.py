"""Rollout tracing into Trackio (verl's rollout.trace.backend=trackio): a tiny training run writes one trackio.Trace
per traced sample into a local Trackio project, read back with Trackio's own SQLite store: the messages (the
decoded prompt and response), the step, and the per-step cap. Trackio's folder: $TRACKIO_DIR, else the run's."""

import copy
import json
import os
import subprocess
import sys

import pytest

from rlflow import FunctionReward, GRPO, HFRollout, Policy, PPOLoss, PromptData, Trainer
from rlflow.rollout.trace_writers import TrackioTraceWriter
from rlflow.rollout.tracing import TracedRollout
from rlflow.trainer.options import groups
from tests.trainer.helpers import starts_with_digit


def test_a_run_writes_one_trackio_trace_per_traced_sample_capped_per_step(model, tokenizer, addition_rows, tmp_path,
                                                                          trackio_dir, monkeypatch):
    from trackio.sqlite_storage import SQLiteStorage
    monkeypatch.setenv("TRACKIO_DIR", str(trackio_dir))
    train, val = addition_rows
    rollout = TracedRollout(HFRollout(n=2, max_new_tokens=4), backend="trackio", experiment="tiny-trackio",
                            folder=str(tmp_path / "run"), token2text=True, max_samples_per_step=3, run_name="traced")
    trainer = Trainer(policy=Policy(copy.deepcopy(model), tokenizer), rollout=rollout,
                      reward=FunctionReward(starts_with_digit), estimator=GRPO(), loss=PPOLoss(),
                      **groups(batch_size=4, lr=1e-3, max_steps=2, run_dir=tmp_path / "run", progress=False))
    trainer.fit(PromptData(train, val=val, seed=0))
    assert rollout.location == trackio_dir and (trackio_dir / "tiny-trackio.db").is_file()
    # 4 prompts x 2 samples per step; 3 prompts traced per step, with both their samples
    assert SQLiteStorage.get_trace_steps("tiny-trackio", run="traced")["steps"] == [{"step": 1, "count": 6},
                                                                                    {"step": 2, "count": 6}]
    by_step = {}
    for trace in SQLiteStorage.get_traces("tiny-trackio", run="traced"):
        meta = trace["metadata"]
        assert trace["key"] == "rollout_trace/rollout" and trace["step"] == meta["step"]
        assert meta["experiment"] == "traced" and meta["backend"] == "trackio"
        (user, prompt), (assistant, response) = [(m["role"], m["content"]) for m in trace["messages"]]
        assert (user, assistant) == ("user", "assistant")
        assert prompt == tokenizer.decode(meta["prompt_ids"]) and "+" in prompt
        assert 1 <= len(meta["response_ids"]) <= 4 and response == tokenizer.decode(meta["response_ids"])
        by_step.setdefault(trace["step"], []).append((meta["sample_index"], meta["rollout_n"]))
    assert sorted(by_step) == [1, 2]
    for pairs in by_step.values():
        assert len(pairs) == 6 and len({i for i, _ in pairs}) == 3 and {n for _, n in pairs} == {0, 1}


def test_without_token2text_the_messages_carry_the_ids_and_a_second_folder_is_warned_about(tmp_path, trackio_dir,
                                                                                            monkeypatch):
    from trackio.sqlite_storage import SQLiteStorage
    monkeypatch.delenv("TRACKIO_DIR", raising=False)
    writer = TrackioTraceWriter("warned", folder=str(tmp_path / "run"), run_name="w")
    with pytest.warns(UserWarning, match=f"traces go to {trackio_dir}, where trackio was pointed .* not "
                                         f"{tmp_path / 'run' / 'trackio'}"):
        writer.write({"step": 3}, {"ids": [5, 6]}, {"ids": [7]})
    writer.flush()
    trace, = SQLiteStorage.get_traces("warned", run="w")
    assert trace["step"] == 3 and [m["content"] for m in trace["messages"]] == ["[5, 6]", "[7]"]


def test_trackio_writes_under_the_run_folder_when_TRACKIO_DIR_is_unset(tmp_path):
    pytest.importorskip("trackio", reason="Trackio tracing needs trackio (pip install 'rlflow[tracing]')")
    script = f"""
import json, os
from rlflow.rollout.trace_writers import TrackioTraceWriter
writer = TrackioTraceWriter("p", folder={str(tmp_path / 'run')!r}, run_name="r")
writer.write({{"step": 1}}, {{"ids": [1], "text": "a"}}, {{"ids": [2], "text": "b"}})
writer.flush()
from trackio.sqlite_storage import SQLiteStorage  # imported by the writer, pointed at the run folder
print("RESULT", json.dumps([str(writer.location), "TRACKIO_DIR" in os.environ, len(SQLiteStorage.get_traces("p", run="r"))]))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRACKIO_DIR"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    result, = [line[len("RESULT "):] for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    location, env_left, traces = json.loads(result)
    assert location == str(tmp_path / "run" / "trackio") and not env_left and traces == 1
    assert (tmp_path / "run" / "trackio" / "p.db").is_file()


def test_an_unknown_backend_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"backend='weave': expected one of \('mlflow', 'trackio'\)"):
        TracedRollout(HFRollout(n=2, max_new_tokens=4), backend="weave")
