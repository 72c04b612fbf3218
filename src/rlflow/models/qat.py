"""Quantization-aware training (QAT) with NVFP4 weights, in plain torch: verl's ``qat`` (``verl.utils.qat``).

NVFP4 stores a weight as 4-bit E2M1 values (the grid ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` with a sign), one FP8-E4M3
scale per group of 16 consecutive elements along the input dimension, and one float32 scale per tensor.
:func:`nvfp4_fake_quantize` quantizes and dequantizes at once, step for step as verl's Triton kernel
(``verl/utils/qat/linear.py``, ``_fp4_fake_quant_kernel``), in float32:

- the tensor's scale is ``global_amax / (6 * 448)`` (``global_amax``: the largest magnitude);
- a group's scale is ``amax_group / (6 * tensor scale)``, capped at 448, rounded to FP8-E4M3, times the tensor
  scale (a scale under ``1e-5``: 1);
- each element is ``|x| / group scale`` rounded to the nearest E2M1 value (ties to the even one), times the group
  scale, with ``x``'s sign, cast back to ``x``'s dtype.

:func:`apply_qat` turns the model's ``nn.Linear`` layers into :class:`NVFP4Linear` (verl's ``apply_qat`` and
``enable_qat_fuse``): ``weight`` stays the full-precision master weight the optimizer updates; each forward uses
its fake-quantized value, and the gradient passes straight through to the master weight (the straight-through
estimator: ``d(loss)/d(weight)`` is the gradient with respect to the quantized weight). Layers whose name matches
an ignore pattern (``re:`` + a regular expression matched at the start of the name, or else a substring), and
layers whose input width is not a multiple of the group size, are left alone. The projections one inference
kernel fuses share one tensor scale (the largest magnitude of them all): ``q_proj``/``k_proj``/``v_proj`` of one
attention, ``gate_proj``/``up_proj`` of one MLP, as verl's fusion siblings.

What a rollout engine is sent (``rlflow.weights.full_weight_buckets`` asks each module's ``served_weights()``)
is the fake-quantized weight, so generation samples from the policy being trained. Only weight-only NVFP4
(``mode="w4a16"``) is here: verl calls its ``w4a4`` (4-bit activations too) experimental, with KL-divergence
problems.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

FP4_E2M1_MAX = 6.0
FP8_E4M3_MAX = 448.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
DEFAULT_IGNORE = ("lm_head", "embed_tokens", "re:.*mlp.gate$")  # verl's default ignore_patterns
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # verl's FUSION_PATTERNS
MODES = ("w4a16",)


def round_to_e2m1(a: Tensor) -> Tensor:
    """Non-negative ``a`` to the nearest E2M1 value; a tie goes to the value with an even last bit (verl's cuts)."""
    return torch.where(a <= 0.25, 0.0, torch.where(a < 0.75, 0.5, torch.where(a <= 1.25, 1.0, torch.where(
        a < 1.75, 1.5, torch.where(a <= 2.5, 2.0, torch.where(a < 3.5, 3.0, torch.where(a <= 5.0, 4.0, 6.0)))))))


def nvfp4_fake_quantize(weight: Tensor, global_amax: Tensor | None = None, group_size: int = 16) -> Tensor:
    """``weight`` quantized to NVFP4 and back (same shape and dtype); groups run along the last dimension.

    ``global_amax``: the magnitude the tensor scale is taken from (default: ``weight``'s largest); fused
    projections pass their shared one.
    """
    if weight.shape[-1] % group_size:
        raise ValueError(f"NVFP4: the last dimension ({weight.shape[-1]}) is not a multiple of the group size "
                         f"{group_size}")
    x = weight.detach().reshape(-1, group_size).float()
    amax = x.abs().max() if global_amax is None else global_amax.detach().float()
    global_scale = amax / (FP4_E2M1_MAX * FP8_E4M3_MAX)
    safe = torch.where(global_scale > 0.0, global_scale, 1e-12)
    block_max = x.abs().amax(dim=1, keepdim=True)
    scaled = torch.clamp(block_max / (FP4_E2M1_MAX * safe), max=FP8_E4M3_MAX)
    scale = scaled.to(torch.float8_e4m3fn).float() * global_scale
    scale = torch.where(scale >= 1e-5, scale, 1.0)
    value = round_to_e2m1(x.abs() / scale) * scale
    return torch.where(x >= 0, value, -value).reshape(weight.shape).to(weight.dtype)


class _StraightThrough(torch.autograd.Function):
    """The fake-quantized weight forward, the incoming gradient unchanged backward (verl's ``STEFP4QuantTriton``)."""

    @staticmethod
    def forward(ctx, weight: Tensor, global_amax: Tensor, group_size: int) -> Tensor:
        return nvfp4_fake_quantize(weight, global_amax, group_size)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None, None


def _amax(weight: Tensor) -> Tensor:
    """The largest magnitude of ``weight`` (an FSDP2 shard: of the whole tensor, one collective), float32."""
    amax = weight.detach().abs().amax()
    return (amax.full_tensor() if isinstance(amax, DTensor) else amax).float()


class NVFP4Linear(nn.Linear):
    """An ``nn.Linear`` whose forward uses its NVFP4 fake-quantized weight (see the module's docstring).

    Made by :func:`apply_qat` from an existing layer (its parameters kept as they are); ``fused`` holds the layers
    that share its tensor scale (itself included).
    """

    group_size: int = 16
    fused: tuple[nn.Module, ...] = ()
    compute_dtype: torch.dtype | None = None  # the weight's dtype in forward (FSDP2's param_dtype): set by rlflow's
    # FSDP2 strategy, and by each forward pass

    def global_amax(self) -> Tensor:
        """The magnitude the tensor scale comes from: the largest over the fused layers (itself alone if none)."""
        return torch.stack([_amax(m.weight).to(self.weight.device) for m in (self.fused or (self,))]).max()

    def forward(self, x: Tensor) -> Tensor:
        self.compute_dtype = self.weight.dtype
        with torch.no_grad():
            amax = self.global_amax().to(self.weight.dtype).float()  # of the weights as this pass sees them
        return F.linear(x, _StraightThrough.apply(self.weight, amax, self.group_size), self.bias)

    def served_weights(self) -> dict:
        """``{"weight": fn}``: ``fn(full weight)`` is the value this layer computes with (a rollout engine gets it)."""
        dtype, amax = self.compute_dtype, self.global_amax()

        def served(full: Tensor) -> Tensor:
            cast = full if dtype is None else full.to(dtype)
            return nvfp4_fake_quantize(cast, amax.to(cast.dtype).float(), self.group_size)
        return {"weight": served}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, nvfp4=w4a16, group_size={self.group_size}, fused={len(self.fused)}"


def ignored(name: str, patterns: Iterable[str]) -> bool:
    """verl's rule: ``re:<regex>`` matched at the start of ``name`` (``re.match``), anything else a substring."""
    return any(re.match(p[3:], name) if p.startswith("re:") else p in name for p in patterns)


def apply_qat(model: nn.Module, mode: str = "w4a16", group_size: int = 16,
              ignore_patterns: Iterable[str] = DEFAULT_IGNORE) -> list[str]:
    """Fake-quantize ``model``'s linear layers in place (see the module's docstring); returns their names.

    Each ``nn.Linear`` not ignored becomes an :class:`NVFP4Linear` (the same parameters, so an optimizer built
    before or after sees the same tensors); its fused siblings are linked.
    """
    if mode == "w4a4":
        raise ValueError("QAT mode 'w4a4' (4-bit activations as well) is not supported in rlflow: verl itself calls "
                         "it experimental, with KL-divergence problems; use mode='w4a16' (NVFP4 weights only)")
    if mode not in MODES:
        raise ValueError(f"QAT mode {mode!r}: unknown; rlflow has {MODES} (NVFP4 weights, 16-bit activations)")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"QAT group_size must be a positive integer (NVFP4's is 16), not {group_size!r}")
    patterns = list(ignore_patterns or ())
    names = [name for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and not ignored(name, patterns) and m.in_features % group_size == 0]
    layers = dict(model.named_modules())
    for name in names:
        layer = layers[name]
        if not isinstance(layer, NVFP4Linear):
            layer.plain_class = type(layer)
            layer.__class__ = NVFP4Linear
        layer.group_size = group_size
    link_fused(model)
    return names


def link_fused(model: nn.Module) -> None:
    """Give the ``q/k/v_proj`` of each attention and the ``gate/up_proj`` of each MLP one tensor scale (2 or more
    quantized siblings under one parent), as verl's ``setup_fusion_siblings``."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    for suffixes in FUSED:
        groups: dict[str, list[NVFP4Linear]] = {}
        for name, layer in layers.items():
            parent, _, leaf = name.rpartition(".")
            if leaf in suffixes:
                groups.setdefault(parent, []).append(layer)
        for members in groups.values():
            if len(members) >= 2:
                for layer in members:
                    layer.fused = tuple(members)


def quantized_layers(model: nn.Module) -> list[NVFP4Linear]:
    return [m for m in model.modules() if isinstance(m, NVFP4Linear)]


def plain_copy(model: nn.Module, served: bool = False) -> nn.Module:
    """A deep copy of ``model`` with plain linear layers again: the master weights (a KL reference: verl's
    reference is not quantized), or with ``served`` the fake-quantized ones (an engine's own copy)."""
    values = {id(m): m.served_weights()["weight"](m.weight.detach()) for m in quantized_layers(model)} if served else {}
    out = copy.deepcopy(model)
    for original, layer in zip(model.modules(), out.modules()):
        if isinstance(layer, NVFP4Linear):
            with torch.no_grad():
                if id(original) in values:
                    layer.weight.copy_(values[id(original)])
            layer.__class__ = layer.plain_class
            for attr in ("plain_class", "group_size", "fused", "compute_dtype"):
                layer.__dict__.pop(attr, None)
    return out
