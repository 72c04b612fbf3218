"""Ulysses sequence parallelism: one long packed batch split along the sequence over a process group.

Each of the ``P`` ranks of a sequence-parallel group holds the same packed batch
(``rlflow.models.packing``) and runs the backbone on its ``1/P`` slice of every
row. Everything but attention is per token, so it runs on the slice as is. In
attention, one all-to-all turns "my tokens, all heads" into "all tokens, my
``H/P`` heads" (DeepSpeed-Ulysses, arXiv 2309.14509); each rank attends over
the whole sequence for its heads, and a second all-to-all turns the result back.
Activation memory per rank is ``1/P`` of the sequence; attention keeps its exact
result.

Attention plugs in through transformers' ``AttentionInterface``: :func:`enable`
registers ``ulysses+<impl>`` for the model's implementation and switches the
model to it. Outside :func:`sequence_parallel_forward` the new name runs the
original implementation unchanged (the rollout may share the model), inside it
runs the all-to-all path above with PyTorch's ``scaled_dot_product_attention``
and a block-diagonal causal mask built from the packed ``position_ids``.

The scored positions (those predicting response tokens) are computed where they
live; their outputs (log-probs and entropy, or values) are gathered so that every
rank of the group returns the full ``N`` values, as without parallelism. The
gather's backward keeps the local share only: every rank computes the same loss,
so summing the ranks' parameter gradients (which data-parallel averaging over
the ``P`` ranks does, up to the factor the Trainer puts into its normaliser) gives
the gradient of one copy of the loss.

Requirements: padding removal (packed input), ``num_attention_heads`` divisible by
``P`` (key/value heads are repeated when their number is not). Works with gloo
(CPU) and NCCL; tested with 2 CPU processes.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from rlflow.models.checks import activation_checkpointing, enable_activation_checkpointing

if TYPE_CHECKING:
    from rlflow.models.packing import Packed  # only a type here: packing calls into this module

PREFIX = "ulysses+"
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("rlflow_ulysses", default=None)


class _AllToAll(torch.autograd.Function):
    """``out[j] = in_j[rank]`` over dim 0 (size ``P``); its own adjoint, so the backward is the same exchange."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class _GatherRows(torch.autograd.Function):
    """Concatenate every rank's rows (``counts[j]`` from rank j); the backward returns this rank's rows' gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, counts: list[int], group) -> Tensor:
        rank = dist.get_rank(group)
        ctx.start, ctx.count = sum(counts[:rank]), counts[rank]
        most = max(counts)
        padded = x.new_zeros((most, *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([p[:c] for p, c in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad[ctx.start : ctx.start + ctx.count], None, None


def _seq_to_heads(x: Tensor, group, size: int) -> Tensor:
    """``B x H x S/P x D`` (all heads, my tokens) -> ``B x H/P x S x D`` (my heads, all tokens)."""
    B, H, s, D = x.shape
    x = x.reshape(B, size, H // size, s, D).transpose(0, 1)  # P x B x H/P x s x D: chunk j goes to rank j
    x = _AllToAll.apply(x, group)  # chunk j came from rank j: its tokens
    return x.permute(1, 2, 0, 3, 4).reshape(B, H // size, size * s, D)


def _heads_to_seq(x: Tensor, group, size: int) -> Tensor:
    """The inverse: ``B x H/P x S x D`` -> ``B x H x S/P x D``."""
    B, h, S, D = x.shape
    x = x.reshape(B, h, size, S // size, D).permute(2, 0, 1, 3, 4)  # P x B x H/P x s x D: token chunk j to rank j
    x = _AllToAll.apply(x, group)  # chunk j came from rank j: its heads
    return x.transpose(0, 1).reshape(B, size * h, S // size, D)


def block_causal_mask(position_ids: Tensor) -> Tensor:
    """``B x 1 x S x S`` boolean: token i sees token j when both are in the same packed sequence and j <= i.

    A sequence starts where its position id is 0 (``rlflow.models.packing`` restarts them per sequence).
    """
    seq = (position_ids == 0).long().cumsum(-1)
    same = seq[:, :, None] == seq[:, None, :]
    S = position_ids.shape[-1]
    causal = torch.ones(S, S, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal)[:, None]


def _ulysses_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, dropout: float,
                       scaling: float | None, state: dict) -> tuple[Tensor, None]:
    group, size = state["group"], state["size"]
    Hq, Hkv = query.shape[1], key.shape[1]
    if Hkv % size:  # too few key/value heads to split: repeat them to the query heads
        key, value = key.repeat_interleave(Hq // Hkv, dim=1), value.repeat_interleave(Hq // Hkv, dim=1)
        Hkv = Hq
    # one exchange for q, k and v: per destination rank, its query heads then its key and value heads
    q, k, v = (t.reshape(t.shape[0], size, t.shape[1] // size, *t.shape[2:]) for t in (query, key, value))
    qkv = torch.cat([q, k, v], dim=2).flatten(1, 2)
    qkv = _seq_to_heads(qkv, group, size)
    q, k, v = qkv.split([Hq // size, Hkv // size, Hkv // size], dim=1)
    if "mask" not in state:  # built once per forward, shared by the layers; None: plain causal is exact
        state["mask"] = None if state["causal"] else block_causal_mask(state["position_ids"])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=state["mask"], dropout_p=dropout, scale=scaling,
                                         is_causal=state["mask"] is None, enable_gqa=Hq != Hkv)
    out = _heads_to_seq(out, group, size)
    return out.transpose(1, 2).contiguous(), None


def enable(model: nn.Module) -> None:
    """Switch ``model`` (a transformers model) to ``ulysses+<its attention implementation>``; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = model.config
    current = config._attn_implementation or "sdpa"
    if current.startswith(PREFIX):
        return
    name = PREFIX + current
    original = ALL_ATTENTION_FUNCTIONS[current] if current != "eager" else None

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        state = _ACTIVE.get()
        if state is not None:
            return _ulysses_attention(module, query, key, value, dropout, scaling, state)
        if original is None:  # "eager" lives in each model file
            import importlib

            eager = importlib.import_module(type(module).__module__).eager_attention_forward
            return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)

    keep_through_checkpointing(model)
    AttentionInterface.register(name, attention)
    if current in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[current])
    for sub in model.modules():  # every sub-model's config (e.g. the decoder's) names the implementation
        sub_config = getattr(sub, "config", None)
        if sub_config is not None and getattr(sub_config, "_attn_implementation", None) == current:
            sub_config._attn_implementation = name


def check_heads(model: nn.Module, size: int) -> None:
    """Raise unless the attention heads split evenly over ``size`` ranks."""
    heads = model.config.num_attention_heads
    if heads % size:
        raise ValueError(f"sequence parallelism over {size} ranks needs num_attention_heads ({heads}) divisible by {size}")


@contextlib.contextmanager
def _active(group, size: int, position_ids: Tensor, causal: bool):
    with _restored({"group": group, "size": size, "position_ids": position_ids, "causal": causal}):
        yield


@contextlib.contextmanager
def _restored(state: dict | None):
    token = _ACTIVE.set(state)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def checkpoint_context():
    """``context_fn`` for ``torch.utils.checkpoint``: a layer recomputed in the backward pass (after the
    forward's context has ended) runs with the sequence-parallel state it was first run with."""
    return contextlib.nullcontext(), _restored(_ACTIVE.get())


def keep_through_checkpointing(model: nn.Module) -> None:
    """Re-enable a model's gradient checkpointing with :func:`checkpoint_context` (a no-op when it is off)."""
    if activation_checkpointing(model):
        enable_activation_checkpointing(model, {"use_reentrant": False, "context_fn": checkpoint_context})


def sequence_parallel_outputs(lm: nn.Module, packed: Packed, fn: Callable[[Tensor, Tensor], Tensor], group) -> Tensor:
    """Run the backbone on this rank's slice of ``packed`` and return ``fn``'s outputs at all ``N`` scored positions.

    ``fn(hidden, index)`` maps the hidden states of some scored positions (``n x H``) and their indices into
    the ``N`` scored positions to ``n x K`` outputs; the result is ``N x K``, in ``packed.src`` order, on every rank.
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    rows, L = packed.input_ids.shape
    S = math.ceil(L / size)
    pad = S * size - L
    ids, pos = packed.input_ids, packed.position_ids
    if pad:  # the extra tail is a sequence of its own (positions from 0), never scored
        ids = F.pad(ids, (0, pad))
        pos = torch.cat([pos, torch.arange(pad, device=pos.device).expand(rows, pad)], dim=1)
    row, col = packed.src // L, packed.src % L
    with _active(group, size, pos, _one_sequence_per_row(pos, row, col)):
        out = lm.get_decoder()(input_ids=ids[:, rank * S : (rank + 1) * S], attention_mask=None,
                               position_ids=pos[:, rank * S : (rank + 1) * S], use_cache=False)
    hidden = out.last_hidden_state  # rows x S x H
    owner = col // S
    mine = (owner == rank).nonzero().squeeze(-1)
    local = fn(hidden[row[mine], col[mine] - rank * S], mine)
    counts = torch.bincount(owner, minlength=size).tolist()
    gathered = _GatherRows.apply(local, counts, group)  # rank 0's rows, then rank 1's, ...
    order = torch.argsort(owner, stable=True)  # the same order: positions by owner, src order within
    return gathered.new_zeros(gathered.shape).index_copy(0, order, gathered)


def _one_sequence_per_row(position_ids: Tensor, row: Tensor, col: Tensor) -> bool:
    """True when no row starts a second sequence before its last scored position: then a plain causal
    mask gives the scored positions exactly what the block-diagonal one does (later tokens are never
    seen by earlier ones), and attention can use the fused causal kernels without an ``S x S`` mask."""
    rows, L = position_ids.shape
    last = torch.full((rows,), -1, dtype=torch.long, device=position_ids.device).scatter_reduce(
        0, row, col, reduce="amax")
    starts = (position_ids == 0) & (torch.arange(L, device=position_ids.device)[None] <= last[:, None])
    return bool((starts.sum(-1) <= 1).all())
