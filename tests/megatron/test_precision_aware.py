"""rlflow's precision-aware AdamW (``rlflow.strategies.megatron.precision_aware``) against torch's AdamW.

No processes, no megatron-core: a real tiny transformers model, trained a few steps with micro-batch gradient
accumulation by both optimizers from the same weights and batches.
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlflow.strategies.megatron.precision_aware import (PrecisionAwareAdamW, as_megatron, precision_dtypes,
                                                          trained_bytes)

HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
STEPS, MICRO = 8, 2


def tiny_model(seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(config)


def batches():
    g = torch.Generator().manual_seed(1)
    return [[torch.randint(0, 64, (2, 12), generator=g) for _ in range(MICRO)] for _ in range(STEPS)]


def train(model, optimizer):
    for step in batches():
        for ids in step:  # gradients accumulate over the micro-batches
            (model(input_ids=ids, labels=ids).loss / MICRO).backward()
        optimizer.step()
        optimizer.zero_grad()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def reference():
    model = tiny_model()
    return train(model, torch.optim.AdamW(model.parameters(), **HYPER))


def precision_aware(**dtypes):
    model = tiny_model()
    optimizer = PrecisionAwareAdamW(model.parameters(), **HYPER, **dtypes)
    return train(model, optimizer), optimizer


def test_all_float32_is_torchs_adamw_bit_for_bit():
    ours, optimizer = precision_aware()
    assert torch.equal(ours, reference())
    assert not any(hasattr(p, "main_grad") for g in optimizer.param_groups for p in g["params"])


def test_low_precision_states_are_stored_in_their_dtypes():
    dtypes = dict(main_grads_dtype="bf16", exp_avg_dtype="fp8", exp_avg_sq_dtype="fp16", main_params_dtype="fp32")
    model = tiny_model()
    optimizer = PrecisionAwareAdamW(model.parameters(), **HYPER, **dtypes)
    train(model, optimizer)
    ids = batches()[0][0]
    model(input_ids=ids, labels=ids).loss.backward()  # a gradient waiting for the next step
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    for p in params:
        state = optimizer.state[p]
        assert (state["exp_avg"].dtype, state["exp_avg_sq"].dtype) == (torch.float8_e4m3fn, torch.float16)
        assert "main_param" not in state  # float32 parameters are their own master weights
        assert p.grad is None and p.main_grad.dtype == torch.bfloat16  # accumulated in bf16, param.grad freed
    # 1 + 2 bytes of moments and 2 of gradient a parameter (float32: 12), and a float32 scale per fp8/fp16 tensor
    assert optimizer.state_bytes() == (1 + 2 + 2) * n + 2 * 4 * len(params)
    assert trained_bytes(precision_dtypes({"use_precision_aware_optimizer": True, **dtypes})) == 4 + 2 + 1 + 2
    assert trained_bytes(None) == 16


def test_low_precision_master_weights_live_in_the_state():
    _, optimizer = precision_aware(main_params_dtype="fp16")
    for p in (p for g in optimizer.param_groups for p in g["params"]):
        state = optimizer.state[p]
        assert state["main_param"].dtype == torch.float16
        assert torch.equal(p.detach(), state["main_param"].float() * state["main_param_scale"])  # its copy's value


# ||weights - AdamW's|| / ||AdamW's update|| after 8 steps (tiny Llama, lr 1e-3, 2 micro-batches), measured:
# bf16 moments 0.0016, + bf16 gradients 0.0145 (two micro-batches summing to ~0 keep few correct bits, and Adam
# normalises that noise to a step of ~lr), fp16 moments 0.0002 (scaled: 10 mantissa bits), fp8 first moment 0.023
# (3 bits), fp16 master weights 0.009 (~1e-3 relative rounding of each weight, against an update of ~3e-3).
# Each bound is ~3x its measurement: small beside a lost step (0.28) or a wrong one (fp8 second moments: 35).
CLOSE = [(dict(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"), 0.005),
         (dict(main_grads_dtype="bf16", exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"), 0.05),
         (dict(exp_avg_dtype="fp16", exp_avg_sq_dtype="fp16"), 0.001),
         (dict(exp_avg_dtype="fp8"), 0.07),
         (dict(main_params_dtype="fp16"), 0.03)]


@pytest.mark.parametrize(("dtypes", "bound"), CLOSE, ids=[",".join(f"{k}={v}" for k, v in d.items()) for d, _ in CLOSE])
def test_low_precision_stays_close_to_float32_adamw(dtypes, bound):
    ours, _ = precision_aware(**dtypes)
    ref = reference()
    update = ref - torch.cat([p.detach().flatten() for p in tiny_model().parameters()])
    assert not torch.equal(ours, ref)  # the rounding is real
    assert (ours - ref).norm() / update.norm() < bound


def test_state_dict_holds_float32_values_and_loading_stores_them_back_in_their_dtypes():
    """As Transformer Engine's FusedAdam: the state dict holds unscaled float32 values (a checkpoint does not depend
    on the per-tensor scales, which change with the sharding), loading rescales them into the configured dtypes."""
    dtypes = dict(exp_avg_dtype="fp8", exp_avg_sq_dtype="bf16", main_params_dtype="fp16")
    model = tiny_model()
    optimizer = PrecisionAwareAdamW(model.parameters(), **HYPER, **dtypes)
    train(model, optimizer)
    saved = optimizer.state_dict()
    assert {v.dtype for s in saved["state"].values() for k, v in s.items() if k != "step"} == {torch.float32}
    fresh = PrecisionAwareAdamW(model.parameters(), **HYPER, **dtypes)
    fresh.load_state_dict(saved)
    for p in model.parameters():
        before, after = optimizer.unscaled_state(p), fresh.unscaled_state(p)
        for key in ("exp_avg", "exp_avg_sq", "main_param"):
            assert fresh.state[p][key].dtype == optimizer.state[p][key].dtype
            torch.testing.assert_close(after[key], before[key], rtol=1e-6, atol=0)  # rescaling: one rounding at most
        assert torch.equal(fresh.state[p]["step"], optimizer.state[p]["step"])
    # a state loaded as float32 tensors (the Megatron checkpoint writes them into the optimizer's state) is stored
    # back in the configured dtypes at the next step
    again = PrecisionAwareAdamW(model.parameters(), **HYPER, **dtypes)
    for p in model.parameters():
        again.state[p] = optimizer.unscaled_state(p)
    train(model, again)
    assert {again.state[p]["exp_avg"].dtype for p in model.parameters()} == {torch.float8_e4m3fn}


def test_bad_dtypes_are_named():
    with pytest.raises(ValueError, match=r"exp_avg_sq_dtype=fp8: .* Transformer Engine's FusedAdam takes it"):
        PrecisionAwareAdamW(tiny_model().parameters(), exp_avg_sq_dtype="fp8")
    with pytest.raises(ValueError, match=r"main_grads_dtype='fp16': choose fp32, bf16"):
        precision_dtypes({"use_precision_aware_optimizer": True, "main_grads_dtype": "fp16"})
    with pytest.raises(ValueError, match=r"main_params_dtype='int4': choose fp32, fp16"):
        precision_dtypes({"use_precision_aware_optimizer": True, "main_params_dtype": "int4"})
    with pytest.raises(ValueError, match=r"exp_avg_dtype='bf16' needs use_precision_aware_optimizer=True"):
        precision_dtypes({"exp_avg_dtype": "bf16"})
    assert precision_dtypes({"exp_avg_dtype": "fp32"}) is None
    assert as_megatron({"exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "fp8", "optimizer_cpu_offload": True}) == {
        "exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.uint8, "optimizer_cpu_offload": True}
    with pytest.raises(ValueError, match="megatron-core's Adam has no amsgrad"):
        PrecisionAwareAdamW.replacing(torch.optim.AdamW(tiny_model().parameters(), amsgrad=True), {})
