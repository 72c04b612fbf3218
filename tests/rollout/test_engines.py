"""The engine interface with transformers' generate: the contract every engine and rollout relies on."""

import pytest
import torch

from rlflow.data import keys as K
from rlflow.data.prompts import collate, load_rows
from rlflow.models.policy import Policy
from rlflow.rollout import HFRollout, SingleTurnRollout
from rlflow.rollout.engines import Completion, HFEngine, SamplingParams


def prompts(tokenizer, texts=("12+34=", "5+6=", "99+99=")):
    rows, _ = load_rows([{"prompt": t, "ground_truth": str(i)} for i, t in enumerate(texts)])
    return collate(rows, tokenizer)


def test_sampling_params_reject_bad_values():
    for bad in (dict(n=0), dict(temperature=0.0), dict(top_p=0.0), dict(top_k=0), dict(max_new_tokens=0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert SamplingParams(greedy=True, temperature=0.0).scale_temperature == 1.0
    assert SamplingParams(top_k=5).truncates and not SamplingParams(greedy=True, top_k=5).truncates
    with pytest.raises(ValueError, match="3 tokens but 2 log-probs"):
        Completion([1, 2, 3], [0.0, 0.0], "stop")


def test_hf_engine_completions_end_at_stop_tokens_with_policy_log_probs(model, tokenizer):
    engine = HFEngine(model, tokenizer)
    ids = [tokenizer(t)["input_ids"] for t in ("12+34=", "5+6=")]
    stop = tokenizer.convert_tokens_to_ids("1")
    params = SamplingParams(n=3, temperature=0.7, top_k=9, max_new_tokens=6, stop_token_ids=(stop,))
    torch.manual_seed(0)
    out = engine.generate(ids, params)
    assert [len(per) for per in out] == [3, 3]
    stops = {tokenizer.eos_token_id, stop}
    for prompt, per in zip(ids, out):
        for c in per:
            assert c.finish_reason == ("stop" if c.token_ids[-1] in stops else "length")
            assert not stops & set(c.token_ids[:-1])  # nothing after the first stop token
            assert len(c.token_ids) <= 6 and (c.finish_reason == "stop" or len(c.token_ids) == 6)
            with torch.no_grad():  # independently: log_softmax(logits / T) of the sampled tokens
                logits = model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1] / 0.7
            expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(c.log_probs), expected, atol=1e-5, rtol=1e-5)


def test_seeded_sampling_repeats_and_leaves_the_global_stream_alone(model, tokenizer):
    engine = HFEngine(model, tokenizer)
    ids = [tokenizer("12+34=")["input_ids"]]
    params = SamplingParams(n=4, max_new_tokens=5, seed=7)
    torch.manual_seed(1)
    state = torch.get_rng_state()
    a, b = engine.generate(ids, params), engine.generate(ids, params)
    assert [c.token_ids for c in a[0]] == [c.token_ids for c in b[0]]
    assert torch.equal(torch.get_rng_state(), state)


def test_single_turn_rollout_over_an_engine_equals_hf_rollout(model, tokenizer):
    """The generic rollout with an HFEngine passed in, built without the model and bound by the rollout's bind,
    samples what HFRollout samples (same RNG stream)."""
    generic = SingleTurnRollout(HFEngine(), n=2, temperature=0.8, max_new_tokens=5)
    generic.bind(model, tokenizer)
    hf = HFRollout(n=2, temperature=0.8, max_new_tokens=5)
    hf.bind(model, tokenizer)
    torch.manual_seed(3)
    a = generic(prompts(tokenizer))
    torch.manual_seed(3)
    b = hf(prompts(tokenizer))
    for key in (K.RESPONSE_IDS, K.RESPONSE_MASK, K.ROLLOUT_LOG_PROBS, K.GROUP):
        assert torch.equal(a[key], b[key]), key
    assert list(a[K.RESPONSE_TEXT]) == list(b[K.RESPONSE_TEXT])
    assert generic.sync_weights(model) == {}  # the engine generates with the trained module: nothing moves


def test_with_options_shares_the_engine_and_validates(model, tokenizer):
    rollout = HFRollout(n=4, max_new_tokens=3)
    rollout.bind(model, tokenizer)
    greedy = rollout.with_options(n=1, do_sample=False, temperature=1.0)
    assert greedy.engine is rollout.engine and (greedy.n, greedy.do_sample, rollout.n) == (1, False, 4)
    assert greedy(prompts(tokenizer)).batch_size[0] == 3
    with pytest.raises(TypeError, match="unknown option"):
        rollout.with_options(beams=2)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        rollout.with_options(temperature=0.0)


def test_copy_engine_receives_buckets(model, tokenizer):
    """An engine with its own copy (the Trainer makes one under FSDP2) is refreshed bucket by bucket."""
    import copy

    copy_ = copy.deepcopy(model)
    rollout = HFRollout(n=1, max_new_tokens=3, bucket_bytes=4096)
    rollout.bind(copy_, tokenizer)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    metrics = rollout.sync_weights(model)
    assert metrics["weight_sync/buckets"] > 1
    assert metrics["weight_sync/gb"] == pytest.approx(sum(p.numel() * 4 for p in model.parameters()) / 1e9)
    for (name, a), (_, b) in zip(model.named_parameters(), copy_.named_parameters()):
        assert torch.equal(a, b), name
    out = Policy(model, tokenizer)(rollout(prompts(tokenizer)))
    mask = out[K.RESPONSE_MASK].bool()
    torch.testing.assert_close(out[K.ROLLOUT_LOG_PROBS][mask], out[K.OLD_LOG_PROBS][mask], atol=1e-5, rtol=1e-5)
