"""Qwen3.5 (transformers' ``qwen3_5_text``) in megatron-core's terms: a hybrid of Gated DeltaNet and gated attention.

Transformers' ``Qwen3_5ForCausalLM`` interleaves two kinds of decoder layer (``config.layer_types``):

- ``linear_attention``: Gated DeltaNet, megatron-core's ``ssm.gated_delta_net.GatedDeltaNet`` (its input
  projection is transformers' ``in_proj_qkv | in_proj_z | in_proj_b | in_proj_a`` stacked, its depthwise
  ``conv1d``, ``A_log``, ``dt_bias``, the gated RMSNorm ``out_norm`` and ``out_proj``);
- ``full_attention``: attention whose query projection also yields a sigmoid output gate per head
  (Megatron's ``attention_output_gate``), q/k RMSNorms and rotary embeddings on the first
  ``partial_rotary_factor`` of each head.

Every RMSNorm of the model but Gated DeltaNet's is zero-centred (``x_normed * (1 + weight)``): megatron-core's local
norm (``torch.nn.RMSNorm``) is not, so the block spec built here uses :class:`ZeroCenteredRMSNorm`, which computes
exactly transformers' expression. Which weights go where is :mod:`.slots`' business.

On CPU, megatron-core's GatedDeltaNet needs two workarounds (:func:`gated_delta_net_on_cpu`, installed with the
others of :mod:`.cpu`): its constructor refuses to run without the ``fla`` package (flash-linear-attention,
Triton kernels: CUDA only) and allocates ``conv1d``, ``A_log`` and ``dt_bias`` on ``torch.cuda.current_device()``.
The module's own pure-torch ``torch_chunk_gated_delta_rule`` (the one its ``deterministic_mode`` uses) stands in for
fla's chunked kernel and an L2 norm written as transformers' ``l2norm`` for fla's.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

HYBRID_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")


class ZeroCenteredRMSNorm(nn.Module):
    """transformers' ``Qwen3_5RMSNorm``: ``x * rsqrt(mean(x^2) + eps) * (1 + weight)`` in float32 (weight starts at 0).

    Built by Megatron's ``build_module(spec, config=..., hidden_size=..., eps=...)``."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6, **_):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=getattr(config, "params_dtype", torch.float32)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNormWeight(nn.Module):
    """transformers' ``Qwen3_5RMSNormGated`` without its gate (Megatron's GatedDeltaNet multiplies by the gate
    itself): ``weight * (x * rsqrt(mean(x^2) + eps))``, weight starting at 1."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6, **_):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=getattr(config, "params_dtype", torch.float32)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * out.to(dtype)


def is_hybrid(config) -> bool:
    return config.model_type in HYBRID_MODEL_TYPES


def layer_parameters(config) -> tuple[int, int, int]:
    """(split over the tensor-parallel ranks, whole on each, routed experts) parameters of an average decoder layer: Gated DeltaNet
    and gated-attention layers differ, and the memory estimate counts every layer alike."""
    H, d, nq, nkv = config.hidden_size, config.head_dim, config.num_attention_heads, config.num_key_value_heads
    value = config.linear_value_head_dim * config.linear_num_value_heads
    qkv = 2 * config.linear_key_head_dim * config.linear_num_key_heads + value
    heads = config.linear_num_value_heads
    linear = (H * (qkv + value + 2 * heads) + qkv * config.linear_conv_kernel_dim + 2 * heads + value * H,
              config.linear_value_head_dim)
    full = (H * 2 * nq * d + 2 * H * nkv * d + nq * d * H, 2 * d)
    pattern = linear_attention_pattern(config)
    experts = getattr(config, "num_experts", None) or 0
    mlp = 3 * H * (config.shared_expert_intermediate_size if experts else config.intermediate_size)
    split = sum(linear[0] if lin else full[0] for lin in pattern) // len(pattern) + mlp
    whole = sum(linear[1] if lin else full[1] for lin in pattern) // len(pattern) + 2 * H
    if experts:
        whole += experts * H + H  # the router, the shared expert's gate
    return split, whole, experts * 3 * H * (config.moe_intermediate_size if experts else 0)


def linear_attention_pattern(config) -> list[int]:
    """Megatron's ``linear_attention_freq`` as a list: 1 for a Gated DeltaNet layer, 0 for full attention."""
    return [int(kind == "linear_attention") for kind in config.layer_types]


def config_kwargs(config) -> dict:
    """The ``TransformerConfig`` fields of a Qwen3.5 text config (on top of the common ones of :mod:`.model`)."""
    moe = {}
    if getattr(config, "num_experts", None):  # Qwen3.5-MoE: every layer's MLP is routed experts + a gated shared one
        moe = dict(moe_shared_expert_intermediate_size=config.shared_expert_intermediate_size,
                   moe_shared_expert_gate=True)
    return moe | dict(
        attention_output_gate=True, experimental_attention_variant="gated_delta_net",
        linear_attention_freq=linear_attention_pattern(config), linear_conv_kernel_dim=config.linear_conv_kernel_dim,
        linear_key_head_dim=config.linear_key_head_dim, linear_value_head_dim=config.linear_value_head_dim,
        linear_num_key_heads=config.linear_num_key_heads, linear_num_value_heads=config.linear_num_value_heads,
    )  # partial rotary: MegatronLM passes the rotary angles of the rotated dimensions only (transformers' inv_freq)


def check_layout(layout, config) -> None:
    """What the conversion of Qwen3.5 does not cover, refused by name."""
    heads = {"linear_num_key_heads": config.linear_num_key_heads,
             "linear_num_value_heads": config.linear_num_value_heads}
    if getattr(config, "num_experts", None) and layout.tensor > 1:
        raise ValueError(f"{layout.describe()} does not fit {config.model_type}: Qwen3.5-MoE runs at tensor parallel 1 "
                         "here (its experts split by expert parallel): megatron-core trains MoE layers under tensor "
                         "parallelism only with sequence parallelism, which the local layer spec rlflow builds "
                         "Qwen3.5 with does not run")
    uneven = [f"{k}={n}" for k, n in heads.items() if n % layout.tensor]
    if uneven:
        raise ValueError(f"{layout.describe()} does not fit {config.model_type}: Gated DeltaNet's {', '.join(uneven)} "
                         f"not divisible by tensor parallel {layout.tensor}")


def _gated_delta_net_class():
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    class RLFlowGatedDeltaNet(GatedDeltaNet):
        """megatron-core's GatedDeltaNet whose gated norm is plain torch: its own is wrapped in ``torch.compile``
        (``jit_fuser``), which on CPU compiles C++ at the first call; the expression is the same."""

        def _apply_gated_norm(self, x, gate):
            dtype = x.dtype
            y = self.out_norm(x.reshape(-1, x.shape[-1])) * self.act_fn(gate.reshape(-1, gate.shape[-1]).float())
            return y.to(dtype)

    return RLFlowGatedDeltaNet


def block_spec(config, transformer_config, kind: str = "local"):
    """This pipeline stage's ``TransformerBlockSubmodules``: megatron-core's local layer spec per layer, with the
    self-attention of ``linear_attention`` layers replaced by GatedDeltaNet and every norm by transformers' own."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if kind != "local":
        raise ValueError(f"layer_spec={kind!r}: Qwen3.5 is built with megatron-core's local modules only "
                         "(layer_spec='local')")
    base = get_gpt_layer_local_spec(num_experts=getattr(config, "num_experts", None), qk_layernorm=True,
                                    normalization="RMSNorm")
    norm = ModuleSpec(module=ZeroCenteredRMSNorm)
    gdn = ModuleSpec(module=_gated_delta_net_class(), submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=ModuleSpec(module=GatedRMSNormWeight), out_proj=RowParallelLinear))
    specs = []
    for linear in linear_attention_pattern(config):
        spec = copy.deepcopy(base)
        sub = spec.submodules
        sub.input_layernorm = sub.pre_mlp_layernorm = norm
        if linear:
            sub.self_attention = gdn
        else:
            sub.self_attention.submodules.q_layernorm = sub.self_attention.submodules.k_layernorm = norm
        specs.append(spec)
    offset = get_transformer_layer_offset(transformer_config)
    count = get_num_layers_to_build(transformer_config)
    return TransformerBlockSubmodules(layer_specs=specs[offset: offset + count], layer_norm=norm)


def _l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """transformers' ``l2norm`` (which matches fla's)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def gated_delta_net_on_cpu(set_attr, cpu_torch) -> None:
    """Let megatron-core's GatedDeltaNet run without ``fla`` on CPU: ``set_attr(owner, name, value)`` records each
    change so that :class:`~rlflow.strategies.megatron.cpu.CPUWorkarounds` undoes it; ``cpu_torch`` is its ``torch``
    whose ``cuda.current_device()`` is the CPU."""
    import megatron.core.ssm.gated_delta_net as gdn

    if gdn.HAVE_FLA:  # the real kernels (they need CUDA): nothing to stand in for
        return
    set_attr(gdn, "HAVE_FLA", True)
    set_attr(gdn, "chunk_gated_delta_rule", gdn.torch_chunk_gated_delta_rule)
    set_attr(gdn, "l2norm", _l2norm)
    set_attr(gdn, "torch", cpu_torch)
