"""vLLM on a GPU: the engine sleeps while the trainer works and wakes for weights and generation; weights
arrive through vLLM's CUDA IPC weight-transfer engine.

Needs CUDA and the CUDA build of vLLM (``pip install -e ".[vllm]"``); skipped elsewhere. Not run yet: no GPU
was available when it was written.
"""

import pytest
import torch

from rlflow import Policy
from rlflow.data import keys as K
from tests.rollout.conftest import requires_vllm
from tests.rollout.test_vllm import largest_difference, prompts


@pytest.mark.gpu
@requires_vllm
def test_free_cache_engine_sleeps_between_generations(vllm_model_dir):
    from rlflow.rollout import VLLMRollout

    policy = Policy.from_pretrained(vllm_model_dir)
    policy.model.cuda()
    rollout = VLLMRollout(n=2, max_new_tokens=4, dtype="float32", gpu_memory_utilization=0.3, enforce_eager=True,
                          free_cache_engine=True, max_model_len=64)
    rollout.bind(policy.model, policy.tokenizer)
    batch = prompts(policy.tokenizer).to("cuda")
    free_awake = torch.cuda.mem_get_info()[0]
    out = policy(rollout(batch))
    assert rollout.engine.asleep  # freed after generating: the trainer has the memory
    free_asleep = torch.cuda.mem_get_info()[0]
    assert free_asleep > free_awake + 100 * 2**20, (free_awake, free_asleep)
    assert largest_difference(out) < 1e-4
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    rollout.sync_weights(policy.model)  # wakes to load
    assert not rollout.engine.asleep
    out = policy(rollout(batch))
    assert largest_difference(out) < 1e-4 and out[K.RESPONSE_IDS].is_cuda


@pytest.mark.gpu
@requires_vllm
def test_weights_go_through_vllms_cuda_ipc_engine(vllm_model_dir):
    """On CUDA, weight_transfer="auto" picks vLLM's own IPC weight-transfer engine for the in-process engine
    (driven by vLLM's trainer-side IPC engine); after every update the log-probs equal the policy's."""
    from rlflow.rollout import VLLMRollout

    policy = Policy.from_pretrained(vllm_model_dir)
    policy.model.cuda()
    rollout = VLLMRollout(n=2, max_new_tokens=4, dtype="float32", gpu_memory_utilization=0.3, enforce_eager=True,
                          free_cache_engine=False, max_model_len=64)
    rollout.bind(policy.model, policy.tokenizer)
    assert rollout.engine.weight_transfer == "ipc" and rollout.engine.sender.backend == "ipc"
    batch = prompts(policy.tokenizer).to("cuda")
    for _ in range(2):
        with torch.no_grad():
            for p in policy.model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        assert largest_difference(policy(rollout(batch))) > 1e-2  # not yet sent: stale
        metrics = rollout.sync_weights(policy.model)
        assert metrics["weight_sync/gb"] > 0
        assert largest_difference(policy(rollout(batch))) < 1e-4
