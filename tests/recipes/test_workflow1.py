"""recipes/workflow1 (docs/workflow1.md): the seed's Workflow 1 on SmolLM2-135M-Instruct, checked in seconds.

The learning run itself (10 steps, minutes) is not run here; its figures are on the page. These tests check
what it is made of: the data script writes the seed's layout, the reward file is the seed's function and
scores the seed's form, and the page's HF command trains 2 steps end to end at small sizes, synchronously and
fully asynchronously (the command scripts/async_learning_workflow1.py compares them with; figures in docs/async.md).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest

import rlflow.config.verl.devices as devices
from rlflow import FunctionReward
from rlflow.config.verl.reward_fn import load_function
from tests.config.test_main_ppo import SEED_REWARD, steps

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "workflow1"
PAGE = ROOT / "docs" / "workflow1.md"
SESSION_CACHE = os.environ.get("RLFLOW_CACHE")  # the environment's cache, before any test's monkeypatch


def page_commands() -> list[str]:
    """The page's bash commands, continuation lines joined (as tests/test_docs.py reads them)."""
    from tests.doc_blocks import commands

    return [c for body in re.findall(r"^```bash\n(.*?)^```", PAGE.read_text(), re.M | re.S) for c in commands(body)]


def training_command(rollout: str) -> str:
    (command,) = [c for c in page_commands() if c.startswith("python3 -m rlflow.trainer.main_ppo")
                  and ("rollout.name=hf" in c) == (rollout == "hf")]
    return command


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    from rlflow.models.gguf import smollm2_folder

    with pytest.MonkeyPatch.context() as mp:
        if SESSION_CACHE:
            mp.setenv("RLFLOW_CACHE", SESSION_CACHE)
        return smollm2_folder(log=print)


def prepare(out: Path, *extra: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    sys.path.insert(0, str(RECIPE))
    try:
        import prepare_data
    finally:
        sys.path.remove(str(RECIPE))
    prepare_data.main(["--out", str(out), *extra])
    return pd.read_parquet(out / "train.parquet"), pd.read_parquet(out / "val.parquet")


def test_data_script_writes_the_seeds_layout(tmp_path):
    train, val = prepare(tmp_path)
    assert (len(train), len(val)) == (73, 25)  # 100 single-digit sums, less 2 + 3 and 3 + 2 (the example)
    row = train.iloc[0]
    roles = [m["role"] for m in row["prompt"]]
    assert roles == ["user", "assistant", "user"]  # one worked example turn, then the question
    assert row["prompt"][1]["content"] == "2 + 3 = \\boxed{5}"
    a, b = map(int, re.fullmatch(r"What is (\d) \+ (\d)\? Put your final answer within \\boxed\{\}\.",
                                 row["prompt"][2]["content"]).groups())
    assert row["reward_model"]["ground_truth"] == str(a + b) and row["data_source"] == "workflow1/addition"

    def pairs(df):
        return {frozenset(map(int, q.split(" + "))) for q in (e["question"] for e in df["extra_info"])}

    assert not pairs(train) & pairs(val) and frozenset({2, 3}) not in pairs(train) | pairs(val)


def test_reward_file_is_the_seeds_function_in_batch_form():
    text = (RECIPE / "reward_function.py").read_text()
    assert " ".join(SEED_REWARD.split()) in " ".join(text.split())  # the seed's code, as written
    fn = load_function(str(RECIPE / "reward_function.py"), "compute_reward")
    assert FunctionReward(fn).form == "batch"
    responses = ["2 + 3 = \\boxed{5}", "\\boxed{ 5 }.", "2 + 3 = 5", "\\boxed{6}", "\\boxed{5"]
    assert fn(responses, ["5"] * 5) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_run_script_runs_the_pages_command():
    script = (RECIPE / "run.sh").read_text()
    for rollout in ("vllm", "hf"):
        for arg in training_command(rollout).split()[3:]:
            if "$" not in arg and not arg.startswith(("data.seed=", "trainer.default_local_dir=")):
                assert arg in script, (rollout, arg)


def hf_keys() -> str:
    return training_command("hf").split(maxsplit=3)[3]


SMALL = ["data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=2",
         "data.max_response_length=8", "trainer.total_training_steps=2", "trainer.test_freq=2",
         "trainer.logger=[console]"]
ACCURACY = "val-core/workflow1/addition/reward/mean@1"


def train_small(keys: str, smollm2_dir: Path, tmp_path: Path, monkeypatch, capsys) -> tuple[str, dict]:
    """``main_ppo`` with ``keys`` (a page command's, after ``-m rlflow.trainer.main_ppo``) at small sizes, run from
    a copy of the repository's files with the page's data (2 held-out pairs: 3 val prompts); returns its output and
    the console's metrics per step."""
    from rlflow.trainer.main_ppo import main

    monkeypatch.setattr(devices, "cuda_count", lambda: 0)
    shutil.copytree(ROOT / "examples" / "config", tmp_path / "examples" / "config")
    shutil.copytree(RECIPE, tmp_path / "recipes" / "workflow1", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.chdir(tmp_path)
    prepare(Path("runs/workflow1/data"), "--val-pairs", "2")  # the page's data command, 2 held-out pairs
    argv = keys.replace("$(rlflow get-model smollm2)", str(smollm2_dir)).split()
    assert main(argv + SMALL) == 0
    out = capsys.readouterr().out
    logged = steps(out)
    assert sorted(logged) == [0, 1, 2] and ACCURACY in logged[0] and ACCURACY in logged[2]
    assert logged[2]["actor/kl_coef"] == 0.001 and logged[2]["prompt_length/mean"] > 80  # the chat template's prompt
    return out, logged


def test_the_pages_hf_command_trains_two_steps(smollm2_dir, tmp_path, monkeypatch, capsys):
    """The page's HF command as written, run from a copy of the repository's files, at small sizes."""
    out, logged = train_small(hf_keys(), smollm2_dir, tmp_path, monkeypatch, capsys)
    assert "FullyAsyncRollout" not in out and not any(k.startswith(("async/", "training/off_policy/"))
                                                        for k in logged[2])


def fully_async_keys() -> list[str]:
    """The keys the page's fully asynchronous command adds to ``ROLLOUT=hf recipes/workflow1/run.sh``."""
    (command,) = [c for c in page_commands() if c.startswith("ROLLOUT=hf recipes/workflow1/run.sh trainer.use_v1")]
    return command.split()[2:]


def test_the_pages_fully_async_command_trains_two_steps_asynchronously(smollm2_dir, tmp_path, monkeypatch, capsys):
    """The page's fully asynchronous command (run.sh's HF command and verl's V1 keys, as
    scripts/async_learning_workflow1.py runs it) at small sizes: the rollout is FullyAsyncRollout with the bound
    of 2 and verl's fully-async correction (bypass mode), and every step logs verl's off-policy metrics within it."""
    keys = fully_async_keys()
    spec = importlib.util.spec_from_file_location("async_learning_workflow1",
                                                  ROOT / "scripts" / "async_learning_workflow1.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert keys == list(script.FULLY_ASYNC)  # the page's figures are the script's runs of this command
    out, logged = train_small(f"{hf_keys()} {' '.join(keys)}", smollm2_dir, tmp_path, monkeypatch, capsys)
    assert "the Trainer gets rollout=FullyAsyncRollout(rollout, max_off_policy_threshold=2, " \
           "max_off_policy_strategy='wait'" in out
    assert "bypass_mode=True" in out
    for step in (1, 2):
        m = logged[step]
        assert m["async/policy_version"] == step - 1  # the trainer's version when it took the batch
        assert 0 <= m["training/off_policy/trajectory_staleness/max"] \
            <= m["training/off_policy/trajectory_staleness_worst/max"] <= 1  # age <= 2: at most 1 update behind
        assert m["training/off_policy/trajectory_spans/min"] >= 1 and m["async/dropped_groups"] == 0
        assert "rollout_corr/rollout_is_mean" not in m  # bypass: PPO's ratio against the sampler, no IS weights
    assert logged[1]["training/off_policy/trajectory_staleness/max"] == 0  # the first batch: the initial weights
