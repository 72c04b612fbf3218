"""ServerRollout over a fleet of real vLLM servers on 127.0.0.1: balancing, failover, stale servers taken out.

The hung-server and missed-update tests put two fault proxies in front of the session's one server (two
fleet members, one real engine); the kill test adds the one extra server start of this file, and kills it
mid-run.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlflow import FunctionReward, Policy, PPOLoss, PromptData, Trainer, Batching, Loop, Optim, RunDir
from rlflow.algorithms import GRPO
from rlflow.rollout import ServerRollout
from rlflow.rollout.engines import SamplingParams
from rlflow.rollout.engines.fleet import FleetEngine
from rlflow.rollout.engines.server import ServerEngine, ServerError
from rlflow.rollout.engines.weight_transfer_gloo import GLOO
from rlflow.tasks.addition import AdditionTask, exact_match
from tests.rollout.conftest import free_port, requires_vllm
from tests.rollout.fault_proxy import FaultProxy
from tests.rollout.test_server_gloo import synced_updates
from tests.rollout.test_vllm import largest_difference, prompts

TEXTS = ("12+34=", "5+6=", "99+99=", "7+70=", "1+1=", "40+2=", "3+33=", "8+80=")


def sampled(results):
    return [[(c.token_ids, c.log_probs) for c in per_prompt] for per_prompt in results]


@requires_vllm
def test_a_hung_server_s_requests_go_to_the_others_once_each_and_in_order(vllm_server, vllm_model_dir):
    """Member 1 hangs (no answer, not even to /health) from its second request on: its requests are sent to
    member 0, and the fleet's samples equal the server's own for the same seeded requests, in prompt order.
    It stays out while it hangs and rejoins once it answers its health check again."""
    tok = Policy.from_pretrained(vllm_model_dir).tokenizer
    ids = [tok(t)["input_ids"] for t in TEXTS]
    params = SamplingParams(n=2, max_new_tokens=4, seed=5)
    eos = (tok.eos_token_id,)
    direct = ServerEngine(vllm_server, eos_token_ids=eos).generate(ids, params)
    state = {"hung": False, "completions": 0}

    def hangs_after_one(path, body, seen):
        if path == "/v1/completions" and not state["hung"]:
            state["completions"] += 1
            state["hung"] = state["completions"] >= 2
        return ("hang", 120.0) if state["hung"] else None

    good, bad = FaultProxy(vllm_server, lambda *a: None), FaultProxy(vllm_server, hangs_after_one)
    members = [ServerEngine(p.url, eos_token_ids=eos, timeout=30, retries=1, backoff=0.05) for p in (good, bad)]
    fleet = FleetEngine(members, max_concurrency=2, health_interval=0.2, health_timeout=3.0)
    try:
        with pytest.warns(UserWarning, match=f"{bad.url} taken out of the fleet: no answer to GET /health"):
            assert sampled(fleet.generate(ids, params)) == sampled(direct)
        stats = fleet.stats
        assert stats["rollout/servers_healthy"] == 1 and stats["rollout/failovers"] >= 1
        assert stats["rollout/server0/requests"] + stats["rollout/server1/requests"] == len(ids) + stats["rollout/failovers"]
        assert stats["rollout/server1/requests"] >= 2  # it took its share until it hung

        assert sampled(fleet.generate(ids, params)) == sampled(direct)  # still hung: not asked at all
        assert fleet.stats["rollout/server1/requests"] == 0 and fleet.stats["rollout/failovers"] == 0

        state["hung"], state["completions"] = False, -100  # it answers again
        assert sampled(fleet.generate(ids, params)) == sampled(direct)
        assert fleet.stats["rollout/servers_healthy"] == 2 and fleet.stats["rollout/server1/requests"] == 4
    finally:
        good.close()
        bad.close()
        fleet.close()


@requires_vllm
def test_a_request_the_servers_refuse_raises_and_takes_no_server_out(vllm_server, vllm_model_dir):
    """A prompt longer than the servers' context is the request's fault (HTTP 400): it raises as with one
    server, instead of taking out every server it is sent to."""
    tok = Policy.from_pretrained(vllm_model_dir).tokenizer
    fleet = FleetEngine([ServerEngine(vllm_server, eos_token_ids=(tok.eos_token_id,)) for _ in range(2)])
    too_long = tok("1+" * 40 + "1=")["input_ids"]  # 82 tokens; the servers' max_model_len is 64
    try:
        with pytest.raises(ServerError, match="HTTP 400"):
            fleet.generate([too_long], SamplingParams(max_new_tokens=4))
        assert fleet.out_reason == ["", ""]
    finally:
        fleet.close()


@requires_vllm
def test_a_server_that_misses_an_update_samples_nothing_until_it_has_it(vllm_server, vllm_model_dir, tmp_path):
    """Member 1 refuses one weight update (503 on reload): it is taken out, stays out while its reload keeps
    failing, and rejoins after reloading the newest weights; the fleet's log-probs follow the policy's."""
    policy = Policy.from_pretrained(vllm_model_dir)
    state = {"refuse": False, "reloads": 0}

    def refuses_reloads(path, body, seen):
        if path != "/collective_rpc":
            return None
        state["reloads"] += 1
        return 503 if state["refuse"] else None

    good, bad = FaultProxy(vllm_server, lambda *a: None), FaultProxy(vllm_server, refuses_reloads)
    rollout = ServerRollout([good.url, bad.url], n=2, max_new_tokens=4, retries=1, backoff=0.05,
                            checkpoint_dir=tmp_path / "weights")
    try:
        rollout.bind(policy.model, policy.tokenizer)
        assert isinstance(rollout.engine, FleetEngine) and state["reloads"] == 1
        probe = prompts(policy.tokenizer)
        assert largest_difference(policy(rollout(probe))) < 1e-4
        assert rollout.stats["rollout/server1/requests"] == 2  # 4 prompts, balanced

        state["refuse"] = True
        with torch.no_grad():
            for p in policy.model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        with pytest.warns(UserWarning, match=f"{bad.url} taken out of the fleet: missed weight update 2"):
            metrics = rollout.sync_weights(policy.model)
        assert metrics["rollout/servers_synced"] == 1
        assert largest_difference(policy(rollout(probe))) < 1e-4
        assert rollout.stats["rollout/server1/requests"] == 0 and rollout.stats["rollout/servers_healthy"] == 1

        state["refuse"] = False
        reloads = state["reloads"]
        assert largest_difference(policy(rollout(probe))) < 1e-4
        assert state["reloads"] > reloads  # reloaded before it was asked again
        assert rollout.stats["rollout/server1/requests"] == 2 and rollout.stats["rollout/servers_healthy"] == 2
    finally:
        rollout.close()
        good.close()
        bad.close()


def written_bytes() -> int:
    """What this process has written to files and sockets so far (``wchar``: gloo's sends are writes)."""
    return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["wchar"])


@requires_vllm
def test_a_fleet_takes_each_bucket_by_one_gloo_broadcast(vllm_server, doomed_vllm_server, vllm_model_dir, tmp_path):
    """Two real servers and the trainer in one gloo group of three ranks: both servers' log-probs follow the
    policy's after each update, and what the trainer process writes per update is one copy of the parameters,
    not one per server. Nothing goes through the disk. (Before the kill test, which ends the second server.)"""
    policy = Policy.from_pretrained(vllm_model_dir)
    rollout = ServerRollout([vllm_server, doomed_vllm_server.url], n=2, max_new_tokens=4, weight_transfer=GLOO,
                            checkpoint_dir=tmp_path / "weights", bucket_bytes=2**18)  # several buckets
    try:
        rollout.bind(policy.model, policy.tokenizer)
        nbytes = sum(p.numel() * p.element_size() for p in policy.model.parameters())

        def sync():
            before = written_bytes()
            metrics = rollout.sync_weights(policy.model)
            return metrics, written_bytes() - before

        for metrics, written in synced_updates(policy, rollout, sync):
            assert nbytes <= written < 1.5 * nbytes, (written, nbytes)  # two servers by two sends: >= 2 * nbytes
            assert metrics["weight_sync/gb"] == pytest.approx(nbytes / 1e9) and metrics["weight_sync/buckets"] > 1
            assert metrics["weight_sync/broadcast_gb"] < 1.01 * nbytes / 1e9
            assert metrics["rollout/servers_synced"] == 2 and metrics["weight_sync/groups_built"] == 1
            assert rollout.stats["rollout/server0/requests"] == rollout.stats["rollout/server1/requests"] == 2
        for member in rollout.engine.servers:  # bind + 2 updates, on each server
            assert member.request("/weight_info", method="GET") == {"weight_version": "3"}
        assert not (tmp_path / "weights").exists()
    finally:
        rollout.close()


@requires_vllm
def test_a_run_survives_a_server_killed_mid_generation(vllm_server, doomed_vllm_server, vllm_model_dir, tmp_path):
    """GRPO through two real servers; the second is killed (SIGKILL) when its third request arrives, in
    step 2 with requests in flight. The run finishes, every step has all its samples, the metrics show the
    failover and the dead server out, and the survivor's log-probs follow the policy's. Weights go by gloo:
    the update after step 2 builds the group again over the survivor alone."""
    policy = Policy.from_pretrained(vllm_model_dir)
    state = {"completions": 0}

    def kill_at_third(path, body, seen):
        if path == "/v1/completions":
            state["completions"] += 1
            if state["completions"] == 3:
                os.killpg(doomed_vllm_server.process.pid, signal.SIGKILL)
                doomed_vllm_server.process.wait()
        # None: forwarded (to a dead server from the third request on)

    # the proxy only sees the requests to count them; the server behind it is really killed
    front = FaultProxy(doomed_vllm_server.url, kill_at_third)
    rollout = ServerRollout([vllm_server, front.url], n=4, max_new_tokens=4, retries=1, backoff=0.05,
                            health_interval=0.2, health_timeout=3.0, weight_transfer=GLOO)
    train, _, _ = AdditionTask().splits()
    trainer = Trainer(
        policy=policy, rollout=rollout, reward=FunctionReward(exact_match), estimator=GRPO(), loss=PPOLoss(),
        optim=Optim(lr=3e-2), batching=Batching(batch_size=4), loop=Loop(max_steps=3, progress=False),
        run=RunDir(path=tmp_path, loggers=()),
    )
    try:
        with pytest.warns(UserWarning, match=f"{front.url} taken out of the fleet"):
            history = trainer.fit(PromptData(train[:16], seed=0))
        assert len(history) == 3 and doomed_vllm_server.process.poll() is not None
        first, killed, after = history
        assert first["rollout/servers_healthy"] == 2 and first["rollout/failovers"] == 0
        assert first["rollout/server1/requests"] == 2
        assert killed["rollout/failovers"] >= 1 and killed["rollout/servers_healthy"] == 1
        assert killed["rollout/servers_synced"] == 1  # the dead server missed the update after step 2
        assert [h["weight_sync/groups_built"] for h in history] == [1, 2, 2]  # bind's group, then the survivor's
        assert after["rollout/server1/requests"] == 0 and after["rollout/server0/requests"] == 4
        assert largest_difference(policy(rollout(prompts(policy.tokenizer)))) < 1e-4
    finally:
        rollout.close()
        front.close()


def test_fleet_urls_and_launch_commands_are_checked():
    with pytest.raises(ValueError, match="2 URLs need launch=None or a list of as many commands"):
        ServerRollout("http://127.0.0.1:1,http://127.0.0.1:2", launch="python -m vllm...")
    assert ServerRollout(["http://a:1", "http://b:2"]).urls == ["http://a:1", "http://b:2"]
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerError, match=f"cannot reach the server at {url}"):
        ServerRollout(f"{url},{url}", retries=0).bind(None, type("T", (), {"eos_token_id": 0})())


def test_server_url_takes_a_list_of_servers():
    from rlflow.config import load_config, make_plan
    from rlflow.config.verl.loading import ConfigError

    base = ["trainer.device=cpu", "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.server.url=[http://127.0.0.1:8000,http://127.0.0.1:8001]"]
    plan = make_plan(load_config(base + ["actor_rollout_ref.rollout.server.launch=[null,'python -m x']"]))
    rollout = plan.rollout_cls(**plan.rollout_kwargs)
    assert rollout.urls == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"] and rollout.launch == [None, "python -m x"]
    with pytest.raises(ConfigError, match=r"server.url lists 2 servers, so actor_rollout_ref.rollout.server.launch "
                                          r"must be a list of 2 commands"):
        make_plan(load_config(base + ["actor_rollout_ref.rollout.server.launch='python -m x'"]))


@requires_vllm
def test_every_process_takes_out_the_server_rank_0_could_not_update(vllm_server, vllm_model_dir, tmp_path):
    """Two gloo processes, one fleet each over the same two servers: only rank 0 asks the servers to reload,
    and the second update fails on member 1. Rank 1 never saw that failure, yet takes member 1 out too and
    sends it nothing."""
    reloads = []

    def refuses_the_second_reload(path, body, seen):
        if path != "/collective_rpc":
            return None
        reloads.append(path)
        return 503 if len(reloads) >= 2 else None

    good, bad = FaultProxy(vllm_server, lambda *a: None), FaultProxy(vllm_server, refuses_the_second_reload)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(Path(__file__).with_name("fleet_worker.py")), str(vllm_model_dir), str(tmp_path), good.url, bad.url]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        run = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=300)
    finally:
        good.close()
        bad.close()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert len(reloads) == 2  # rank 0's two reloads of member 1; rank 1 asked nothing
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["out"][0] == "" and result["out"][1].startswith("missed weight update 2: POST")
        assert result["synced"] == 1 and result["stats"]["rollout/server1/requests"] == 0
        assert result["stats"]["rollout/server0/requests"] == 4
