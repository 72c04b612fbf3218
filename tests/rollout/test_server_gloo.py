"""The rlflow_gloo weight-transfer backend against the session's real vLLM server on 127.0.0.1: the trainer and
the server's worker join a gloo group, each bucket is broadcast beside its ``/update_weights`` call. The
server was started for rlflow_shm; the same worker engine takes gloo (no second server start)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlflow import Policy
from rlflow.rollout import ServerRollout
from rlflow.rollout.engines.weight_transfer_gloo import GLOO
from tests.rollout.conftest import requires_vllm
from tests.rollout.test_vllm import largest_difference, prompts

ROOT = Path(__file__).resolve().parents[2]


def synced_updates(policy, rollout, sync, times=2):
    """Perturb the policy ``times`` times: each time the rollout's log-probs must be stale before ``sync()`` and the
    policy's after it; yields what ``sync()`` returned (the update's metrics)."""
    probe = prompts(policy.tokenizer)
    for _ in range(times):
        with torch.no_grad():
            for p in policy.model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        assert largest_difference(policy(rollout(probe))) > 1e-2  # stale: the test can tell
        result = sync()
        assert largest_difference(policy(rollout(probe))) < 1e-4
        yield result


@requires_vllm
def test_weights_by_gloo_broadcast_and_the_servers_log_probs_follow(vllm_server, vllm_model_dir, tmp_path, capsys):
    policy = Policy.from_pretrained(vllm_model_dir)
    rollout = ServerRollout(vllm_server, n=2, max_new_tokens=4, weight_transfer=GLOO,
                            checkpoint_dir=tmp_path / "weights", bucket_bytes=2**18)  # several buckets
    try:
        rollout.bind(policy.model, policy.tokenizer)
        nbytes = sum(p.numel() * p.element_size() for p in policy.model.parameters())
        for metrics in synced_updates(policy, rollout, lambda: rollout.sync_weights(policy.model)):
            assert metrics["weight_sync/gb"] == pytest.approx(nbytes / 1e9) and metrics["weight_sync/buckets"] > 1
        assert rollout.engine.sender.backend == GLOO and rollout.engine.sender.rounds == 3  # bind + 2
        assert rollout.engine.request("/weight_info", method="GET") == {"weight_version": "3"}
        assert not (tmp_path / "weights").exists()  # nothing through the disk
        said = capsys.readouterr().out
        assert f"weights to the server at {vllm_server}: vLLM's weight-transfer protocol, backend rlflow_gloo" in said
    finally:
        rollout.close()


AUTO = """
import sys, torch
from rlflow import Policy
from rlflow.rollout import ServerRollout
from tests.rollout.test_vllm import largest_difference, prompts
url, model = sys.argv[1:]
policy = Policy.from_pretrained(model)
rollout = ServerRollout(url, n=2, max_new_tokens=4)  # weight_transfer="auto"
rollout.bind(policy.model, policy.tokenizer)
with torch.no_grad():
    for p in policy.model.parameters():
        p.add_(torch.randn_like(p) * 0.05)
rollout.sync_weights(policy.model)
print("backend", rollout.engine.sender.backend, "difference", largest_difference(policy(rollout(prompts(policy.tokenizer)))))
"""


@requires_vllm
def test_auto_moves_to_gloo_for_a_server_that_cannot_see_the_trainers_shared_memory(vllm_server, vllm_model_dir):
    """The trainer in a mount namespace of its own with a private /dev/shm: to the server it is another
    machine (its probe file is out of sight), so ``auto`` moves from rlflow_shm to rlflow_gloo."""
    private = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$0" "$@"']
    if not shutil.which("unshare") or subprocess.run([*private, "true"], capture_output=True).returncode != 0:
        pytest.skip("no private mount namespace here (unshare --mount needs CAP_SYS_ADMIN)")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([*private, sys.executable, "-c", AUTO, vllm_server, str(vllm_model_dir)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    backend, difference = re.search(r"backend (\S+) difference (\S+)", done.stdout).groups()
    assert backend == GLOO and float(difference) < 1e-4, done.stdout[-2000:]
