"""Weight sync from training weights (possibly FSDP2-sharded DTensors) to a generation engine's copy.

Weights travel in size-bounded buckets: the engine receives one call per bucket,
never one per tensor. Sharded parameters (DTensors sharded on dim 0 over one mesh
dimension, FSDP2's layout) are gathered bucket by bucket too: every rank lays its
local shards, each padded to the shard size ``ceil(rows / world)``, end to end, one
``all_gather_into_tensor`` brings all ranks' buffers, and each full tensor is cut back
out. Parameters with any other placement are gathered with ``full_tensor()``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

DEFAULT_BUCKET_BYTES = 512 * 2**20


def _row_sharded(param: Tensor) -> bool:
    return (isinstance(param, DTensor) and param.device_mesh.ndim == 1 and len(param.placements) == 1
            and param.placements[0] == Shard(0))


def gather_row_sharded(params: list[DTensor]) -> list[Tensor]:
    """Full tensors of DTensors sharded on dim 0 over the same 1-D mesh and of one dtype: one collective."""
    mesh = params[0].device_mesh
    world = mesh.size()
    layout, pieces = [], []
    for p in params:
        chunk, inner = math.ceil(p.shape[0] / world), math.prod(p.shape[1:])
        local = p.to_local().detach().reshape(-1)
        padded = local.new_zeros(chunk * inner)
        padded[: local.numel()] = local
        pieces.append(padded)
        layout.append((p.shape, chunk * inner))
    flat = torch.cat(pieces)
    out = flat.new_empty(world * flat.numel())
    dist.all_gather_into_tensor(out, flat, group=mesh.get_group())
    out, offset, full = out.view(world, -1), 0, []
    for shape, size in layout:  # rank r's rows are r*chunk ...: concatenated in rank order, padding at the end
        full.append(out[:, offset : offset + size].reshape(-1, *shape[1:])[: shape[0]])
        offset += size
    return full


def full_weight_buckets(model: nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[list[tuple[str, Tensor]]]:
    """Yield ``[(name, full tensor), ...]`` lists of at most ``bucket_bytes`` (a larger tensor goes alone).

    A bucket holds one dtype; row-sharded DTensors of a bucket are gathered with one collective.
    """
    bucket, size = [], 0
    for name, param in model.named_parameters():
        nbytes = param.numel() * param.element_size()  # of the full tensor
        if bucket and (size + nbytes > bucket_bytes or param.dtype != bucket[0][1].dtype):
            yield _gathered(bucket)
            bucket, size = [], 0
        bucket.append((name, param))
        size += nbytes
    if bucket:
        yield _gathered(bucket)


def _gathered(bucket: list[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
    """Full tensors for a bucket: one all-gather per mesh for the row-sharded ones, ``full_tensor()`` for other DTensors."""
    sharded = [(i, p) for i, (_, p) in enumerate(bucket) if _row_sharded(p)]
    full = [None if _row_sharded(p) else p.full_tensor().detach() if isinstance(p, DTensor) else p.detach()
            for _, p in bucket]
    by_mesh: dict[int, list[tuple[int, DTensor]]] = {}
    for i, p in sharded:
        by_mesh.setdefault(id(p.device_mesh), []).append((i, p))
    for members in by_mesh.values():
        for (i, _), tensor in zip(members, gather_row_sharded([p for _, p in members])):
            full[i] = tensor
    return [(name, tensor) for (name, _), tensor in zip(bucket, full)]


@torch.no_grad()
def load_bucket(model: nn.Module, bucket: list[tuple[str, Tensor]]) -> None:
    """Copy one bucket into ``model``'s parameters (cast to their dtype and device)."""
    params = dict(model.named_parameters())
    for name, tensor in bucket:
        if name not in params:
            raise KeyError(f"weight sync: the engine's model has no parameter '{name}'")
        params[name].copy_(tensor)


def sync_weights(source: nn.Module, target: nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, float]:
    """Copy every parameter of ``source`` into ``target`` bucket by bucket; returns counts for the logs."""
    buckets = nbytes = 0
    for bucket in full_weight_buckets(source, bucket_bytes):
        load_bucket(target, bucket)
        buckets += 1
        nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
    return {"weight_sync/buckets": float(buckets), "weight_sync/gb": nbytes / 1e9}
