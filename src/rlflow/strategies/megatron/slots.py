"""Hugging Face <-> Megatron weights: which block of which transformers tensor each Megatron parameter holds.

A :class:`Slot` is one transformers parameter (by its in-memory name, e.g.
``model.layers.3.self_attn.q_proj.weight``) as this rank holds it: its full shape, the dimension
split over a process group (tensor- or expert-parallel; ``None`` when every rank of that group holds
all of it), and how to read this rank's block from the Megatron parameters and write it back.
Blocks follow ``torch.chunk``'s split: rank ``r`` of ``n`` holds ``[r*c, min((r+1)*c, size))`` with
``c = ceil(size / n)`` (DTensor's ``Shard`` split too, so blocks are DTensor shards as they are).

The layouts Megatron uses and the blocks they give:

- fused ``linear_qkv``: per query group ``g``, the group's query heads, then its key head, then its
  value head; a rank holds whole groups, so its q, k and v blocks are row blocks of ``q_proj``,
  ``k_proj``, ``v_proj`` (transformers orders heads by group too);
- gated ``linear_fc1``: ``[gate block; up block]`` of the rank's columns -> row blocks of
  ``gate_proj`` and ``up_proj``; ``linear_proj``/``linear_fc2``: column blocks of ``o_proj``/``down_proj``;
- the vocabulary (embedding, output layer): rows padded to a multiple of the tensor-parallel size,
  the padding at the end of the last rank (never saved nor exported; written as zeros);
- experts (``SequentialMLP``, one expert whole per rank of its expert-parallel group): transformers >= 5
  stacks them (``mlp.experts.gate_up_proj`` ``E x 2I x H``, ``mlp.experts.down_proj`` ``E x H x I``), so
  a rank's experts are a block of rows of dimension 0.

``read``/``write`` take one tensor per Megatron parameter of the slot: the parameters themselves, or
their gradients or optimizer states (an optimizer state has its parameter's shape), so checkpoints
carry optimizer states in the same Hugging Face layout as the weights.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from rlflow.models.mimo import MTP_PREFIX
from rlflow.strategies.megatron.model import MegatronLM, architecture
from rlflow.strategies.megatron.vision import TOWER_PREFIX, hf_name

TENSOR, EXPERT = "tensor", "expert"  # the process groups a slot can be split over


@dataclass
class Slot:
    """One transformers parameter as this rank holds it (see the module docstring)."""

    name: str
    shape: tuple[int, ...]
    dim: int | None
    group: str | None
    params: tuple[nn.Parameter, ...]
    read: Callable[[list[Tensor]], Tensor]
    write: Callable[[list[Tensor], Tensor], None]
    primary: bool = True  # False: a copy held elsewhere too (the tied embedding on the last stage)
    # sizes of the parts along ``dim`` that are split separately (transformers' fused in_proj_qkv = q | k | v of
    # Qwen3.5's Gated DeltaNet): a rank's block is its chunk of each part, one after the other
    sections: tuple[int, ...] | None = None

    def bounds(self, rank: int, size: int) -> tuple[int, int]:
        """Start and length of rank ``rank``'s block along ``dim`` (``torch.chunk``'s split)."""
        if self.dim is None:
            return 0, self.shape[0] if self.shape else 0
        chunk = math.ceil(self.shape[self.dim] / size)
        start = min(rank * chunk, self.shape[self.dim])
        return start, min(chunk, self.shape[self.dim] - start)

    def block_of(self, full: Tensor, rank: int, size: int) -> Tensor:
        """This rank's block of the full tensor."""
        if self.dim is None:
            return full
        if self.sections:
            return torch.cat([part.chunk(size, self.dim)[rank] for part in full.split(self.sections, self.dim)],
                             self.dim)
        start, length = self.bounds(rank, size)
        return full.narrow(self.dim, start, length)

    def assemble(self, blocks: list[Tensor]) -> Tensor:
        """The full tensor from every rank's block, in rank order."""
        if not self.sections:
            return torch.cat(blocks, dim=self.dim)
        parts = [b.split([n // len(blocks) for n in self.sections], self.dim) for b in blocks]
        return torch.cat([torch.cat(same, self.dim) for same in zip(*parts)], self.dim)


def _same(name: str, param: nn.Parameter, full: tuple | None = None, dim: int | None = None,
          group: str | None = None) -> Slot:
    """The parameter is the block (replicated, or a plain row/column block)."""
    def write(t: list[Tensor], block: Tensor) -> None:
        t[0].copy_(block)

    return Slot(name, tuple(full or param.shape), dim, group, (param,), lambda t: t[0], write)


def _vocab(name: str, param: nn.Parameter, vocab: int, rows_here: int, primary: bool = True) -> Slot:
    def write(t: list[Tensor], block: Tensor) -> None:
        t[0][:rows_here].copy_(block)
        t[0][rows_here:].zero_()

    return Slot(name, (vocab, param.shape[1]), 0, TENSOR, (param,), lambda t: t[0][:rows_here], write, primary)


def _fused(names: list[str], param: nn.Parameter, full_rows: list[int], groups: int, parts: list[slice],
           unit: int) -> list[Slot]:
    """Slots for a parameter whose rows are ``groups`` repeats of ``[part 0 | part 1 | ...]`` (``unit`` rows per head).

    ``parts[i]`` selects part ``i``'s heads within a group (fused q/k/v: ``[:qpg]``, ``[qpg]``, ``[qpg+1]``).
    """
    rest = tuple(param.shape[1:])
    per_group = param.shape[0] // (groups * unit)

    def view(t: Tensor) -> Tensor:
        return t.view(groups, per_group, unit, *rest)

    slots = []
    for name, rows, part in zip(names, full_rows, parts):
        def read(t: list[Tensor], part=part) -> Tensor:
            return view(t[0])[:, part].reshape(-1, *rest)

        def write(t: list[Tensor], block: Tensor, part=part) -> None:
            target = view(t[0])[:, part]
            target.copy_(block.reshape(target.shape))

        slots.append(Slot(name, (rows, *rest), 0, TENSOR, (param,), read, write))
    return slots


def _stacked(name: str, params: list[nn.Parameter], experts: int) -> Slot:
    """Experts' parameters stacked along a new dimension 0 (split over the expert-parallel group)."""
    def write(t: list[Tensor], block: Tensor) -> None:
        for target, source in zip(t, block):
            target.copy_(source)

    return Slot(name, (experts, *params[0].shape), 0, EXPERT, tuple(params), lambda t: torch.stack(t), write)


def _norm_weight(module: nn.Module, fused_owner: nn.Module) -> nn.Parameter:
    """A norm's weight: its own module (local spec) or fused into the next linear (Transformer-Engine spec)."""
    weight = getattr(fused_owner, "layer_norm_weight", None)
    return weight if weight is not None else module.weight


def _attention(pre: str, attn: nn.Module, arch, config, groups: int, qpg: int) -> list[Slot]:
    """Self-attention: fused ``linear_qkv`` (per query group: its query heads, [their output gates,] its key and
    value head), q/k norms, ``linear_proj``."""
    nq, d = config.num_attention_heads, config.kv_channels
    H, nkv = config.hidden_size, nq // qpg
    names = [pre + f"{p}_proj." for p in "qkv"]
    rows = [nq * d, nkv * d, nkv * d]
    gate = qpg if config.attention_output_gate else 0
    parts = [slice(0, qpg), slice(qpg + gate, qpg + gate + 1), slice(qpg + gate + 1, qpg + gate + 2)]
    if gate:  # Qwen3.5: transformers' q_proj holds each head's queries, then that head's output gate
        slots = [_gated_query(names[0] + "weight", attn.linear_qkv.weight, nq * d, groups, qpg, d)]
        slots += _fused([n + "weight" for n in names[1:]], attn.linear_qkv.weight, rows[1:], groups, parts[1:], d)
    else:
        slots = _fused([n + "weight" for n in names], attn.linear_qkv.weight, rows, groups, parts, d)
    if arch.qkv_bias:
        slots += _fused([n + "bias" for n in names], attn.linear_qkv.bias, rows, groups, parts, d)
    if arch.qk_norm:
        slots += [_same(pre + "q_norm.weight", attn.q_layernorm.weight),
                  _same(pre + "k_norm.weight", attn.k_layernorm.weight)]
    slots.append(_same(pre + "o_proj.weight", attn.linear_proj.weight, (H, nq * d), 1, TENSOR))
    return slots


def _gated_query(name: str, param: nn.Parameter, rows: int, groups: int, qpg: int, d: int) -> Slot:
    """transformers' ``q_proj`` of gated attention, ``[q_h; gate_h]`` per head ``h`` (``2 * rows`` rows), against
    Megatron's ``linear_qkv`` rows, per query group ``[q heads; gate heads; k; v]``."""
    rest = tuple(param.shape[1:])

    def heads(t: Tensor) -> Tensor:  # groups x (q, gate) x qpg x d x ...
        return t.view(groups, 2 * qpg + 2, d, *rest)[:, : 2 * qpg].unflatten(1, (2, qpg))

    def read(t: list[Tensor]) -> Tensor:
        return heads(t[0]).transpose(1, 2).reshape(-1, *rest)

    def write(t: list[Tensor], block: Tensor) -> None:
        target = heads(t[0])
        target.copy_(block.reshape(groups, qpg, 2, d, *rest).transpose(1, 2))

    return Slot(name, (2 * rows, *rest), 0, TENSOR, (param,), read, write)


def _rows(names: list[str], param: nn.Parameter, full_rows: list[int], tp: int,
          sections: dict[str, tuple[int, ...]] | None = None) -> list[Slot]:
    """Slots for a parameter whose rows are this rank's row blocks of ``names``, one after the other (``sections``:
    of a name whose parts are split separately)."""
    rest, slots, start = tuple(param.shape[1:]), [], 0
    for name, rows in zip(names, full_rows):
        def read(t: list[Tensor], start=start, n=rows // tp) -> Tensor:
            return t[0].narrow(0, start, n)

        def write(t: list[Tensor], block: Tensor, start=start, n=rows // tp) -> None:
            t[0].narrow(0, start, n).copy_(block)

        slots.append(Slot(name, (rows, *rest), 0, TENSOR, (param,), read, write,
                          sections=(sections or {}).get(name)))
        start += rows // tp
    return slots


def _gated_delta_net(pre: str, gdn: nn.Module, cfg, tp: int) -> list[Slot]:
    """Megatron's GatedDeltaNet against transformers' ``linear_attn``: ``in_proj`` is ``in_proj_qkv | in_proj_z |
    in_proj_b | in_proj_a``, ``conv1d`` and ``in_proj_qkv`` are ``q | k | v``. On ``tp`` ranks each rank holds
    ``q_r | k_r | v_r`` of transformers' fused ``in_proj_qkv``/``conv1d``: sectioned slots."""
    z, heads = cfg.linear_value_head_dim * cfg.linear_num_value_heads, cfg.linear_num_value_heads
    qk = cfg.linear_key_head_dim * cfg.linear_num_key_heads
    qkv = 2 * qk + z
    sections = {pre + "in_proj_qkv.weight": (qk, qk, z), pre + "conv1d.weight": (qk, qk, z)}
    slots = _rows([pre + f"in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")], gdn.in_proj.weight,
                  [qkv, z, heads, heads], tp, sections)
    slots += _rows([pre + "conv1d.weight"], gdn.conv1d.weight, [qkv], tp, sections)
    slots += [_same(pre + "dt_bias", gdn.dt_bias, (heads,), 0, TENSOR),
              _same(pre + "A_log", gdn.A_log, (heads,), 0, TENSOR), _same(pre + "norm.weight", gdn.out_norm.weight),
              _same(pre + "out_proj.weight", gdn.out_proj.weight, (cfg.hidden_size, z), 1, TENSOR)]
    return slots


def _layer_slots(lm: MegatronLM, pre: str, layer: nn.Module) -> list[Slot]:
    """The slots of one decoder layer (a ``TransformerLayer``) under the transformers prefix ``pre``."""
    cfg, tp = lm.hf_config, lm.tp_size
    arch = architecture(cfg)
    H, nq = cfg.hidden_size, cfg.num_attention_heads
    nkv = getattr(cfg, "num_key_value_heads", None) or nq
    qpg, groups = nq // nkv, nkv // tp
    slots = []
    attn = layer.self_attention
    if hasattr(attn, "in_proj"):  # Qwen3.5's Gated DeltaNet layers (strategies/megatron/qwen3_5.py)
        slots.append(_same(pre + "input_layernorm.weight", layer.input_layernorm.weight))
        slots += _gated_delta_net(pre + "linear_attn.", attn, cfg, tp)
    else:
        slots.append(_same(pre + "input_layernorm.weight", _norm_weight(layer.input_layernorm, attn.linear_qkv)))
        slots += _attention(pre + "self_attn.", attn, arch, lm.config, groups, qpg)
    mlp = layer.mlp
    slots.append(_same(pre + "post_attention_layernorm.weight",
                       _norm_weight(layer.pre_mlp_layernorm, getattr(mlp, "linear_fc1", None))))
    if arch.moe:
        experts, E = mlp.experts.local_experts, cfg.num_experts
        slots += [_same(pre + "mlp.gate.weight", mlp.router.weight),
                  _stacked(pre + "mlp.experts.gate_up_proj", [e.linear_fc1.weight for e in experts], E),
                  _stacked(pre + "mlp.experts.down_proj", [e.linear_fc2.weight for e in experts], E)]
        if mlp.shared_experts is not None:  # Qwen3.5-MoE: a shared expert with a sigmoid gate
            shared = cfg.shared_expert_intermediate_size
            slots += _fused([pre + "mlp.shared_expert.gate_proj.weight", pre + "mlp.shared_expert.up_proj.weight"],
                            mlp.shared_experts.linear_fc1.weight, [shared, shared], 1, [slice(0, 1), slice(1, 2)],
                            shared // tp)
            slots += [_same(pre + "mlp.shared_expert.down_proj.weight", mlp.shared_experts.linear_fc2.weight,
                            (H, shared), 1, TENSOR),
                      _same(pre + "mlp.shared_expert_gate.weight", mlp.shared_experts.gate_weight)]
    else:
        ffn = cfg.intermediate_size
        slots += _fused([pre + "mlp.gate_proj.weight", pre + "mlp.up_proj.weight"], mlp.linear_fc1.weight,
                        [ffn, ffn], 1, [slice(0, 1), slice(1, 2)], ffn // tp)
        slots.append(_same(pre + "mlp.down_proj.weight", mlp.linear_fc2.weight, (H, ffn), 1, TENSOR))
    return slots


def lm_slots(lm: MegatronLM) -> list[Slot]:
    """Every transformers parameter this rank holds a block of, in the model's order."""
    cfg, gpt = lm.hf_config, lm.gpt
    slots = []
    if lm.first_stage:
        slots.append(_vocab("model.embed_tokens.weight", gpt.embedding.word_embeddings.weight, lm.vocab_size,
                            lm.vocab_local))
    for layer in gpt.decoder.layers:
        slots += _layer_slots(lm, f"model.layers.{layer.layer_number - 1}.", layer)
    if lm.last_stage:
        slots.append(_same("model.norm.weight", gpt.decoder.final_layernorm.weight))
        if not cfg.tie_word_embeddings:
            slots.append(_vocab("lm_head.weight", gpt.output_layer.weight, lm.vocab_size, lm.vocab_local))
        elif not lm.first_stage:  # the last stage's copy of the tied embedding
            slots.append(_vocab("model.embed_tokens.weight", gpt.output_layer.weight, lm.vocab_size, lm.vocab_local,
                                primary=False))
    slots += mtp_slots(lm)
    for adapter in getattr(lm, "lora", ()):  # LoRA factors (.lora.LinearLoRA), under PEFT's names
        slots += adapter.slots()
    if lm.vision is None:
        return slots
    # a vision-language model (.vision): the language model's weights under its names there, the tower's whole
    slots = [dataclasses.replace(s, name=hf_name(s.name, True)) for s in slots]
    tower = lm.vision.tower
    return slots + ([_same(TOWER_PREFIX + n, p) for n, p in tower.named_parameters()] if tower is not None else [])


def _swapped_halves(name: str, param: nn.Parameter, H: int) -> Slot:
    """MiMo's ``input_proj`` (``H x 2H`` over ``[hidden states | token embeddings]``) as megatron-core's ``eh_proj``
    (over ``[embeddings | hidden states]``): the two column halves swap; rows split over the tensor-parallel ranks."""
    def swap(t: Tensor) -> Tensor:
        return torch.cat([t[:, H:], t[:, :H]], dim=1)

    def write(t: list[Tensor], block: Tensor) -> None:
        t[0].copy_(swap(block))

    return Slot(name, (H, 2 * H), 0, TENSOR, (param,), lambda t: swap(t[0]), write)


def mtp_slots(lm: MegatronLM) -> list[Slot]:
    """megatron-core's MTP layers under MiMo's names (``model.mtp_layers.{k}.``, :mod:`rlflow.models.mimo`): its
    norms of the token embeddings (``enorm``) and hidden states (``hnorm``), their projection, a decoder layer and the
    final norm. Empty without an MTP block."""
    mtp = getattr(lm.gpt, "mtp", None)
    if mtp is None:
        return []
    H, slots = lm.hf_config.hidden_size, []
    for k, layer in enumerate(mtp.layers):
        pre = f"{MTP_PREFIX}{k}."
        slots += [_same(pre + "token_layernorm.weight", layer.enorm.weight),
                  _same(pre + "hidden_layernorm.weight", layer.hnorm.weight),
                  _swapped_halves(pre + "input_proj.weight", layer.eh_proj.weight, H)]
        slots += _layer_slots(lm, pre, layer.transformer_layer)
        slots.append(_same(pre + "final_layernorm.weight", layer.final_layernorm.weight))
    return slots


def module_slots(module: nn.Module) -> list[tuple[str, Slot]]:
    """``(checkpoint key, slot)`` for a :mod:`.heads` module: the Hugging Face model's weights under
    ``state_prefix`` (as ``TokenLogProbs``/``ValueHeadModel`` name them), and a critic's value head.

    A tied embedding is also keyed ``lm_head.weight``, as the state dicts of ``torch.distributed.checkpoint``
    (FSDP2, one process) name it too, so those checkpoints and these load each other."""
    slots = lm_slots(module.lm)
    if module.lm.hf_config.tie_word_embeddings:
        embedding = hf_name("model.embed_tokens.weight", module.lm.vision is not None)
        slots += [dataclasses.replace(s, name="lm_head.weight") for s in slots if s.name == embedding]
    keyed = [(module.state_prefix + s.name, s) for s in slots]
    head = getattr(module, "value_head", None)
    if head is not None:
        keyed += [(f"value_head.{n}", _same(f"value_head.{n}", p)) for n, p in head.named_parameters()]
    return keyed


def group_ranks(slot: Slot) -> tuple[int, int]:
    """(rank, size) of this process in the group ``slot`` is split over."""
    from megatron.core import parallel_state as ps

    if slot.group == TENSOR:
        return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    if slot.group == EXPERT:
        return ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()
    return 0, 1


def mark_split_parameters(slots: list[Slot]) -> None:
    """Tag the parameters split over the tensor-parallel ranks (``split_over_tensor_parallel``), for the
    gradient norm. (Megatron sets its own ``tensor_model_parallel`` tag only when it initialises the
    weights, which rlflow skips: they are copied from the Hugging Face model.)"""
    for slot in slots:
        if slot.group == TENSOR and slot.dim is not None:
            for p in slot.params:
                p.split_over_tensor_parallel = True


def check_coverage(module: nn.Module, slots: list[tuple[str, Slot]]) -> None:
    """Every trainable Megatron parameter belongs to some slot (else a weight would never be loaded)."""
    covered = {id(p) for _, s in slots for p in s.params}
    missing = [n for n, p in module.named_parameters() if id(p) not in covered]
    if missing:
        raise RuntimeError(f"Megatron parameters without a Hugging Face counterpart: {missing[:5]}")


@torch.no_grad()
def load_from_hf(slots: list[tuple[str, Slot]], hf_state: dict[str, Tensor]) -> None:
    """Copy every slot's block from ``hf_state`` (transformers' ``state_dict()``, full tensors)."""
    for _, slot in slots:
        full = hf_state.get(slot.name)
        if full is None:
            raise KeyError(f"the Hugging Face model has no weight {slot.name!r} (its keys: {sorted(hf_state)[:4]}...)")
        if tuple(full.shape) != slot.shape:
            raise ValueError(f"{slot.name}: the Hugging Face tensor is {tuple(full.shape)}, Megatron expects "
                             f"{slot.shape}")
        slot.write([p.data for p in slot.params], slot.block_of(full, *group_ranks(slot)).to(slot.params[0].dtype))
