"""LoRA on megatron-core's tensor-parallel linear layers, from (and equal to) a PEFT LoRA policy.

A LoRA policy (``Policy(model, lora=...)``, a ``peft.PeftModel``) set up by the Megatron strategy keeps its
base weights in Megatron's fused layers and its adapters beside them, one :class:`LinearLoRA` per adapted
Megatron layer. Each adapted Hugging Face projection ``y = x W^T + s (x A^T) B^T`` keeps its own ``A`` and ``B``
(PEFT's per-projection adapters; ``s = alpha / r``, rsLoRA's ``alpha / sqrt(r)``), split so that tensor
parallelism is exact:

- **column-parallel** layers (``linear_qkv`` = q/k/v, ``linear_fc1`` = gate/up): the input is whole on every
  rank; ``A`` (``r x in``) is replicated and ``B``'s rows are split as the weight's are (rank ``t`` holds the
  rows of its query groups / its block of the MLP). ``h = x A^T`` passes Megatron's
  ``copy_to_tensor_model_parallel_region`` (forward identity, backward all-reduce), so ``dA`` and ``dx`` are
  whole on every rank. The rank's ``s h B_t^T`` is placed at its part's rows of the fused output.
- **row-parallel** layers (``linear_proj`` = o, ``linear_fc2`` = down): the input is split over the ranks;
  ``A``'s columns are split as the weight's are, ``h = sum_t x_t A_t^T`` is one
  ``reduce_from_tensor_model_parallel_region`` (forward all-reduce, backward identity), and ``B``
  (``out x r``) is replicated. ``dB`` is whole on every rank, ``dA_t`` is rank ``t``'s block.

The adapters run as forward hooks on Megatron's layers (its module tree, specs and checkpoints stay as they
are); they are off while the PEFT layer they come from is disabled (``PeftModel.disable_adapter()``: the KL
reference, :class:`~rlflow.models.policy.AdapterDisabledReference`, is the base model, as on one process).
Their factors are :class:`~rlflow.strategies.megatron.slots.Slot` s under PEFT's names (checkpoints), and the
weights sent to generation engines are merged, ``W + s B A``, per rank's block before they are gathered.
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import Tensor, nn

from rlflow.strategies.megatron import qwen3_5
from rlflow.strategies.megatron.model import MegatronLM, architecture, head_dim
from rlflow.strategies.megatron.slots import TENSOR, Slot, _same
from rlflow.strategies.megatron.vision import is_vision_language

# Hugging Face projection -> (Megatron layer under the decoder layer, column- or row-parallel)
TARGETS = {"q_proj": ("self_attention.linear_qkv", "column"), "k_proj": ("self_attention.linear_qkv", "column"),
           "v_proj": ("self_attention.linear_qkv", "column"), "o_proj": ("self_attention.linear_proj", "row"),
           "gate_proj": ("mlp.linear_fc1", "column"), "up_proj": ("mlp.linear_fc1", "column"),
           "down_proj": ("mlp.linear_fc2", "row")}
_NAME = re.compile(r"model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)$")


@dataclasses.dataclass
class Part:
    """One adapted Hugging Face projection inside a Megatron layer."""

    peft_name: str      # the PEFT module, e.g. base_model.model.model.layers.0.self_attn.q_proj
    hf_weight: str      # its base weight's transformers name
    peft_layer: nn.Module
    scaling: float
    full_a: tuple[int, int]
    full_b: tuple[int, int]


class LinearLoRA(nn.Module):
    """The adapters of one Megatron linear layer (see the module docstring).

    ``fused`` describes the column-parallel output: ``(groups, heads per group, rows per head)`` and each
    part's slice of a group's heads, as :func:`~rlflow.strategies.megatron.slots._fused` reads the weight.
    """

    def __init__(self, kind: str, parts: dict[str, Part], fused: tuple[int, int, int, dict[str, slice]] | None,
                 tp_rank: int, tp_size: int, adapter: str):
        super().__init__()
        self.kind, self.parts, self.fused, self.adapter = kind, parts, fused, adapter
        self.A, self.B = nn.ParameterDict(), nn.ParameterDict()
        for key, part in parts.items():
            (r, n_in), (n_out, _) = part.full_a, part.full_b
            if kind == "column":
                a, b = (r, n_in), (_block(n_out, tp_rank, tp_size), r)
            else:
                a, b = (r, _block(n_in, tp_rank, tp_size)), (n_out, r)
            self.A[key] = nn.Parameter(torch.zeros(a))
            self.B[key] = nn.Parameter(torch.zeros(b))

    def active(self) -> list[str]:
        return [k for k, p in self.parts.items() if not p.peft_layer.disable_adapters]

    def hook(self, _module, args, output):
        """Megatron's ``(output, bias)`` with the active adapters' terms added to ``output``."""
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region as copy_to,
                                                            reduce_from_tensor_model_parallel_region as reduce_sum)

        active = self.active()
        if not active:
            return output
        x, (y, bias) = args[0], output
        if self.kind == "row":
            (key,) = active
            h = reduce_sum(x @ self.A[key].T.to(x.dtype))
            return y + self.parts[key].scaling * (h @ self.B[key].T.to(x.dtype)), bias
        groups, per_group, unit, slices = self.fused
        pieces = []
        for key, part in slices.items():
            width = part.stop - part.start
            if key in active:
                h = copy_to(x @ self.A[key].T.to(x.dtype))
                delta = self.parts[key].scaling * (h @ self.B[key].T.to(x.dtype))
                pieces.append(delta.view(*x.shape[:-1], groups, width, unit))
            else:
                pieces.append(x.new_zeros(*x.shape[:-1], groups, width, unit))
        return y + torch.cat(pieces, dim=-2).reshape(y.shape), bias

    def slots(self) -> list[Slot]:
        """The factors under PEFT's names: ``A`` whole and ``B``'s rows split (column), or the reverse (row)."""
        out = []
        for key, part in self.parts.items():
            a, b = (f"{part.peft_name}.lora_{x}.{self.adapter}.weight" for x in "AB")
            if self.kind == "column":
                out += [_same(a, self.A[key]), _same(b, self.B[key], part.full_b, 0, TENSOR)]
            else:
                out += [_same(a, self.A[key], part.full_a, 1, TENSOR), _same(b, self.B[key])]
        return out

    def merged(self, slot: Slot) -> Slot | None:
        """``slot`` (a base weight) read as ``W + s B A`` on this rank's block, if one of the parts adapts it."""
        key = next((k for k, p in self.parts.items() if p.hf_weight == slot.name), None)
        if key is None:
            return None
        part, A, B = self.parts[key], self.A[key], self.B[key]

        def read(t: list[Tensor]) -> Tensor:
            block = slot.read(t)
            return block + (part.scaling * (B.detach() @ A.detach())).to(block.dtype)

        return dataclasses.replace(slot, read=read)


def _block(n: int, rank: int, size: int) -> int:
    chunk = -(-n // size)
    return max(0, min(chunk, n - rank * chunk))


def peft_parts(peft_model) -> tuple[str, dict[tuple[int, str], dict[str, Part]]]:
    """The PEFT model's adapted projections, by (layer index, Megatron layer), checked for what this supports."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    adapter = peft_model.active_adapter
    config = peft_model.peft_config[adapter]
    if getattr(config, "modules_to_save", None):
        raise ValueError(f"LoRA under the Megatron strategy: modules_to_save={config.modules_to_save} (fully trained "
                         "modules beside the adapter) is not supported; train them with strategy='fsdp2'")
    found: dict[tuple[int, str], dict[str, Part]] = {}
    for name, module in peft_model.named_modules():
        if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
            continue
        hf = name.removeprefix("base_model.model.")
        match = _NAME.fullmatch(hf)
        if match is None or match.group(2) not in TARGETS:
            raise ValueError(f"LoRA under the Megatron strategy adapts q/k/v/o_proj and the dense MLP's "
                             f"gate/up/down_proj; {hf!r} is not one of them: leave it out of target_modules")
        problems = [what for what, bad in (
            ("not a Linear layer", not isinstance(module, LoraLinear)),
            ("DoRA (use_dora)", bool(module.use_dora.get(adapter))),
            ("lora_bias", bool(module.lora_bias.get(adapter))),
            ("lora_dropout > 0 (each rank would drop other entries)",
             not isinstance(module.lora_dropout[adapter], nn.Identity)),
            ("fan_in_fan_out", bool(getattr(module, "fan_in_fan_out", False)))) if bad]
        if problems:
            raise ValueError(f"LoRA under the Megatron strategy: {hf} has {', '.join(problems)}, which it does not "
                             "support")
        a, b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
        layer, proj = int(match.group(1)), match.group(2)
        found.setdefault((layer, TARGETS[proj][0]), {})[proj] = Part(
            name, f"{hf}.weight", module, float(module.scaling[adapter]), tuple(a.shape), tuple(b.shape))
    return adapter, found


def check_targets(config, target_modules) -> None:
    """A clear error, before anything is built, for targets this does not adapt on ``config``'s model: a MoE
    model's MLPs are its routed experts (and PEFT's ``all-linear`` includes its router); Qwen3.5's layers are not
    adapted, nor a vision-language model."""
    if is_vision_language(config):
        raise ValueError(f"LoRA under the Megatron strategy does not adapt a vision-language model "
                         f"({config.model_type}): its adapters are not attached to the converted language model and "
                         "the vision tower together; train it without LoRA, or with LoRA under FSDP")
    if qwen3_5.is_hybrid(config):
        raise ValueError("LoRA under the Megatron strategy does not adapt Qwen3.5 (qwen3_5_text): its gated q_proj and "
                         "Gated DeltaNet projections have no adapter layout here; train it without LoRA, or with LoRA "
                         "under FSDP")
    if not architecture(config).moe:
        return
    targets = {target_modules} if isinstance(target_modules, str) else set(target_modules or ())
    mlp = sorted(targets & {"gate_proj", "up_proj", "down_proj", "all-linear", "gate", "experts"})
    if mlp:
        raise ValueError(f"LoRA under the Megatron strategy on a MoE model ({config.model_type}) adapts the attention "
                         f"(q/k/v/o_proj, Megatron's linear_qkv and linear_proj), not the routed experts or the router "
                         f"({mlp} in target_modules)")


def attach(lm: MegatronLM, peft_model) -> nn.ModuleList:
    """Adapters on this rank's Megatron layers for every adapted projection of ``peft_model`` (zeros; load their
    factors with :func:`~rlflow.strategies.megatron.slots.load_from_hf`). Returns them as ``lm.lora``."""
    if lm.config.sequence_parallel:
        raise ValueError("LoRA under the Megatron strategy does not combine with sequence_parallel")
    adapter, found = peft_parts(peft_model)
    cfg = lm.hf_config
    check_targets(cfg, peft_model.peft_config[adapter].target_modules)
    nq = cfg.num_attention_heads
    nkv = getattr(cfg, "num_key_value_heads", None) or nq
    qpg = nq // nkv
    fused = {"self_attention.linear_qkv": (nkv // lm.tp_size, qpg + 2, head_dim(cfg), {
                 "q_proj": slice(0, qpg), "k_proj": slice(qpg, qpg + 1), "v_proj": slice(qpg + 1, qpg + 2)}),
             "mlp.linear_fc1": (1, 2, cfg.intermediate_size // lm.tp_size, {
                 "gate_proj": slice(0, 1), "up_proj": slice(1, 2)})}
    adapters = nn.ModuleList()
    for layer in lm.gpt.decoder.layers:  # this pipeline stage's
        for target in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"):
            parts = found.get((layer.layer_number - 1, target))
            if not parts:
                continue
            linear = layer.get_submodule(target)
            if type(linear).__name__.startswith("TE"):
                raise ValueError("LoRA under the Megatron strategy needs layer_spec='local' (the Transformer-Engine "
                                 "layers fuse the norm into linear_qkv / linear_fc1)")
            kind = TARGETS[next(iter(parts))][1]
            lora = LinearLoRA(kind, parts, fused.get(target), lm.tp_rank, lm.tp_size, adapter)
            lora.to(linear.weight.device)
            linear.register_forward_hook(lora.hook)
            adapters.append(lora)
    lm.lora = adapters
    return adapters


def export_slots(slots: list[Slot], adapters: nn.ModuleList) -> tuple[list[Slot], set[str]]:
    """The slots a generation engine receives: base weights merged with their adapters, without the factors;
    and the names of the merged ones (what changes when the adapter trains)."""
    factors = {s.name for a in adapters for s in a.slots()}
    out, adapted = [], set()
    for slot in slots:
        if slot.name in factors:
            continue
        merged = next((m for a in adapters if (m := a.merged(slot)) is not None), None)
        if merged is not None:
            adapted.add(slot.name)
        out.append(merged or slot)
    return out, adapted


def base_state(peft_model) -> dict[str, Tensor]:
    """The PEFT model's state dict with its base weights under transformers' names and its factors under PEFT's."""
    state = {}
    for name, tensor in peft_model.state_dict().items():
        state[name if ".lora_" in name else name.removeprefix("base_model.model.").replace(".base_layer.", ".")] = tensor
    return state
