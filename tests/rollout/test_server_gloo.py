"""The rlflow_gloo weight-transfer backend against the session's real vLLM server on 127.0.0.1: the trainer and
the server's worker join a gloo group, each bucket is broadcast beside its ``/update_weights`` call. The
server was started for rlflow_shm; the same worker engine takes gloo (no second server start)."""

import pytest
import torch

from rlflow import Policy
from rlflow.rollout import ServerRollout
from rlflow.rollout.engines.weight_transfer_gloo import GLOO
from tests.rollout.conftest import requires_vllm
from tests.rollout.test_vllm import largest_difference, prompts


@requires_vllm
def test_weights_by_gloo_broadcast_and_the_servers_log_probs_follow(vllm_server, vllm_model_dir, tmp_path, capsys):
    policy = Policy.from_pretrained(vllm_model_dir)
    rollout = ServerRollout(vllm_server, n=2, max_new_tokens=4, weight_transfer=GLOO,
                            checkpoint_dir=tmp_path / "weights", bucket_bytes=2**18)  # several buckets
    try:
        rollout.bind(policy.model, policy.tokenizer)
        probe = prompts(policy.tokenizer)
        nbytes = sum(p.numel() * p.element_size() for p in policy.model.parameters())
        for _ in range(2):
            with torch.no_grad():
                for p in policy.model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            assert largest_difference(policy(rollout(probe))) > 1e-2  # stale: the test can tell
            metrics = rollout.sync_weights(policy.model)
            assert largest_difference(policy(rollout(probe))) < 1e-4
            assert metrics["weight_sync/gb"] == pytest.approx(nbytes / 1e9) and metrics["weight_sync/buckets"] > 1
        assert rollout.engine.sender.backend == GLOO and rollout.engine.sender.rounds == 3  # bind + 2
        assert rollout.engine.request("/weight_info", method="GET") == {"weight_version": "3"}
        assert not (tmp_path / "weights").exists()  # nothing through the disk
        said = capsys.readouterr().out
        assert f"weights to the server at {vllm_server}: vLLM's weight-transfer protocol, backend rlflow_gloo" in said
    finally:
        rollout.close()
