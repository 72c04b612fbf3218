"""Weight sync from training weights (possibly FSDP2-sharded DTensors) to a generation engine's copy.

Weights travel in size-bounded buckets: the engine receives one call per bucket,
never one per tensor. Each sharded parameter is gathered with ``full_tensor()``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

DEFAULT_BUCKET_BYTES = 512 * 2**20


def full_weight_buckets(model: nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[list[tuple[str, Tensor]]]:
    """Yield ``[(name, full tensor), ...]`` lists of at most ``bucket_bytes`` (a larger tensor goes alone)."""
    bucket, size = [], 0
    for name, param in model.named_parameters():
        tensor = param.full_tensor() if isinstance(param, DTensor) else param
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.detach()))
        size += nbytes
    if bucket:
        yield bucket


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
