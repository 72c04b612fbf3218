"""benchmarks/gpu_step.py's CPU-runnable parts run on a tiny config (the GPU figures themselves need a GPU)."""

import importlib.util
import json
from pathlib import Path

import pytest

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


@pytest.mark.gpu
def test_gpu_step_on_cuda_generates_in_bf16(tmp_path):
    """On CUDA the tiny config runs the GPU code path (bf16-mixed Trainer, CUDA memory figures). Not run here (no GPU)."""
    spec = importlib.util.spec_from_file_location("gpu_step", SCRIPT)
    gpu_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_step)
    report = gpu_step.main(["--tiny", "--compile", "--json", str(tmp_path / "gpu_step.json")])
    step = report["grpo_step"]
    assert report["device"] != "cpu" and step["peak_memory_gib"] > 0
    assert step["bf16_generation"], step["generation_lm_head_dtypes"]
    assert set(report["generation_compile"]) == {"dynamic cache", "static cache + compile"}
