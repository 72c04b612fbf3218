"""Quantized rollouts (verl's ``rollout.quantization=fp8``; rollout/engines/quantization.py).

On CPU: the vLLM arguments rlflow gives resolve, in vLLM's own config code, to verl's scheme (128x128 e4m3 weight
blocks on every linear layer and MoE expert, the router kept); the quantizer vLLM runs on each update gives verl's
numbers (an independent blockwise e4m3 quantization written here, and error bounds); the server's command line
parses in vLLM's own argument parser; the engine refuses what it cannot run, at once. The engine itself (vLLM
started with fp8, weights updated from the trainer, its log-probs following them) is the ``gpu`` test at the end:
not run yet, no GPU was available when it was written.
"""

import json

import pytest
import torch

from rlflow import Policy
from rlflow.data import keys as K
from rlflow.models.tiny import char_tokenizer, tiny_qwen2
from rlflow.rollout.engines.launch import vllm_server_command
from rlflow.rollout.engines.quantization import QUANTIZATIONS, quantization_unavailable, vllm_arguments
from rlflow.rollout.engines.vllm import VLLMEngine
from tests.rollout.conftest import requires_vllm
from tests.rollout.test_vllm import largest_difference, prompts

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
QWEN_FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def online_config(quantization: str):
    """vLLM's online quantization config built from the engine arguments rlflow gives (as vllm.LLM builds it)."""
    from vllm.config.quantization import resolve_quantization_config
    from vllm.model_executor.layers.quantization.online.base import OnlineQuantizationConfig

    options = vllm_arguments(quantization)
    config = OnlineQuantizationConfig(resolve_quantization_config(options["quantization"],
                                                                  options["quantization_config"]))
    config.packed_modules_mapping = QWEN_FUSED
    return config


def verl_blockwise_fp8(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``scaled_fp8_blockwise`` (its Triton kernel), written out: zero-pad to whole blocks, scale each
    block by its largest magnitude / 448, multiply by the inverse and cast to e4m3; the scale is what dequantizes."""
    rows, cols = weight.shape
    padded = torch.zeros(-(-rows // block) * block, -(-cols // block) * block)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(padded.shape[0] // block, block, padded.shape[1] // block, block)
    scale = blocks.abs().amax(dim=(1, 3), keepdim=True) / E4M3_MAX
    quantized = (blocks * (1.0 / scale)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return quantized.view_as(padded)[:rows, :cols], scale.view(blocks.shape[0], blocks.shape[2])


def per_element(scale: torch.Tensor, shape, block: int = 128) -> torch.Tensor:
    """Each element's block scale."""
    return scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[: shape[0], : shape[1]]


@requires_vllm
def test_fp8_is_verls_block_scheme_in_vllms_own_config():
    """Every linear layer and the MoE experts get vLLM's online per-block fp8 (128x128 e4m3 blocks, static weight
    scales, as verl's weight_block_size [128, 128]); the MoE router stays in the model's dtype (verl's ignored_layers)."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.quantization.online.fp8 import (Fp8PerBlockOnlineLinearMethod,
                                                                    Fp8PerBlockOnlineMoEMethod)

    config = online_config("fp8")
    for cls, name in [(QKVParallelLinear, "model.layers.0.self_attn.qkv_proj"),
                      (RowParallelLinear, "model.layers.0.self_attn.o_proj"),
                      (MergedColumnParallelLinear, "model.layers.1.mlp.gate_up_proj"),
                      (RowParallelLinear, "model.layers.1.mlp.down_proj")]:
        _, scheme, _, spec, method = config.resolve_quant_method_cls(cls, name)
        assert method is Fp8PerBlockOnlineLinearMethod and scheme == "fp8_per_block_static", name
        assert spec.weight.dtype == torch.float8_e4m3fn and spec.weight.scale.static
        assert tuple(spec.weight.scale.group_shape) == (128, 128)
    assert config.resolve_quant_method_cls(RoutedExperts, "model.layers.1.mlp.experts")[-1] is Fp8PerBlockOnlineMoEMethod
    assert config.resolve_quant_method_cls(RowParallelLinear, "model.layers.1.mlp.gate") is None  # the router


@requires_vllm
def test_the_quantizer_vllm_runs_on_every_update_gives_verls_numbers():
    """vLLM's per-block quantizer (what Fp8PerBlockOnlineLinearMethod runs on each reloaded layer), at the block
    shape rlflow's arguments resolve to, equals verl's blockwise e4m3 quantization written out here, on a weight
    whose edges are partial blocks; dequantized, every value is within e4m3's rounding of the original."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    spec = online_config("fp8").args.linear
    block = list(spec.weight.scale.group_shape)
    torch.manual_seed(0)
    weight = (torch.randn(300, 200) * torch.logspace(-3, 0, 200)).to(torch.bfloat16)  # columns of many scales
    quantized, scale = per_block_cast_to_fp8(weight, block_size=block, use_ue8m0=False)
    expected, expected_scale = verl_blockwise_fp8(weight)
    assert quantized.dtype == torch.float8_e4m3fn and quantized.shape == (300, 200)
    assert scale.dtype == torch.float32 and scale.shape == (3, 2)  # ceil(300 / 128) x ceil(200 / 128)
    torch.testing.assert_close(scale, expected_scale, rtol=0, atol=0)
    assert torch.equal(quantized.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(quantized.float().abs().amax(), torch.tensor(E4M3_MAX))  # each block's largest value: 448
    error = (quantized.float() * per_element(scale, weight.shape) - weight.float()).abs()
    # e4m3 keeps 3 mantissa bits: half a step is at most 2^-4 of a normal value; below 2^-6 (subnormals) the step
    # is 2^-9, so half of it times the block's scale
    bound = torch.maximum(weight.float().abs() * 2**-4, per_element(scale, weight.shape) * 2**-10)
    assert (error <= bound * (1 + 1e-6)).all()
    assert error.max() > 0  # not a lossless cast: the bound is what is checked


@requires_vllm
def test_the_servers_command_line_parses_to_the_same_scheme():
    """vllm_server_command(quantization='fp8') adds flags that vLLM's own server argument parser turns into the
    engine arguments VLLMEngine passes (the router kept)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cmd = vllm_server_command("/models/m", 8000, quantization="fp8")
    flags = cmd[cmd.index("--quantization"):cmd.index("--quantization") + 4]
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--model", "/models/m", *flags]))
    assert args.quantization == "fp8_per_block" and args.quantization_config.ignore == ["*.mlp.gate"]
    assert json.loads(flags[3]) == QUANTIZATIONS["fp8"]["quantization_config"]
    assert "--quantization" not in vllm_server_command("/models/m", 8000)


@requires_vllm  # VLLMRollout refuses at once without vLLM
def test_vllms_own_names_pass_through_and_fp8_is_checked_before_anything_starts():
    """Another name is vLLM's own quantization= argument, as engine_kwargs gave it before; fp8 refuses float32
    compute and a second quantization_config; a rollout given the scheme twice refuses."""
    from rlflow.rollout import VLLMRollout

    assert vllm_arguments("fp8_per_tensor") == {"quantization": "fp8_per_tensor"} and vllm_arguments(None) == {}
    assert VLLMEngine(quantization="fp8_per_tensor").settings["quantization"] == "fp8_per_tensor"  # vLLM's to judge
    with pytest.raises(ValueError, match="needs dtype='bfloat16' or 'float16' .* got dtype='float32'"):
        VLLMEngine(quantization="fp8", dtype="float32")
    with pytest.raises(ValueError, match="sets vLLM's quantization_config itself; engine_kwargs gives one too"):
        VLLMEngine(quantization="fp8", dtype="bfloat16", quantization_config={"ignore": []})
    with pytest.raises(ValueError, match="quantization='fp8' and engine_kwargs' quantization='fp8_per_tensor'"):
        VLLMRollout(quantization="fp8", engine_kwargs={"quantization": "fp8_per_tensor"})
    rollout = VLLMRollout(engine_kwargs={"quantization": "fp8_per_tensor"})  # as before: to vllm.LLM as it is
    assert rollout.engine.settings["quantization"] == "fp8_per_tensor"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU: quantized rollouts run here")
def test_fp8_is_refused_at_once_without_cuda():
    """The engine refuses before vLLM is imported or a model read (the CUDA check reads no vLLM module)."""
    assert "this machine has no CUDA GPU" in quantization_unavailable()
    with pytest.raises(NotImplementedError, match=r"VLLMEngine\(quantization='fp8'\): quantized rollouts run on CUDA "
                                                  "GPUs .* this machine has no CUDA GPU"):
        VLLMEngine("/no/such/model", quantization="fp8", dtype="bfloat16")


# ------------------------------------------------------------------------------------------------- on a GPU
def fp8_model_dir(path):
    """A tiny Qwen2 whose every linear layer is whole 128x128 blocks (hidden 256, head_dim 64, 2 KV heads)."""
    tok = char_tokenizer()
    tiny_qwen2(len(tok), hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512, seed=0
               ).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.gpu
@requires_vllm
@pytest.mark.parametrize("weight_transfer", ["auto", "reload"])  # CUDA IPC, and reload_weights
def test_an_fp8_engine_follows_the_trainers_weights(tmp_path, weight_transfer):
    """vLLM holds the linear layers in e4m3; after each update (the trainer's float32 weights, quantized by vLLM's
    layerwise reload) its log-probs are back within fp8's rounding of the policy's, far from the stale ones."""
    from rlflow.rollout import VLLMRollout

    policy = Policy.from_pretrained(fp8_model_dir(tmp_path / "m"))
    policy.model.cuda()
    rollout = VLLMRollout(n=2, max_new_tokens=8, dtype="bfloat16", quantization="fp8", gpu_memory_utilization=0.25,
                          enforce_eager=True, free_cache_engine=False, max_model_len=64,
                          weight_transfer=weight_transfer)
    rollout.bind(policy.model, policy.tokenizer)
    kinds = rollout.engine.llm.apply_model(lambda m: {n: (p.dtype, type(getattr(m.get_submodule(n.rsplit(".", 1)[0]),
                                                                                 "quant_method", None)).__name__)
                                                      for n, p in m.named_parameters() if n.endswith("proj.weight")})[0]
    assert kinds and all(dtype == torch.float8_e4m3fn for dtype, _ in kinds.values()), kinds
    assert {method for _, method in kinds.values()} == {"Fp8PerBlockOnlineLinearMethod"}
    batch = prompts(policy.tokenizer).to("cuda")
    fresh = largest_difference(policy(rollout(batch)))  # bf16 activations and fp8 weights against float32
    assert fresh < 0.5, fresh
    for _ in range(2):  # the second update checks vLLM quantizes again, not only once
        with torch.no_grad():
            for p in policy.model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        stale = largest_difference(policy(rollout(batch)))
        assert rollout.sync_weights(policy.model)["weight_sync/gb"] > 0
        out = policy(rollout(batch))
        synced = largest_difference(out)
        assert synced < 0.5 and synced < stale / 4, (fresh, stale, synced)
        assert out[K.RESPONSE_IDS].is_cuda
