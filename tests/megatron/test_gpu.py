"""The Megatron strategy's GPU-only paths: the Transformer-Engine layer spec, Megatron's distributed optimizer and its
precision-aware optimizer, and the CPU offload's real moves.

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


def test_precision_aware_optimizer_through_megatron_and_rlflow(tmp_path):
    """verl's bf16 gradients and moments reach megatron-core's OptimizerConfig (Transformer Engine's FusedAdam inside
    the distributed optimizer) and, without it, rlflow's PrecisionAwareAdamW on CUDA; both train close to float32
    (the CPU bound of test_precision_aware_megatron.py: 1e-2 on losses and gradient norms)."""
    pytest.importorskip("transformer_engine", reason="megatron-core's precision-aware optimizer needs transformer_engine")
    result = launch(processes(), tmp_path, ["gpu_precision"])["gpu_precision"]
    assert {d for d in result["te_dtypes"]} == {(torch.bfloat16, torch.bfloat16, torch.bfloat16)}
    for run in ("te", "own"):
        for step in (1, 2):
            for key in ("actor/pg_loss", "actor/grad_norm"):
                expected = pytest.approx(result["default"][step]["metrics"][key], rel=1e-2, abs=1e-4)
                assert result[run][step]["metrics"][key] == expected, (run, step, key)


def test_cpu_offload_of_every_role_equals_the_plain_run_and_frees_cuda_memory(tmp_path):
    """verl's megatron.{param,grad,optimizer}_offload on one GPU: PPO with the policy's parameters, gradients and Adam
    states, the reference's parameters and the critic's parameters and states offloaded gives the run without
    offload (the moves are exact copies), and after training they are in host memory: CUDA memory holds less than the
    plain run by at least the policy's weights and both moments (12 B a parameter)."""
    result = launch(1, tmp_path, ["gpu_offload"])["gpu_offload"]
    offloaded, plain = result["offload"], result["plain"]
    assert_same_run(offloaded["steps"], plain["steps"], steps=(1, 2), atol=1e-6)
    assert offloaded["param_devices"] == ["cpu"] and offloaded["state_devices"] == ["cpu"]
    assert plain["param_devices"] == ["cuda"] and plain["state_devices"] == ["cuda"]
    assert plain["allocated"] - offloaded["allocated"] >= 3 * offloaded["policy_bytes"]
