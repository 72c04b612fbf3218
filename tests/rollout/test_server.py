"""ServerRollout against a real vLLM OpenAI server on 127.0.0.1 (started once per session, in the background)."""

import json

import pytest
import torch

from rlflow import FunctionReward, Policy, PPOLoss, PromptData, Trainer, Batching, Loop, Optim, RunDir
from rlflow.algorithms import GRPO
from rlflow.config import load_config, make_plan
from rlflow.config.verl.loading import ConfigError
from rlflow.data import keys as K
from rlflow.rollout import ServerRollout
from rlflow.rollout.engines import SamplingParams
from rlflow.rollout.engines.server import ServerEngine, ServerError
from rlflow.tasks.addition import AdditionTask, exact_match
from tests.rollout.conftest import free_port, requires_vllm
from tests.rollout.fault_proxy import FaultProxy
from tests.rollout.test_vllm import largest_difference, prompts


@requires_vllm
def test_trains_through_the_server_and_its_log_probs_follow_each_update(vllm_server, vllm_model_dir, tmp_path):
    """GRPO steps sampled by the server; every update goes through vLLM's weight-transfer endpoints (the
    rlflow_shm backend: buckets in shared memory, nothing on disk) + /reset_prefix_cache, after which its
    log-probs equal the policy's; the server's own weight version counts the rounds."""
    policy = Policy.from_pretrained(vllm_model_dir)
    rollout = ServerRollout(vllm_server, n=4, max_new_tokens=4, checkpoint_dir=tmp_path / "weights")
    train, _, _ = AdditionTask().splits()
    trainer = Trainer(
        policy=policy, rollout=rollout, reward=FunctionReward(exact_match), estimator=GRPO(), loss=PPOLoss(),
        optim=Optim(lr=3e-2), batching=Batching(batch_size=4), loop=Loop(max_steps=2, progress=False),
        run=RunDir(path=tmp_path, loggers=()),
    )
    history = trainer.fit(PromptData(train[:16], seed=0))
    nbytes = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    for metrics in history:
        assert metrics["weight_sync/gb"] == pytest.approx(nbytes / 1e9) and metrics["timing_s/update_weights"] > 0
    probe = prompts(policy.tokenizer)
    assert largest_difference(policy(rollout(probe))) < 1e-4
    with torch.no_grad():  # one more update, not yet sent: the server is stale, and the test can tell
        for p in policy.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    assert largest_difference(policy(rollout(probe))) > 1e-2
    rollout.sync_weights(policy.model)
    assert largest_difference(policy(rollout(probe))) < 1e-4
    sender = rollout.engine.sender
    assert sender.backend == "rlflow_shm" and sender.rounds == 4  # bind + 2 steps + this one
    assert rollout.engine.request("/weight_info", method="GET") == {"weight_version": "4"}
    assert not (tmp_path / "weights").exists()


@requires_vllm
def test_without_the_protocol_weights_go_through_the_disk_said_once(vllm_server, vllm_model_dir, tmp_path, caplog):
    """A server without the weight-transfer endpoints (404, as an older vLLM's): one warning, then every update
    is written to disk and reloaded (/collective_rpc reload_weights), log-probs equal after each. A refused
    init (a probe the worker cannot read: another machine's shared memory) is a 500 the server survives."""
    import logging

    from rlflow.rollout.engines.weight_transfer import HTTPClient

    caplog.set_level(logging.INFO, logger="rlflow.rollout.weight_transfer")
    engine = ServerEngine(vllm_server)
    with pytest.raises(ServerError, match="HTTP 500"):
        HTTPClient(lambda path, body: engine.request(path, body, retries=0)).init_weight_transfer_engine(
            {"probe": str(tmp_path / "elsewhere"), "token": "x"})
    proxy = FaultProxy(vllm_server, lambda path, body, seen: 404 if path == "/init_weight_transfer_engine" else None)
    policy = Policy.from_pretrained(vllm_model_dir)
    try:
        rollout = ServerRollout(proxy.url, n=2, max_new_tokens=4, checkpoint_dir=tmp_path / "weights")
        rollout.bind(policy.model, policy.tokenizer)
        probe = prompts(policy.tokenizer)
        for _ in range(2):
            with torch.no_grad():
                for p in policy.model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            assert largest_difference(policy(rollout(probe))) > 1e-2
            metrics = rollout.sync_weights(policy.model)
            assert largest_difference(policy(rollout(probe))) < 1e-4 and "weight_sync/write_s" in metrics
    finally:
        proxy.close()
    assert rollout.engine.sender is False and any((tmp_path / "weights").glob("*.safetensors"))
    lines = [r.getMessage() for r in caplog.records if "weight-transfer protocol" in r.getMessage()]
    assert len(lines) == 2 and "HTTP 404" in lines[1] and "reload from a checkpoint folder" in lines[1], lines


@requires_vllm
def test_retries_neither_lose_nor_duplicate_samples(vllm_server, vllm_model_dir):
    """Through a proxy that answers 503 to every first attempt and lets every second attempt of the first
    prompt's request time out after the server did the work: the same samples, in the same order, as asking
    the server directly (seeded requests are reproducible)."""
    tok = Policy.from_pretrained(vllm_model_dir).tokenizer
    ids = [tok(t)["input_ids"] for t in ("12+34=", "5+6=", "99+99=", "7+70=")]
    params = SamplingParams(n=3, max_new_tokens=5, seed=11)
    direct = ServerEngine(vllm_server, eos_token_ids=(tok.eos_token_id,)).generate(ids, params)

    first_prompt = json.dumps(ids[0]).replace(" ", "")

    def faults(path, body, seen):
        if path != "/v1/completions":
            return None
        if seen == 0:
            return 503
        return ("slow", 3.0) if seen == 1 and first_prompt in body.decode().replace(" ", "") else None

    proxy = FaultProxy(vllm_server, faults)
    try:
        engine = ServerEngine(proxy.url, eos_token_ids=(tok.eos_token_id,), timeout=1.5, backoff=0.05, retries=3)
        proxied = engine.generate(ids, params)
    finally:
        proxy.close()
    assert [[c.token_ids for c in per] for per in proxied] == [[c.token_ids for c in per] for per in direct]
    assert [[c.log_probs for c in per] for per in proxied] == [[c.log_probs for c in per] for per in direct]
    assert proxy.injected == 5 and engine.stats["server/retries"] == 5


def test_an_unreachable_server_is_named():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(ServerError, match=f"cannot reach the server at {url}"):
        ServerEngine(url, retries=1, backoff=0.01).bind(None, None)  # built without contacting it; bind asks


@requires_vllm
def test_a_single_server_that_dies_mid_run_is_named_and_said_dead(vllm_server, vllm_model_dir):
    """The only server, after it served, drops every request unanswered (a server that died with them): the
    error names its URL and says it died or hung, what to check, and that a fleet survives it."""
    tok = Policy.from_pretrained(vllm_model_dir).tokenizer
    ids, params = [tok("12+34=")["input_ids"]], SamplingParams(n=1, max_new_tokens=3)
    dead = []
    proxy = FaultProxy(vllm_server, lambda path, body, seen: "drop" if dead else None)
    try:
        engine = ServerEngine(proxy.url, eos_token_ids=(tok.eos_token_id,), retries=2, backoff=0.01)
        assert len(engine.generate(ids, params)[0]) == 1
        dead.append(True)
        with pytest.raises(ServerError) as e:
            engine.generate(ids, params)
    finally:
        proxy.close()
    message = str(e.value)
    assert message.startswith(f"cannot reach the server at {proxy.url} (POST /v1/completions") and "3 attempts" in message
    assert "it answered earlier in this run, so it died or hung" in message and "log" in message and "memory" in message
    assert "list of URLs" in message and "is the URL right" not in message


@requires_vllm
def test_a_server_without_weight_updates_is_refused_at_bind(vllm_server, vllm_model_dir):
    refused = ("/collective_rpc", "/init_weight_transfer_engine")  # neither weight path
    proxy = FaultProxy(vllm_server, lambda path, body, seen: 404 if path in refused else None)
    policy = Policy.from_pretrained(vllm_model_dir)
    try:
        with pytest.raises(ServerError, match="no weight-update endpoint.*VLLM_SERVER_DEV_MODE=1"):
            ServerRollout(proxy.url, n=2, max_new_tokens=3).bind(policy.model, policy.tokenizer)
    finally:
        proxy.close()


def test_server_keys_choose_the_server_rollout():
    cpu = ["trainer.device=cpu", "trainer.n_gpus_per_node=1"]
    with pytest.raises(ConfigError, match=r"rollout.name=sglang: .*set actor_rollout_ref.rollout.server.url"):
        make_plan(load_config(cpu + ["actor_rollout_ref.rollout.name=sglang"]))
    url = "actor_rollout_ref.rollout.server.url=http://127.0.0.1:30000"
    plan = make_plan(load_config(cpu + ["actor_rollout_ref.rollout.name=sglang", url,
                                        "actor_rollout_ref.rollout.server.retries=5"]))
    assert plan.rollout_cls.__name__ == "SGLangRollout"
    assert plan.rollout_kwargs["url"] == "http://127.0.0.1:30000" and plan.rollout_kwargs["retries"] == 5
    plan = make_plan(load_config(cpu + ["actor_rollout_ref.rollout.name=vllm", url, "actor_rollout_ref.rollout.dtype=float32"]))
    assert plan.rollout_cls is ServerRollout
    assert any("rollout.dtype='float32': a setting of the server" in note for note in plan.notes)
    with pytest.raises(ConfigError, match="has no server rollout"):
        make_plan(load_config(cpu + ["actor_rollout_ref.rollout.name=hf", url]))


@requires_vllm
def test_prompts_keep_their_order_and_fields(vllm_server, vllm_model_dir):
    policy = Policy.from_pretrained(vllm_model_dir)
    rollout = ServerRollout(vllm_server, n=2, max_new_tokens=4, max_concurrency=2)
    rollout.bind(policy.model, policy.tokenizer)
    batch = rollout(prompts(policy.tokenizer))
    assert batch[K.GROUP].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert list(batch[K.GROUND_TRUTH]) == ["0", "0", "1", "1", "2", "2", "3", "3"]
    mask = batch[K.RESPONSE_MASK]
    assert torch.all(batch[K.RESPONSE_IDS][mask == 0] == policy.tokenizer.pad_token_id)
