"""FSDP2 options that need an accelerator: CPU offload (``CPUOffloadPolicy``) with bf16 compute, on one GPU.

Marked ``gpu``: skipped without CUDA (PyTorch's offload policy needs an accelerator device).
"""

import pytest
import torch

from .launch import run_ok
from .worker import build


@pytest.mark.gpu
def test_fsdp2_offload_and_bf16_on_one_gpu_match_fp32_cpu(tmp_path):
    trainer, data, record = build(str(tmp_path / "cpu"), "auto", steps=1, devices=1)
    trainer.fit(data)
    ref = record.steps[1]
    gpu = run_ok(1, tmp_path / "gpu", "fsdp2", 1, "cuda=1", "offload=1", "bf16=1")[1]
    assert gpu["metrics"]["actor/grad_norm"] == pytest.approx(ref["metrics"]["actor/grad_norm"], rel=2e-2)
    for name, w in gpu["weights"].items():
        assert w.dtype == torch.float32
        assert (w.cpu() - ref["weights"][name]).abs().max() <= 2.5e-2, name  # AdamW moves weights by ~lr = 1e-2
