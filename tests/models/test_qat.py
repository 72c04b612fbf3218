"""Quantization-aware training (rlflow.models.qat): the NVFP4 quantizer against values worked out by hand and against
vLLM's reference, the straight-through gradient, which layers are quantized, and that every engine samples from the
quantized policy the trainer scores (HF on the trained module, HF on its own copy, the weight buckets vLLM gets)."""

import importlib.util

import pytest
import torch
from torch import nn

from rlflow.data import keys as K
from rlflow.data.prompts import collate, load_rows
from rlflow.models.critic import Critic
from rlflow.models.policy import Policy
from rlflow.models.qat import E2M1_GRID, NVFP4Linear, apply_qat, nvfp4_fake_quantize, plain_copy
from rlflow.rollout.hf import HFRollout
from rlflow.weights import hf_weight_buckets

GRID = torch.tensor(E2M1_GRID)


def test_one_group_by_hand():
    # amax 6: tensor scale 6/2688; the group's scale 6/(6*6/2688) = 448 (E4M3's largest, exact) -> 448*6/2688 = 1
    x = torch.tensor([[0.0, 0.2, 0.3, 0.74, 0.76, 1.25, 1.3, 1.74, 1.8, 2.5, 2.6, 3.4, 3.5, -4.9, 5.1, 6.0]])
    want = torch.tensor([[0.0, 0.0, 0.5, 0.5, 1.0, 1.0, 1.5, 1.5, 2.0, 2.0, 3.0, 3.0, 4.0, -4.0, 6.0, 6.0]])
    assert torch.equal(nvfp4_fake_quantize(x), want)


def test_group_scales_are_e4m3_values_times_the_tensor_scale():
    # group 1's amax 3: 3/(6*(6/2688)) = 224, exact in E4M3 -> scale 224*6/2688 = 0.5; 1.2/0.5 = 2.4 -> 2 -> 1.0
    # group 2's amax 0.7: 0.7/(6/448) = 52.27 -> E4M3 52 -> scale 52/448 = 0.11607..; 0.7/0.11607 = 6.03 -> 6 -> 0.696..
    x = torch.zeros(2, 16)
    x[0, 0], x[0, 1], x[1, 0] = 3.0, 1.2, 0.7
    global_amax = torch.tensor(6.0)
    q = nvfp4_fake_quantize(x, global_amax)
    assert q[0, 0] == 3.0 and q[0, 1] == 1.0
    assert q[1, 0] == pytest.approx(6 * 52 * (6.0 / 2688), rel=1e-6)
    assert float(torch.tensor(52.27).to(torch.float8_e4m3fn).float()) == 52.0  # the rounding the test relies on


def test_every_value_is_a_grid_value_times_its_group_scale_and_within_half_a_step():
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(0)) * 0.02
    q = nvfp4_fake_quantize(w)
    assert q.shape == w.shape and q.dtype == w.dtype
    groups, qg = w.reshape(-1, 16), q.reshape(-1, 16)
    tensor_scale = w.abs().max() / 2688
    scale = (groups.abs().amax(1, keepdim=True) / (6 * tensor_scale)).to(torch.float8_e4m3fn).float() * tensor_scale
    units = (qg.abs() / scale)
    assert torch.allclose(units, GRID[(units[..., None] - GRID).abs().argmin(-1)], atol=1e-5)  # on the grid
    # rounding to the nearest grid value: at most half the widest step (2 between 4 and 6) of the group's scale
    assert ((qg - groups).abs() <= scale + 1e-9).all()
    assert (torch.sign(qg) * torch.sign(groups) >= 0).all()
    assert torch.equal(nvfp4_fake_quantize(q, w.abs().max()), q)  # idempotent with the same tensor scale


def test_bfloat16_in_bfloat16_out():
    w = torch.randn(4, 32, generator=torch.Generator().manual_seed(1)).bfloat16()
    q = nvfp4_fake_quantize(w)
    assert q.dtype == torch.bfloat16
    assert torch.equal(q, nvfp4_fake_quantize(w.float()).bfloat16())


def test_group_size_must_divide_the_input_width():
    with pytest.raises(ValueError, match="not a multiple of the group size 16"):
        nvfp4_fake_quantize(torch.ones(2, 24))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM's NVFP4 reference needs vllm")
def test_matches_vllms_reference_quantizer():
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import ref_nvfp4_quant_dequant

    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(2)) * 0.05
    theirs = ref_nvfp4_quant_dequant(w, (2688 / w.abs().max()).reshape(1), 16)  # vLLM's scale is the inverse
    assert torch.allclose(nvfp4_fake_quantize(w), theirs, rtol=1e-6, atol=0)  # (its reciprocals round differently)


def test_layers_quantized_ignored_and_fused(model):
    lm_head, embed = model.lm_head, model.model.embed_tokens
    names = apply_qat(model)
    layer = model.model.layers[0]
    assert set(names) == {f"model.layers.0.{n}" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                          "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                          "mlp.down_proj")}
    assert type(model.lm_head) is nn.Linear and model.lm_head is lm_head and model.model.embed_tokens is embed
    attn, mlp = layer.self_attn, layer.mlp
    assert attn.q_proj.fused == (attn.q_proj, attn.k_proj, attn.v_proj) and attn.o_proj.fused == ()
    assert mlp.up_proj.fused == (mlp.gate_proj, mlp.up_proj) and mlp.down_proj.fused == ()
    shared = max(m.weight.abs().max() for m in attn.q_proj.fused)
    assert torch.equal(attn.k_proj(torch.eye(32)).T, nvfp4_fake_quantize(attn.k_proj.weight, shared))
    assert "model.layers.0.mlp.gate_proj.weight" in dict(model.named_parameters())  # checkpoints keep their names


def test_ignore_patterns_regex_and_substring(model):
    apply_qat(model, ignore_patterns=["re:.*mlp\\.(gate|up)_proj$", "o_proj", "lm_head"])
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, NVFP4Linear) and isinstance(layer.self_attn.q_proj, NVFP4Linear)
    assert not any(isinstance(m, NVFP4Linear) for m in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.self_attn.o_proj))
    assert layer.self_attn.q_proj.fused  # v, k, q still share
    assert layer.mlp.down_proj.fused == ()


def test_w4a4_and_unknown_modes_are_refused(model):
    with pytest.raises(ValueError, match="'w4a4' .* experimental"):
        apply_qat(model, mode="w4a4")
    with pytest.raises(ValueError, match="unknown"):
        apply_qat(model, mode="int4")


def test_the_gradient_passes_straight_through(model):
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    apply_qat(model)
    y = layer(x)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    # the linear layer's gradient with respect to the weight it used, given to the master weight unchanged
    assert torch.allclose(layer.weight.grad, g.T @ x, atol=1e-6)
    quantized = nvfp4_fake_quantize(layer.weight)
    assert layer.bias is None and torch.allclose(y, x @ quantized.T, atol=1e-6)
    assert not torch.equal(quantized, layer.weight)  # the forward did use another weight


def prompts(tokenizer):
    rows, _ = load_rows([{"prompt": p, "ground_truth": ""} for p in ("12+34=", "5+6=", "99+99=")])
    return collate(rows, tokenizer)


def sampled_log_probs_match(policy, rollout, engine_model):
    rollout.bind(engine_model, policy.tokenizer)
    out = rollout(prompts(policy.tokenizer))
    mask = out[K.RESPONSE_MASK].bool()
    with torch.no_grad():
        trained, _ = policy.log_probs(out)
        plain, _ = policy.reference().log_probs(out)
    assert (trained - out[K.ROLLOUT_LOG_PROBS])[mask].abs().max().item() < 1e-5
    assert (plain - out[K.ROLLOUT_LOG_PROBS])[mask].abs().max().item() > 1e-3  # the quantization shows


@pytest.mark.parametrize("own_copy", [False, True], ids=["trained-module", "engine-copy"])
def test_the_hf_engine_samples_from_the_quantized_policy(model, tokenizer, own_copy):
    policy = Policy(model, tokenizer, qat={})
    rollout = HFRollout(n=2, max_new_tokens=6, seed=0)
    engine_model = policy.engine_copy() if own_copy else policy.model
    if own_copy:  # a plain model holding the quantized weights
        assert not any(isinstance(m, NVFP4Linear) for m in engine_model.modules())
    sampled_log_probs_match(policy, rollout, engine_model)
    with torch.no_grad():  # an update moved the master weights; the copy is brought up to date by weight sync
        for p in policy.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    rollout.sync_weights(policy.model)
    out = rollout(prompts(tokenizer))
    with torch.no_grad():
        trained, _ = policy.log_probs(out)
    assert (trained - out[K.ROLLOUT_LOG_PROBS])[out[K.RESPONSE_MASK].bool()].abs().max().item() < 1e-5


def test_engines_are_sent_the_quantized_weights_and_the_reference_is_plain(model, tokenizer):
    master = {n: p.detach().clone() for n, p in model.named_parameters()}
    policy = Policy(model, tokenizer, qat={"group_size": 16})
    sent = {n: t for bucket in hf_weight_buckets(policy.model) for n, t in bucket}
    attn = policy.model.model.layers[0].self_attn
    shared = max(m.weight.abs().max() for m in attn.q_proj.fused)
    assert torch.equal(sent["model.layers.0.self_attn.v_proj.weight"], nvfp4_fake_quantize(attn.v_proj.weight, shared))
    assert torch.equal(sent["lm_head.weight"], master["model.embed_tokens.weight"])  # ignored (tied): sent as it is
    assert not torch.equal(sent["model.layers.0.mlp.down_proj.weight"], master["model.layers.0.mlp.down_proj.weight"])
    reference = policy.reference().model
    assert not any(isinstance(m, NVFP4Linear) for m in reference.modules())
    assert all(torch.equal(p, master[n]) for n, p in reference.named_parameters())
    assert all(torch.equal(p, master[n]) for n, p in policy.model.named_parameters())  # the master weights stay
    copy_ = plain_copy(policy.model, served=True)
    assert all(torch.equal(p, sent[n]) for n, p in copy_.named_parameters())


def test_qat_with_lora_is_refused(model, tokenizer):
    pytest.importorskip("peft")
    from peft import LoraConfig

    with pytest.raises(ValueError, match="qat with LoRA is not supported"):
        Policy(model, tokenizer, qat={}, lora=LoraConfig(r=2, target_modules=["q_proj"]))


def test_the_critic_computes_with_quantized_weights(model, tokenizer):
    critic = Critic(model, qat={})
    with torch.no_grad():
        nn.init.normal_(critic.module.value_head.weight, std=0.1, generator=torch.Generator().manual_seed(4))
    batch = prompts(tokenizer)
    batch[K.RESPONSE_IDS] = torch.randint(3, len(tokenizer), (3, 5), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        values = critic.values(batch)
        served = plain_copy(critic.module, served=True)(batch[K.PROMPT_IDS], batch[K.PROMPT_MASK], batch[K.RESPONSE_IDS])
        plain = plain_copy(critic.module)(batch[K.PROMPT_IDS], batch[K.PROMPT_MASK], batch[K.RESPONSE_IDS])
    assert isinstance(critic.module.value_head, NVFP4Linear)
    assert torch.allclose(values, served, atol=1e-6) and not torch.allclose(values, plain, atol=1e-4)
