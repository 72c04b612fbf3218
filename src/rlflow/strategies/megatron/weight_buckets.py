"""Megatron shards -> full Hugging Face tensors, in size-bounded buckets, on every rank.

This is the Megatron producer side of weight sync (``rlflow.rollout.weight_sync``): the rollout
engines (transformers, vLLM) receive ``[(name, tensor), ...]`` buckets in transformers' naming,
whatever the layout that trained them. Per bucket, each pipeline stage assembles the tensors it owns
(one ``all_gather`` per process group: tensor-parallel blocks, expert-parallel blocks) and broadcasts
them to the other stages as one flat buffer. Every rank must iterate the buckets together.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from rlflow.strategies.megatron.slots import EXPERT, TENSOR, Slot, group_ranks

DEFAULT_BUCKET_BYTES = 512 * 2**20
# torch >= 2.13 renames all_gather_into_tensor (and warns on the old name)
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _group(slot: Slot):
    from megatron.core import parallel_state as ps

    return {TENSOR: ps.get_tensor_model_parallel_group, EXPERT: ps.get_expert_model_parallel_group}[slot.group]()


def gather_full(slots: list[Slot], tensors: list[Tensor]) -> list[Tensor]:
    """Full tensors of ``slots`` whose local blocks are ``tensors``: one all-gather per process group.

    Blocks are padded to the chunk size along their split dimension, flattened end to end and
    gathered; each rank's block is then cut out, unpadded and the blocks concatenated.
    """
    full: list[Tensor | None] = [t if s.dim is None else None for s, t in zip(slots, tensors)]
    by_group: dict[str, list[int]] = {}
    for i, s in enumerate(slots):
        if s.dim is not None:
            by_group.setdefault(s.group, []).append(i)
    for members in by_group.values():
        rank, size = group_ranks(slots[members[0]])
        if size == 1:
            for i in members:
                full[i] = tensors[i]
            continue
        flat, sizes = [], []
        for i in members:
            s, block = slots[i], tensors[i]
            chunk = math.ceil(s.shape[s.dim] / size)
            padded_shape = list(s.shape)
            padded_shape[s.dim] = chunk
            padded = block.new_zeros(padded_shape)
            padded.narrow(s.dim, 0, block.shape[s.dim]).copy_(block)
            flat.append(padded.reshape(-1))
            sizes.append((padded_shape, padded.numel()))
        local = torch.cat(flat)
        out = local.new_empty(size * local.numel())
        _all_gather_flat(out, local, group=_group(slots[members[0]]))
        out = out.view(size, -1)
        offset = 0
        for i, (padded_shape, numel) in zip(members, sizes):
            s = slots[i]
            blocks = [out[r, offset : offset + numel].view(padded_shape).narrow(s.dim, 0, s.bounds(r, size)[1])
                      for r in range(size)]
            full[i] = s.assemble(blocks)
            offset += numel
    return full


class WeightExporter:
    """Iterates a Megatron model's weights as full transformers tensors (see the module docstring).

    Args:
        slots: the model's :func:`~rlflow.strategies.megatron.slots.lm_slots` (primary ones are exported).
        adapted: the names that change when a LoRA policy trains (its merged weights: ``only_adapted``).
    """

    def __init__(self, slots: list[Slot], adapted: set[str] = frozenset()):
        from megatron.core import parallel_state as ps

        self.slots = [s for s in slots if s.primary]
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.pp_ranks = dist.get_process_group_ranks(self.pp_group) if dist.is_initialized() else [0]
        self.stage = ps.get_pipeline_model_parallel_rank()
        # every stage's (name, shape, dtype), so all ranks agree on the buckets
        mine = [(s.name, s.shape, str(s.params[0].dtype).removeprefix("torch."), s.name in adapted) for s in self.slots]
        stages = [mine]
        if len(self.pp_ranks) > 1:
            stages = [None] * len(self.pp_ranks)
            dist.all_gather_object(stages, mine, group=self.pp_group)
        self.plan = [(stage, name, shape, getattr(torch, dtype)) for stage, entries in enumerate(stages)
                     for name, shape, dtype, _ in entries]
        self.adapted = {name for entries in stages for name, _, _, changes in entries if changes}  # every stage's

    def buckets(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, only_adapted: bool = False
                ) -> Iterator[list[tuple[str, Tensor]]]:
        """``[(name, full tensor), ...]`` lists of at most ``bucket_bytes`` (a larger tensor goes alone), one dtype
        each; with ``only_adapted``, the LoRA-merged weights alone."""
        bucket, size = [], 0
        for entry in self.plan:
            if only_adapted and entry[1] not in self.adapted:
                continue
            _, _, shape, dtype = entry
            nbytes = math.prod(shape) * dtype.itemsize
            if bucket and (size + nbytes > bucket_bytes or dtype != bucket[0][3]):
                yield self._assemble(bucket)
                bucket, size = [], 0
            bucket.append(entry)
            size += nbytes
        if bucket:
            yield self._assemble(bucket)

    @torch.no_grad()
    def _assemble(self, bucket: list[tuple]) -> list[tuple[str, Tensor]]:
        by_name = {s.name: s for s in self.slots}
        out: dict[str, Tensor] = {}
        dtype, device = bucket[0][3], self.slots[0].params[0].device
        for stage in sorted({e[0] for e in bucket}):
            entries = [e for e in bucket if e[0] == stage]
            if stage == self.stage:
                slots = [by_name[e[1]] for e in entries]
                tensors = gather_full(slots, [s.read([p.detach() for p in s.params]) for s in slots])
                flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0, dtype=dtype,
                                                                                              device=device)
            else:
                flat = torch.empty(sum(math.prod(e[2]) for e in entries), dtype=dtype, device=device)
            if len(self.pp_ranks) > 1:
                dist.broadcast(flat, src=self.pp_ranks[stage], group=self.pp_group)
            offset = 0
            for _, name, shape, _ in entries:
                n = math.prod(shape)
                out[name] = flat[offset : offset + n].view(shape)
                offset += n
        return [(e[1], out[e[1]]) for e in bucket]
