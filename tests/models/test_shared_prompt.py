"""Shared prompts (rlflow.models.shared_prompt): one pass per distinct prompt gives the padded pass's results."""

import copy

import pytest
import torch

from rlflow.models.checks import enable_activation_checkpointing
from rlflow.models.critic import ValueHeadModel
from rlflow.models.logprobs import TokenLogProbs, response_hidden_states
from rlflow.models.shared_prompt import can_share, distinct_prompts
from tests.models.test_policy import naive_log_probs


@pytest.fixture
def repeated(tokenizer):
    """Three prompts (one of a single token) repeated in mixed order, as a rollout's rows after a reshuffle."""
    texts = ["12+34=", "7", "5+6=", "12+34=", "7", "12+34=", "5+6=", "7"]
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    response = torch.randint(3, len(tokenizer), (len(texts), 5), generator=torch.Generator().manual_seed(0))
    return enc["input_ids"], enc["attention_mask"], response


def test_distinct_prompts_ignore_padding_ids_and_name_each_rows_prompt():
    ids = torch.tensor([[0, 5, 6], [9, 5, 6], [7, 5, 6], [0, 5, 6]])  # rows 0, 1, 3: one prompt (pad ids differ)
    mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [0, 1, 1]])
    first, inverse = distinct_prompts(ids, mask)
    assert len(first) == 2
    assert inverse[0] == inverse[1] == inverse[3] != inverse[2]
    assert first[inverse].tolist() == [0, 0, 2, 0]  # each row's prompt is the one at its first copy
    assert distinct_prompts(ids[1:3], mask[1:3]) is None  # nothing repeats: the padded pass
    runs = torch.tensor([[1, 2], [1, 2], [3, 4], [3, 4], [3, 4]])  # a rollout's layout: runs of one prompt
    first, inverse = distinct_prompts(runs, torch.ones_like(runs))
    assert first.tolist() == [0, 2] and inverse.tolist() == [0, 0, 1, 1, 1]
    again = torch.cat([runs, runs[:1]])  # the first prompt in two runs
    first, inverse = distinct_prompts(again, torch.ones_like(again))
    assert len(first) == 2 and inverse[-1] == inverse[0] != inverse[2]


def fed_shapes(model):
    shapes = []
    hook = model.get_input_embeddings().register_forward_pre_hook(lambda m, args: shapes.append(tuple(args[0].shape)))
    return shapes, hook


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_and_gradients_equal_the_padded_pass(model, repeated, temperature):
    prompt_ids, prompt_mask, response = repeated
    expected_lp, expected_ent = naive_log_probs(model, prompt_ids, prompt_mask, response, temperature)
    results = {}
    for share in (True, False):
        m = copy.deepcopy(model)
        shapes, hook = fed_shapes(m)
        lp, ent = TokenLogProbs(m, temperature=temperature, share_prompts=share)(prompt_ids, prompt_mask, response)
        hook.remove()
        (lp.sum() + 0.1 * ent.sum()).backward()
        results[share] = lp, ent, torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]), shapes
    lp, ent, grad, shapes = results[True]
    P, R = prompt_ids.shape[1], response.shape[1]
    assert shapes == [(3, P), (8, R - 1)]  # 3 distinct prompts once, then the responses on their cache
    assert results[False][3] == [(8, P + R - 1)]
    torch.testing.assert_close(lp, expected_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, expected_ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, results[False][2], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("R", [0, 1, 2])
def test_short_responses(model, repeated, R):
    prompt_ids, prompt_mask, response = repeated
    shared = TokenLogProbs(model)(prompt_ids, prompt_mask, response[:, :R])
    padded = TokenLogProbs(model, share_prompts=False)(prompt_ids, prompt_mask, response[:, :R])
    assert shared[0].shape == (8, R)
    torch.testing.assert_close(shared, padded, atol=1e-5, rtol=1e-5)


def test_critic_values_equal_the_padded_pass(model, repeated):
    critic = ValueHeadModel(model)
    torch.nn.init.normal_(critic.value_head.weight, generator=torch.Generator().manual_seed(1))
    hidden = response_hidden_states(model, *repeated, share_prompts=False)
    torch.testing.assert_close(critic(*repeated), critic.value_head(hidden).squeeze(-1), atol=1e-5, rtol=1e-5)


def test_not_shared_where_it_cannot_be(model, repeated):
    """Gradient checkpointing turns transformers' cache off: the padded pass runs (and is right)."""
    assert can_share(model)
    m = copy.deepcopy(model)
    enable_activation_checkpointing(m, {"use_reentrant": False})
    assert not can_share(m)
    shapes, hook = fed_shapes(m)
    m.train()
    lp, _ = TokenLogProbs(m)(*repeated)
    hook.remove()
    assert len(shapes) == 1
    torch.testing.assert_close(lp, TokenLogProbs(model, share_prompts=False)(*repeated)[0], atol=1e-5, rtol=1e-5)


def test_lora_policy_shares_prompts(model, tokenizer, repeated):
    from peft import LoraConfig

    from rlflow.models.policy import Policy

    policy = Policy(copy.deepcopy(model), tokenizer, lora=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    torch.nn.init.normal_(policy.model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight)
    assert can_share(policy.model)
    shared = TokenLogProbs(policy.model)(*repeated)
    padded = TokenLogProbs(policy.model, share_prompts=False)(*repeated)
    torch.testing.assert_close(shared, padded, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_shared_prompts_on_cuda_in_bf16(tokenizer):
    """On CUDA under bf16 autocast (sdpa), shared prompts give the padded pass's log-probs and gradients up to
    bf16 rounding. Marked ``gpu``: skipped without CUDA (not run on the CPU-only development machine)."""
    from rlflow.models.tiny import tiny_qwen2

    model = tiny_qwen2(len(tokenizer), hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
                       intermediate_size=1024, max_positions=128, seed=0).cuda()
    texts = [f"{a}+{b}=" for a in range(10, 90, 10) for b in (3, 47)]
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    prompt_ids, prompt_mask = (t.repeat_interleave(8, 0).cuda() for t in (enc["input_ids"], enc["attention_mask"]))
    response = torch.randint(3, len(tokenizer), (prompt_ids.shape[0], 24), generator=torch.Generator().manual_seed(0))
    results = []
    for share in (True, False):
        m = copy.deepcopy(model)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            lp, ent = TokenLogProbs(m, share_prompts=share)(prompt_ids, prompt_mask, response.cuda())
        (lp.sum() + 0.1 * ent.sum()).backward()
        results.append((lp.detach(), torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])))
    torch.testing.assert_close(results[0][0], results[1][0], atol=5e-2, rtol=5e-2)
    cosine = torch.nn.functional.cosine_similarity(results[0][1].float(), results[1][1].float(), dim=0)
    assert cosine > 0.999, cosine


def test_a_hybrid_with_recurrent_layers_is_not_shared(tokenizer, repeated):
    """Qwen3.5's cache holds Gated DeltaNet states that transformers cannot copy to other rows (its
    LinearAttentionLayer has no batch_select_indices): such a model runs the padded pass, and its log-probs are
    right."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    m = Qwen3_5ForCausalLM(Qwen3_5TextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=1,
        linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, pad_token_id=0))
    assert not can_share(m)
    lp, _ = TokenLogProbs(m)(*repeated)
    torch.testing.assert_close(lp, naive_log_probs(m, *repeated, 1.0)[0], atol=1e-5, rtol=1e-5)
