"""verl's ``reward_model.sandbox_fusion.url`` through the entry point: code data sources are scored on the server
(rlflow's own SandboxFusion server on 127.0.0.1) with the scores of the local sandbox; a dead url stops the run
naming it."""

import json

import pandas as pd
import pytest

from rlflow.rewards import RewardError
from rlflow.rewards.sandbox_server import SandboxFusionServer
from rlflow.sandbox import Sandbox
from rlflow.tasks.prepare import export_task
from rlflow.trainer.main_ppo import main

from .test_main_ppo import steps

MISSING = [layer for layer in Sandbox().require if layer not in Sandbox().isolation()]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"this kernel lacks the sandbox's required layers {MISSING}")
# The built-in addition task's warm-started model answers "34+11=" with digits ("45"): a Python program that runs and
# prints nothing, which passes a test expecting no output. Every other row's test expects output no answer prints,
# so the batch's scores differ from row to row (and a reply that is not Python fails the first kind too).
PASSABLE, FAILING = (json.dumps({"inputs": ["", "7\n"], "outputs": ["", ""]}),
                     json.dumps({"inputs": [""], "outputs": ["nothing prints this"]}))


@pytest.fixture(scope="module")
def code_task(tmp_path_factory):
    out = export_task(tmp_path_factory.mktemp("code-task"))
    for split, n in (("train", 16), ("test", 4)):
        rows = pd.read_parquet(out / f"{split}.parquet").head(n).to_dict("records")
        for i, row in enumerate(rows):
            row["data_source"] = "apps"
            row["reward_model"] = {"style": "rule", "ground_truth": PASSABLE if i % 2 else FAILING}
        pd.DataFrame(rows).to_parquet(out / f"{split}.parquet")
    return [f"data.train_files={out}/train.parquet", f"data.val_files={out}/test.parquet",
            f"actor_rollout_ref.model.path={out}/model"]


@pytest.fixture
def server():
    srv = SandboxFusionServer(("127.0.0.1", 0))
    srv.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def scores(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if ("score" in k or "reward" in k) and not k.startswith("timing")}


def test_code_is_scored_on_the_server_as_in_the_local_sandbox(tiny, code_task, server, capsys):
    run = tiny + code_task + ["trainer.total_training_steps=1"]
    assert main(run + ["--dry-run", f"reward_model.sandbox_fusion.url={server.url}"]) == 0
    assert "SandboxFusion(url='" + server.url in capsys.readouterr().out and server.requests == 0
    assert main(run) == 0
    local = steps(capsys.readouterr().out)
    assert main(run + [f"reward_model.sandbox_fusion.url={server.url}", "reward_model.sandbox_fusion.max_concurrent=2",
                       "reward_model.sandbox_fusion.memory_limit_mb=256"]) == 0
    served = steps(capsys.readouterr().out)
    # the step's 8 samples (4 of 2 cases, 4 of 1) and the validation's 4 (2 of 2, 2 of 1), one request a case
    assert server.requests == 12 + 6 and server.peak_in_flight <= 2
    assert scores(served[1]) == scores(local[1]) and served[1]["reward/errors"] == 0
    assert 0.0 < served[1]["critic/score/mean"] < 1.0, "the test needs responses that pass and ones that fail"


def test_verl09_key_and_a_dead_url(tiny, code_task, capsys):
    dead = "http://127.0.0.1:9/run_code"
    with pytest.raises(RewardError, match=r"every sample of the batch.*SandboxFusion server "
                                          r"http://127.0.0.1:9/run_code is unreachable"):
        main(tiny + code_task + [f"reward.sandbox_fusion.url={dead}", "trainer.val_before_train=false"])
