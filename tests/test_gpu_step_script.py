"""benchmarks/gpu_step.py's CPU-runnable parts run on a tiny config (the GPU figures themselves need a GPU)."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_step.py"


def test_gpu_step_runs_on_a_tiny_config(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_step", SCRIPT)
    gpu_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_step)
    out = tmp_path / "gpu_step.json"
    report = gpu_step.main(["--tiny", "--json", str(out)])
    assert json.loads(out.read_text())["shape"] == "tiny"
    step = report["grpo_step"]
    assert step["bf16_generation"], step["generation_lm_head_dtypes"]  # precision="bf16-mixed" samples in bf16
    assert step["generation_tokens_per_s"] > 0 and step["training_tokens_per_s"] > 0
    lp = report["logprobs"]
    assert all("peak_mib" in lp[v] for v in ("naive", "checkpointed", "fused")), lp
