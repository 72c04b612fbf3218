import pytest
import torch

from rlflow.data import keys as K
from rlflow.data.prompts import collate, load_rows
from rlflow.models.policy import Policy
from rlflow.rollout.hf import HFRollout, response_mask_until_eos


def prompts(tokenizer, texts=("12+34=", "5+6=", "99+99=")):
    rows, _ = load_rows([{"prompt": t, "ground_truth": str(i)} for i, t in enumerate(texts)])
    return collate(rows, tokenizer)


def test_response_mask_covers_up_to_first_eos():
    eos = 2
    response = torch.tensor([[5, 6, 2, 0, 0], [5, 2, 2, 7, 0], [5, 6, 7, 8, 9], [2, 0, 0, 0, 0]])
    assert response_mask_until_eos(response, eos).tolist() == [
        [1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert response_mask_until_eos(response, [2, 9])[2].tolist() == [1, 1, 1, 1, 1]


def test_n_samples_per_prompt_grouped_and_fields_repeated(model, tokenizer):
    rollout = HFRollout(n=4, max_new_tokens=5)
    rollout.bind(model, tokenizer)
    out = rollout(prompts(tokenizer))
    assert out.batch_size == torch.Size([12])
    assert out[K.GROUP].tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert list(out[K.GROUND_TRUTH]) == ["0"] * 4 + ["1"] * 4 + ["2"] * 4
    assert out[K.RESPONSE_IDS].shape[1] <= 5
    # padding after EOS is the pad id and carries no log-prob
    mask = out[K.RESPONSE_MASK]
    assert torch.all(out[K.RESPONSE_IDS][mask == 0] == tokenizer.pad_token_id)
    assert torch.all(out[K.ROLLOUT_LOG_PROBS][mask == 0] == 0)
    assert len(out[K.RESPONSE_TEXT]) == 12


@pytest.mark.parametrize("options", [dict(temperature=1.0), dict(temperature=0.6, top_k=7, top_p=0.8)])
def test_sampler_log_probs_equal_policy_log_probs(model, tokenizer, options):
    """The rollout's log-probs are the temperature-scaled, untruncated distribution the policy scores."""
    torch.manual_seed(0)
    rollout = HFRollout(n=3, max_new_tokens=6, **options)
    rollout.bind(model, tokenizer)
    out = Policy(model, tokenizer, temperature=options["temperature"])(rollout(prompts(tokenizer)))
    mask = out[K.RESPONSE_MASK].bool()
    torch.testing.assert_close(out[K.ROLLOUT_LOG_PROBS][mask], out[K.OLD_LOG_PROBS][mask], atol=1e-5, rtol=1e-5)


def test_top_k_one_is_greedy(model, tokenizer):
    sampled = HFRollout(n=1, max_new_tokens=4, top_k=1)
    greedy = HFRollout(n=1, max_new_tokens=4, do_sample=False)
    for r in (sampled, greedy):
        r.bind(model, tokenizer)
    torch.manual_seed(1)
    a = sampled(prompts(tokenizer))[K.RESPONSE_IDS]
    b = greedy(prompts(tokenizer))[K.RESPONSE_IDS]
    assert torch.equal(a, b)


def test_stops_at_eos(tokenizer):
    """A model that always prefers EOS yields one-token responses."""
    from rlflow.models.tiny import tiny_qwen2

    model = tiny_qwen2(len(tokenizer), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # logits then come from the bias alone
    bias = torch.zeros(len(tokenizer))
    bias[tokenizer.eos_token_id] = 100.0
    model.lm_head.bias = torch.nn.Parameter(bias)
    rollout = HFRollout(n=2, max_new_tokens=5)
    rollout.bind(model, tokenizer)
    out = rollout(prompts(tokenizer))
    assert out[K.RESPONSE_MASK].sum(-1).tolist() == [1] * 6
    assert out[K.RESPONSE_IDS][:, 0].tolist() == [tokenizer.eos_token_id] * 6
    assert list(out[K.RESPONSE_TEXT]) == [""] * 6


def test_ignore_eos_generates_to_max_new_tokens(tokenizer):
    """verl's rollout.ignore_eos: the same EOS-loving model runs every response to max_new_tokens, masked whole;
    a stop token still ends it; both the tensor and the list paths of the engine."""
    from rlflow.models.tiny import tiny_qwen2
    from rlflow.rollout.engines.base import SamplingParams
    from rlflow.rollout.engines.hf import HFEngine

    model = tiny_qwen2(len(tokenizer), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    with torch.no_grad():
        model.lm_head.weight.zero_()
    bias = torch.zeros(len(tokenizer))
    bias[tokenizer.eos_token_id] = 100.0
    model.lm_head.bias = torch.nn.Parameter(bias)
    rollout = HFRollout(n=2, max_new_tokens=5, ignore_eos=True)
    rollout.bind(model, tokenizer)
    out = rollout(prompts(tokenizer))
    assert out[K.RESPONSE_MASK].sum(-1).tolist() == [5] * 6
    assert (out[K.RESPONSE_IDS] == tokenizer.eos_token_id).all()
    engine = HFEngine(model, tokenizer)
    (done,), = engine.generate([tokenizer("1+1=")["input_ids"]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(done.token_ids) == 4 and done.finish_reason == "length"
    (stopped,), = engine.generate([tokenizer("1+1=")["input_ids"]], SamplingParams(
        max_new_tokens=4, ignore_eos=True, stop_token_ids=(tokenizer.eos_token_id,)))
    assert len(stopped.token_ids) == 1  # a stop token is still a stop


def test_unbound_rollout_says_how_to_fix(tokenizer):
    with pytest.raises(RuntimeError, match="bind"):
        HFRollout(n=2)(prompts(tokenizer))
    with pytest.raises(ValueError, match="n must be"):
        HFRollout(n=0)



@pytest.mark.parametrize("lora", [False, True])
def test_shared_prompt_prefill_gives_the_samples_of_plain_generate(model, tokenizer, lora, monkeypatch):
    """A prompt's n samples share one prefill (each distinct prompt goes through the model once, minus its last
    token); the samples and log-probs are those of plain ``generate`` on the repeated rows."""
    from peft import LoraConfig

    from rlflow.rollout.engines import hf
    from rlflow.rollout.engines.base import SamplingParams

    if lora:
        model = Policy(model, tokenizer, lora=LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).model
    texts = ["12+34=", "7", "5+6=", "99+99="]  # "7": its shared part is all padding
    ids, mask = hf.left_padded([tokenizer(t)["input_ids"] for t in texts], 4, tokenizer.pad_token_id, "cpu")
    params = SamplingParams(n=4, temperature=0.8, top_k=9, max_new_tokens=6, seed=3)
    engine = hf.HFEngine(model, tokenizer)
    fed = []
    hook = model.get_input_embeddings().register_forward_pre_hook(lambda m, args: fed.append(tuple(args[0].shape)))
    shared = engine.generate_padded(ids, mask, params)
    hook.remove()
    monkeypatch.setattr(hf, "shared_prefill", lambda *args: None)  # plain generate as the reference
    plain = engine.generate_padded(ids, mask, params)
    assert fed[:2] == [(4, ids.shape[1] - 1), (16, 1)]  # the distinct prompts once, then all rows from the last column
    assert torch.equal(shared[0], plain[0])
    torch.testing.assert_close(shared[1], plain[1], atol=1e-5, rtol=1e-5)
