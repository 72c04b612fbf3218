"""Quantization-aware training with the in-process vLLM CPU engine (tests/rollout/conftest.py's session engine): the
engine is sent the NVFP4 fake-quantized weights, so its sampling log-probs are the quantized policy's, not the
unquantized reference's (at vLLM's float32 agreement, as in test_agent_engines.py), before and after an update."""

import pytest
import torch

from rlflow.data import keys as K
from rlflow.data.prompts import collate, load_rows
from rlflow.models.policy import Policy
from rlflow.rollout import VLLMRollout
from tests.rollout.conftest import ENGINE_OPTIONS, requires_vllm


def check_sampled_from_quantized(policy, rollout, device="cpu"):
    rows, _ = load_rows([{"prompt": p, "ground_truth": ""} for p in ("12+34=", "5+6=", "99+99=")])
    out = rollout(collate(rows, policy.tokenizer).to(device))
    mask = out[K.RESPONSE_MASK].bool()
    with torch.no_grad():
        trained, _ = policy.log_probs(out)
        plain, _ = policy.reference().log_probs(out)
    assert (trained - out[K.ROLLOUT_LOG_PROBS])[mask].abs().max().item() < 1e-4
    assert (plain - out[K.ROLLOUT_LOG_PROBS])[mask].abs().max().item() > 1e-2


@requires_vllm
def test_vllm_samples_from_the_quantized_policy(vllm_engine, vllm_model_dir):
    policy = Policy.from_pretrained(vllm_model_dir, qat={})
    rollout = VLLMRollout(n=2, max_new_tokens=8, seed=1, **ENGINE_OPTIONS)
    rollout.bind(policy.model, policy.tokenizer)
    check_sampled_from_quantized(policy, rollout)
    with torch.no_grad():  # an update moves the master weights; weight sync sends their quantized values
        for p in policy.model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
    rollout.sync_weights(policy.model)
    check_sampled_from_quantized(policy, rollout)


@pytest.mark.gpu
@requires_vllm
def test_vllm_on_a_gpu_gets_the_quantized_weights_through_cuda_ipc(vllm_model_dir):
    """On CUDA the quantized weights go through vLLM's IPC weight-transfer engine (tests/rollout/test_vllm_gpu.py's
    settings). Not run yet: no GPU was available when it was written."""
    policy = Policy.from_pretrained(vllm_model_dir, qat={})
    policy.model.cuda()
    rollout = VLLMRollout(n=2, max_new_tokens=8, seed=1, dtype="float32", gpu_memory_utilization=0.3,
                          enforce_eager=True, free_cache_engine=False, max_model_len=64)
    rollout.bind(policy.model, policy.tokenizer)
    assert rollout.engine.weight_transfer == "ipc"
    for _ in range(2):
        check_sampled_from_quantized(policy, rollout, device="cuda")
        with torch.no_grad():
            for p in policy.model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        rollout.sync_weights(policy.model)
