"""What the Trainer needs to run on several processes: data shards, global counts, reduced metrics."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from tensordict import TensorDict


def rank_shard(batch: TensorDict, rank: int, world_size: int) -> TensorDict:
    """This rank's contiguous share of a prompt batch (every rank draws the same global batch)."""
    size = batch.batch_size[0]
    if size % world_size:
        raise ValueError(f"{size} prompts per step do not split evenly over {world_size} processes")
    per = size // world_size
    return batch[rank * per : (rank + 1) * per]


def global_sum(fabric, value: torch.Tensor) -> torch.Tensor:
    """Sum of ``value`` over all ranks (itself on one process)."""
    if fabric.world_size == 1:
        return value
    return fabric.all_reduce(value.detach().float().clone(), reduce_op="sum")


def reduce_metrics(fabric, metrics: dict[str, float]) -> dict[str, float]:
    """One value per metric for the whole job: max of ``*/max``, min of ``*/min``, mean of the rest.

    Rank 0's key list is the reference; a key another rank lacks counts as missing there (NaN-skipped).
    """
    if fabric.world_size == 1:
        return metrics
    keys = [sorted(metrics)]
    dist.broadcast_object_list(keys, src=0)
    keys = keys[0]
    local = torch.tensor([float(metrics.get(k, math.nan)) for k in keys], dtype=torch.float64)
    gathered = fabric.all_gather(local)  # world x K
    out = {}
    for i, key in enumerate(keys):
        column = gathered[:, i]
        column = column[~torch.isnan(column)]
        if column.numel() == 0:
            out[key] = math.nan
        elif key.endswith("/max"):
            out[key] = column.max().item()
        elif key.endswith("/min"):
            out[key] = column.min().item()
        else:
            out[key] = column.mean().item()
    return out
