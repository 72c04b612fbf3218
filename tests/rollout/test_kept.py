"""Partial rollouts with the requests kept across weight updates (vLLM's pause_generation(mode="keep"), through
the session's vLLM server): a response that spans an update switches version exactly where the server paused,
and the log-probs after the switch are the new weights' over the old weights' KV cache; no request is lost or
duplicated; engines without it fall back to chunks and say so."""

import json
import logging
import urllib.request

import pytest
import torch

from rlflow import Policy, PromptData
from rlflow.data import keys as K
from rlflow.rollout import FullyAsyncRollout, HFRollout, ServerRollout
from rlflow.rollout.engines.base import SamplingParams, hf_weight_buckets
from rlflow.rollout.engines.server import KEPT_PATH
from rlflow.rollout.single_turn import unpadded
from rlflow.tasks.addition import AdditionTask
from tests.rollout.conftest import MAX_MODEL_LEN, requires_vllm
from tests.rollout.fault_proxy import FaultProxy
from tests.rollout.test_async_rollout import Recorder
from tests.rollout.test_fully_async import make_trainer, perturbed


def kept_log_probs(weights: dict, prompt: list[int], tokens: list[int], versions: list[int]) -> torch.Tensor:
    """log p(token_i) as a kept request computes it: input position j is forwarded (its KV written) by the weights
    that sampled output token ``j - len(prompt) + 1`` (the prompt: by those of token 0), attending to the KV the
    earlier positions got from their own weights; ``weights[v]``: a model of version v."""
    ids = prompt + tokens
    by = [versions[max(0, j - len(prompt) + 1)] for j in range(len(ids) - 1)]
    cache, logits, start = None, [], 0
    with torch.no_grad():
        while start < len(by):
            end = start
            while end < len(by) and by[end] == by[start]:
                end += 1
            out = weights[by[start]](input_ids=torch.tensor([ids[start:end]]), past_key_values=cache, use_cache=True)
            cache, start = out.past_key_values, end
            logits.append(out.logits[0].float())
    picked = torch.log_softmax(torch.cat(logits), -1)[len(prompt) - 1:]
    return picked.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def streamed(url: str, prompt: list[int], max_tokens: int, on_first) -> dict:
    """One streamed request to vLLM's /inference/v1/generate, ``on_first()`` called once its first token has
    arrived (so the request is running); the answer assembled as the non-streamed one."""
    body = {"token_ids": prompt, "stream": True, "cache_salt": "rlflow-v0", "sampling_params": {
        "n": 1, "max_tokens": max_tokens, "ignore_eos": True, "logprobs": 0, "detokenize": False}}
    request = urllib.request.Request(url + KEPT_PATH, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    choice, called = {"index": 0, "token_ids": [], "logprobs": {"content": []}, "finish_reason": None}, False
    with urllib.request.urlopen(request, timeout=120) as answer:
        for line in answer:
            line = line.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            delta = json.loads(line[5:])["choices"][0]
            choice["token_ids"] += delta.get("token_ids") or []
            choice["logprobs"]["content"] += (delta.get("logprobs") or {}).get("content") or []
            choice["weight_versions"] = delta.get("weight_versions") or choice.get("weight_versions")
            choice["finish_reason"] = delta.get("finish_reason") or choice["finish_reason"]
            if not called:
                on_first()
                called = True
    return {"choices": [choice]}


@requires_vllm
def test_a_response_spanning_a_kept_update_switches_version_at_the_pause_with_the_new_weights_log_probs(
        vllm_server, vllm_model_dir):
    """Requests in flight when v1 arrives are frozen (/pause?mode=keep), the weights loaded, and continued: each
    token's version is the one vLLM says sampled it, and its log-prob is that version's over the KV the earlier
    tokens got (v0's before the pause: neither v0 alone nor v1 from scratch gives them). Every request answers
    once, with all its samples."""
    policy = Policy.from_pretrained(vllm_model_dir)
    rollout = ServerRollout(vllm_server, n=2, max_new_tokens=8)
    rollout.bind(policy.model, policy.tokenizer)
    engine, tok = rollout.engine, policy.tokenizer
    assert engine.keep_unavailable() is None
    models = {0: policy.model, 1: perturbed(policy.model, scale=0.05)}
    prompts = [tok.encode(t) for t in ("12+34=", "5+6=", "99+99=")]
    room = MAX_MODEL_LEN - max(len(p) for p in prompts)
    params = SamplingParams(n=2, max_new_tokens=room, ignore_eos=True)
    for attempt in range(3):  # the stream is paused after its first token; if it ran to the end first, again
        engine.load_weights(hf_weight_buckets(models[0]))
        engine.label_version(0)
        kept = [engine.submit_kept(p, params, version=0)[1] for p in prompts]
        answer = streamed(vllm_server, prompts[0], room,
                          on_first=lambda: engine.update_kept(hf_weight_buckets(models[1]), version=1))
        results = [engine.kept_completions(f.result()) for f in kept]  # all answered before another attempt
        (spanning,) = engine.kept_completions(answer)
        if spanning.extras["token_versions"][-1] == 1:
            break
    versions = spanning.extras["token_versions"]
    assert 1 in versions, f"the streamed request ran to its end before each of 3 pauses: {versions}"
    switch = versions.index(1)
    assert 0 < switch < room and versions == [0] * switch + [1] * (room - switch)
    results.append([spanning])
    for prompt, completions in zip(prompts + prompts[:1], results):
        assert len(completions) == (2 if completions is not results[-1] else 1)  # no sample lost or duplicated
        for c in completions:
            assert len(c.token_ids) == len(c.log_probs) == len(c.extras["token_versions"]) <= room  # a stop token
            expected = kept_log_probs(models, prompt, c.token_ids, c.extras["token_versions"])
            assert (expected - torch.tensor(c.log_probs)).abs().max() < 1e-4
    recorded, after = torch.tensor(spanning.log_probs), slice(switch + 1, None)
    for other in ([0] * room, [1] * room):  # v0 throughout, or v1 recomputing the prefix: the check can fail
        wrong = kept_log_probs(models, prompts[0], spanning.token_ids, other)
        assert (wrong[after] - recorded[after]).abs().max() > 1e-3


class Pauser:
    """Freezes the server's requests (/pause?mode=keep) as soon as a batch is taken: the groups admitted for the
    next batch then wait, mid-generation or before it, for the weights of the step being trained, which
    FullyAsyncRollout loads with them kept (and resumes)."""

    def on_rollout_end(self, trainer, batch):
        self.engine = trainer.rollout.engine
        self.engine.request("/pause?mode=keep&clear_cache=false", {})


class ServerPauser:
    """:class:`Pauser` for a fleet in front of one server: it pauses that server itself."""

    def __init__(self, url: str):
        self.url = url

    def post(self, path: str) -> None:
        urllib.request.urlopen(urllib.request.Request(self.url + path, data=b"{}", method="POST"), timeout=60).read()

    def on_rollout_end(self, trainer, batch):
        if trainer.rollout.partial_path == "keep":  # by chunks nothing would resume it
            self.post("/pause?mode=keep&clear_cache=false")


@requires_vllm
def test_a_fully_async_run_through_a_server_keeps_its_requests_and_trains_every_prompt_once(
        vllm_server, vllm_model_dir, tmp_path, caplog):
    """FullyAsyncRollout over a vLLM server takes the kept path, says so at bind, and trains: every token's
    recorded log-prob is that of the weights of the version it is labelled with (over the KV its request kept),
    versions never newer than the trainer's, and no prompt is trained twice."""
    policy = Policy.from_pretrained(vllm_model_dir)
    recorder, pauser = Recorder(), Pauser()
    rollout = FullyAsyncRollout(ServerRollout(vllm_server, n=2, max_new_tokens=48), max_off_policy_threshold=3,
                                max_off_policy_strategy="wait")
    with caplog.at_level(logging.INFO, logger="rlflow.rollout.fully_async"):
        trainer = make_trainer(policy.model, policy.tokenizer, tmp_path, rollout, steps=3, callbacks=[recorder, pauser])
        try:
            history = trainer.fit(PromptData(AdditionTask().splits()[0][:24], seed=0))
        finally:
            rollout.close()
            pauser.engine.request("/resume", {})  # the session's server samples for the next tests
    assert rollout.partial_path == "keep" and "keep the requests in flight" in caplog.text
    assert len(history) == 3 and all("training/off_policy/trajectory_spans/max" in m for m in history)
    check_kept_batches(policy, recorder)


def check_kept_batches(policy, recorder) -> list:
    """Every token's recorded log-prob is that of its version's weights over the KV its request kept, versions
    are never newer than the step's, and no prompt is trained twice; the rows' versions."""
    models, rows = {}, []
    for v, state in enumerate(recorder.weights):
        models[v] = perturbed(policy.model, scale=0.0)
        models[v].load_state_dict(state)
    seen = []
    for step, batch in enumerate(recorder.batches):
        mask, versions = batch[K.RESPONSE_MASK].bool(), batch[K.TOKEN_POLICY_VERSION]
        assert versions[mask].max() <= step and (versions[~mask] == -1).all()
        prompts = unpadded(batch[K.PROMPT_IDS].cpu(), batch[K.PROMPT_MASK].cpu())
        for row, prompt in enumerate(prompts):
            n = int(mask[row].sum())
            tokens = batch[K.RESPONSE_IDS][row, :n].tolist()
            expected = kept_log_probs(models, list(prompt), tokens, versions[row, :n].tolist())
            assert (expected - batch[K.ROLLOUT_LOG_PROBS][row, :n].float()).abs().max() < 1e-4
            rows.append(versions[row, :n].tolist())
        seen += [tuple(p) for p in prompts[::2]]  # rows are a prompt's 2 samples side by side
    assert len(seen) == len(set(seen)) == 12
    return rows


@requires_vllm
def test_a_fully_async_run_over_a_fleet_pauses_every_member_and_continues_their_requests(
        vllm_server, vllm_model_dir, tmp_path):
    """Two fleet members (fault proxies in front of the session's server): the run takes the kept path; each
    update lands with kept requests held by both members, pauses both (/pause?mode=keep) before any reload,
    labels and resumes both after; responses continue across an update (one request, two versions), and every
    token's log-prob is its version's."""
    policy = Policy.from_pretrained(vllm_model_dir)
    log = []
    kinds = {"/pause?mode=keep&clear_cache=false": "pause", "/collective_rpc": "reload",
             "/update_weight_version": "label", "/resume": "resume", "/v1/completions": "chunk"}

    def recorder_of(member):
        def record(path, body, seen):
            if path in kinds:
                engine = getattr(rollout, "engine", None)
                held = sorted(set(engine.kept_by.values())) if engine is not None else []
                log.append((kinds[path], member, held))
            return None
        return record

    proxies = [FaultProxy(vllm_server, recorder_of(m)) for m in range(2)]
    recorder, pauser = Recorder(), ServerPauser(vllm_server)
    rollout = FullyAsyncRollout(ServerRollout([p.url for p in proxies], n=2, max_new_tokens=48),
                                max_off_policy_threshold=3, max_off_policy_strategy="wait")
    trainer = make_trainer(policy.model, policy.tokenizer, tmp_path, rollout, steps=3, callbacks=[recorder, pauser])
    try:
        trainer.fit(PromptData(AdditionTask().splits()[0][:24], seed=0))
    finally:
        rollout.close()
        pauser.post("/resume")  # the session's server samples for the next tests
        for proxy in proxies:
            proxy.close()
    assert rollout.partial_path == "keep" and not [entry for entry in log if entry[0] == "chunk"]
    starts = [k for k, entry in enumerate(log) if entry[0] == "pause" and (k == 0 or log[k - 1][0] != "pause")]
    assert len(starts) >= 2  # the updates after steps 1 and 2 (and one after step 3, which the run may not read)
    for k in starts:
        update = log[k:k + 8]
        assert [kind for kind, _, _ in update] == ["pause"] * 2 + ["reload"] * 2 + ["label"] * 2 + ["resume"] * 2
        assert all({m for _, m, _ in update[j:j + 2]} == {0, 1} for j in range(0, 8, 2))
    assert any(held == [0, 1] for kind, _, held in log if kind == "pause")  # both held requests at an update
    rows = check_kept_batches(policy, recorder)
    assert any(len(set(versions)) > 1 for versions in rows)  # a request continued under the new weights


def test_an_engine_without_kept_requests_falls_back_to_chunks_and_says_so(model, tokenizer, caplog):
    """The transformers engine (in a child process) cannot keep requests: 'auto' takes chunks, saying so;
    'keep' is refused at bind, naming pause_mode, before any process starts."""
    with pytest.raises(ValueError, match="pause_mode='keep'.*child process"):
        FullyAsyncRollout(HFRollout(n=2, max_new_tokens=4), pause_mode="keep").bind(model, tokenizer)
    rollout = FullyAsyncRollout(HFRollout(n=2, max_new_tokens=4))
    with caplog.at_level(logging.INFO, logger="rlflow.rollout.fully_async"):
        rollout.bind(model, tokenizer)
    try:
        assert rollout.partial_path == "chunks" and "by chunks of 32 tokens" in caplog.text
    finally:
        rollout.close()


@requires_vllm
def test_a_server_without_the_generate_endpoint_falls_back_to_chunks_and_says_why(vllm_server, vllm_model_dir, caplog):
    """A vLLM server started without --enable-scale-out answers /inference/v1/generate with 403 (a proxy answers
    so in front of the session's server): 'auto' takes chunks, naming the flag; 'keep' is refused, naming it."""
    proxy = FaultProxy(vllm_server, lambda path, body, seen: 403 if path == KEPT_PATH else None)
    policy = Policy.from_pretrained(vllm_model_dir)
    try:
        rollout = FullyAsyncRollout(ServerRollout(proxy.url, n=2, max_new_tokens=4))
        with caplog.at_level(logging.INFO, logger="rlflow.rollout.fully_async"):
            rollout.bind(policy.model, policy.tokenizer)
        assert rollout.partial_path == "chunks" and "--enable-scale-out" in caplog.text
        rollout.close()
        refused = FullyAsyncRollout(ServerRollout(proxy.url, n=2, max_new_tokens=4), pause_mode="keep")
        with pytest.raises(ValueError, match="pause_mode='keep'.*--enable-scale-out"):
            refused.bind(policy.model, policy.tokenizer)
    finally:
        proxy.close()
