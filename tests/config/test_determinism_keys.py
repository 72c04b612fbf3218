"""verl's full_determinism keys: the run gets deterministic kernels, verl's environment and seeds, and gives
bitwise-equal metrics twice; the process is as before afterwards."""

import json
import os

import pytest
import torch

import rlflow.config.verl.devices as devices
from rlflow.config import load_config, make_plan
from rlflow.config.verl.determinism import KEYS
from rlflow.trainer.main_ppo import main

# A checkpoint callback (verl's trainer.checkpoint_callback_class) that records what the run saw at each save.
RECORD = '''
import json, os, torch

class Seen:
    def __init__(self, config=None):
        self.path = os.path.join(config.trainer.default_local_dir, "seen.jsonl")

    def on_save(self, trainer, global_step, checkpoint_dir, async_save=False, **kwargs):
        with open(self.path, "a") as f:
            f.write(json.dumps([torch.are_deterministic_algorithms_enabled(),
                                os.environ.get("CUBLAS_WORKSPACE_CONFIG"), os.environ.get("PYTHONHASHSEED")]) + "\\n")
'''


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


@pytest.mark.parametrize("key", KEYS)
def test_each_key_turns_the_run_deterministic(tiny, key):
    p = make_plan(load_config(tiny + [f"{key}=true", "data.seed=7"]))
    assert p.determinism == {"seed": 7, "batch_invariant": False}
    assert "deterministic kernels for the whole run" in "\n".join(p.notes)
    assert make_plan(load_config(tiny)).determinism is None


def test_vllm_batch_invariance_is_a_gpu_setting(tiny):
    server = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.server.url=http://127.0.0.1:1"]
    p = make_plan(load_config(tiny + [f"{KEYS[-1]}=true", *server]))  # a server: no vLLM installed needed here
    assert p.determinism["batch_invariant"] is False
    assert "VLLM_BATCH_INVARIANT is not set on trainer.device=cpu" in "\n".join(p.notes)


def test_two_deterministic_runs_give_bitwise_equal_metrics(tiny, tmp_path, monkeypatch):
    (tmp_path / "seen_cb.py").write_text(RECORD)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    runs = []
    for i in range(2):
        run = tmp_path / f"run{i}"
        assert main(tiny + ["actor_rollout_ref.actor.fsdp_config.full_determinism=true", "trainer.save_freq=1",
                            "trainer.checkpoint_callback_class=seen_cb.Seen", f"trainer.default_local_dir={run}",
                            "trainer.val_before_train=false", "trainer.logger=[jsonl]", "data.seed=3"]) == 0
        rows = [json.loads(line) for line in next(run.rglob("metrics.jsonl")).read_text().splitlines()]
        runs.append([{k: v for k, v in r.items() if not k.startswith(("timing", "perf"))} for r in rows])
        assert (run / "seen.jsonl").read_text().splitlines() == ['[true, ":16:8", "3"]'] * 2  # at both saves
    assert runs[0] == runs[1] and len(runs[0]) == 2 and len(runs[0][0]) > 20  # every metric, bit for bit
    assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
