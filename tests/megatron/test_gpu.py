"""The Megatron strategy's GPU-only paths: the Transformer-Engine layer spec and Megatron's distributed optimizer.

Both need CUDA (``gpu`` marker: skipped without it). Written with the rest of the plugin in a session
without a GPU: they have not run yet. One process per GPU, up to 2 (tensor parallel = that number).
"""

import pytest
import torch

from rlflow.strategies.megatron import megatron_available

from .forked import torchrun_launch as launch  # CUDA cannot be used in a forked child
from .test_megatron import assert_same_run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not megatron_available(),
                                 reason="megatron-core is not installed (pip install -e '.[megatron]')")]


def processes() -> int:
    return min(2, torch.cuda.device_count())


def test_transformer_engine_layer_spec_equals_transformers(tmp_path):
    """Converted with Transformer Engine's fused layers (float32, TF32 off): the logits, log-probs, entropy
    and gradients of transformers' model, for Qwen2, Qwen3 and Llama."""
    pytest.importorskip("transformer_engine", reason="the Transformer-Engine layer spec needs transformer_engine")
    results = launch(processes(), tmp_path, ["gpu_te"])["gpu_te"]
    for kind, r in results.items():
        assert r["logits"] < 1e-4 * max(1.0, r["logits_scale"]), (kind, r["logits"])
        assert r["log_probs"] < 1e-4 and r["entropy"] < 1e-4, (kind, r)
        assert r["grad_names"] and r["grad"] < 1e-4 * r["grad_scale"], (kind, r["grad"], r["grad_scale"])
        assert r["exported_names"] and r["exported"] == 0.0, kind


def test_distributed_optimizer_equals_the_default_optimizer(tmp_path):
    """GRPO steps with Megatron's DDP + distributed optimizer (AdamW's hyperparameters, weight decay on every
    parameter) give the losses, gradient norms and weights of the default optimizer (AdamW per shard)."""
    result = launch(processes(), tmp_path, ["gpu_distopt"])["gpu_distopt"]
    assert_same_run(result["distributed"], result["default"], steps=(1, 2), atol=1e-4)
    # verl's Megatron scripts' override_optimizer_config (states on the CPU, MegatronStrategy(optimizer_overrides=)):
    # the same run, the optimizer step done by megatron-core's HybridDeviceOptimizer on the host
    assert_same_run(result["offloaded"], result["default"], steps=(1, 2), atol=1e-4)
