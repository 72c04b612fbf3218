"""What the Trainer needs to run on several processes: data shards, global counts, reduced metrics."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from tensordict import NonTensorStack, TensorDict

from rlflow.data import keys as K
from rlflow.data.nontensor import per_row
from rlflow.trainer.batching import row_tokens


def rank_shard(batch: TensorDict, rank: int, world_size: int) -> TensorDict:
    """This rank's contiguous share of a prompt batch (every rank draws the same global batch)."""
    if world_size == 1:
        return batch
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


def all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """``world x ...``: every rank's ``tensor`` (same shape everywhere), one collective, no autograd. Bool and
    int16 tensors travel as uint8 and int32 (gloo gathers neither)."""
    carried = {torch.bool: torch.uint8, torch.int16: torch.int32}.get(tensor.dtype, tensor.dtype)
    world, flat = dist.get_world_size(), tensor.contiguous().reshape(-1).to(carried)
    out = flat.new_empty(world * flat.numel())  # a flat output: what every backend accepts
    dist.all_gather_into_tensor(out, flat)
    return out.view(world, *tensor.shape).to(tensor.dtype)


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
    gathered = all_gather(local)  # world x K
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


# ---------------------------------------------------------------- sequence-parallel groups
def sequence_parallel_group(fabric, size: int):
    """This rank's group of ``size`` consecutive ranks (Ulysses); ``None`` when ``size == 1``.

    Every rank creates every group (``torch.distributed.new_group`` is collective).
    """
    if size == 1:
        return None
    world = fabric.world_size
    if size < 1 or world % size:
        raise ValueError(f"sequence_parallel_size={size} must divide the number of processes ({world})")
    mine = None
    for start in range(0, world, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= fabric.global_rank < start + size:
            mine = group
    return mine


def gather_in_group(batch: TensorDict, group) -> TensorDict:
    """Every rank's batch of ``group``, concatenated in rank order, on every rank of the group.

    The ranks of a sequence-parallel group generate and score their own prompts, then train on the
    union. Group ids are offset so that each rank's stay distinct; per-token tensors are padded to
    the group's longest response.
    """
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, batch.to("cpu"), group=group)
    longest = max(p[K.RESPONSE_IDS].shape[1] for p in parts)
    offset, out = 0, []
    for part in parts:
        part = _pad_response_aligned(part, longest)
        if K.GROUP in part.keys():
            part.set(K.GROUP, part[K.GROUP] + offset)
            offset = int(part[K.GROUP].max()) + 1 if part.batch_size[0] else offset
        out.append(part)
    return torch.cat(out).to(batch[K.PROMPT_IDS].device)


# ---------------------------------------------------------------- balancing tokens across ranks
PROMPT_ALIGNED = (K.PROMPT_IDS, K.PROMPT_MASK, K.PROMPT_ROUTED_EXPERTS)


def partition_equal_counts(lengths: list[int], parts: int) -> list[list[int]]:
    """Indices into ``lengths`` dealt into ``parts`` lists of equal size with about equal sums.

    Longest first, each to the part with the smallest sum that still has room (ties: lowest part).
    Each part lists its indices in ascending order. ``len(lengths)`` must be a multiple of ``parts``.
    """
    per = len(lengths) // parts
    members: list[list[int]] = [[] for _ in range(parts)]
    sums = [0] * parts
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        p = min((p for p in range(parts) if len(members[p]) < per), key=lambda p: (sums[p], p))
        members[p].append(i)
        sums[p] += lengths[i]
    return [sorted(m) for m in members]


def _pad_response_aligned(batch: TensorDict, length: int) -> TensorDict:
    """Right-pad every per-token tensor (``B x R x ...``; prompt tensors excluded) to ``R = length`` with zeros
    (routed experts with -1: none)."""
    out = batch.clone(False)
    for key, value in batch.items():
        if type(value) is torch.Tensor and value.ndim >= 2 and key not in PROMPT_ALIGNED and value.shape[1] < length:
            fill = -1 if key == K.ROUTED_EXPERTS else 0
            pad = value.new_full((value.shape[0], length - value.shape[1], *value.shape[2:]), fill)
            out.set(key, torch.cat([value, pad], dim=1))
    return out


def balance_tokens(batch: TensorDict, fabric, dp_rank: int, dp_size: int, sp_size: int = 1,
                   mini_batches: int = 1) -> tuple[TensorDict, dict[str, float]]:
    """Re-deal each mini-batch's rows over the data-parallel ranks: equal rows, about equal tokens per rank.

    Mini-batch ``k`` is the ``k``-th of ``mini_batches`` contiguous slices of every rank's rows (as the
    Trainer splits them). Every rank gathers the tensors of every rank's rows and their vision inputs
    (``multi_modal_inputs``; other non-tensor fields are not carried: the updates do not read them),
    pads per-token tensors to the longest response, and takes its part of :func:`partition_equal_counts`
    over :func:`row_tokens`, mini-batch by mini-batch. The rows of each mini-batch stay the same, so
    with losses normalised by global counts the updates do too. With sequence parallelism the ranks of
    a group hold one batch: the first of each group speaks for it. Returns this rank's rows (mini-batch ``k``'s still the
    ``k``-th slice) and ``perf/`` statistics: the largest rank's tokens over the mean, before and
    after, averaged over the mini-batches.
    """
    n = batch.batch_size[0]
    longest = fabric.all_reduce(torch.tensor(batch[K.RESPONSE_IDS].shape[1], device=fabric.device), reduce_op="max")
    tensors = _pad_response_aligned(batch.select(*[k for k, v in batch.items() if type(v) is torch.Tensor]),
                                    int(longest))
    gathered = {}
    for key, value in tensors.items():  # world x n x ...
        out = all_gather(value)[::sp_size]  # one copy per SP group
        gathered[key] = out.reshape(dp_size, mini_batches, n // mini_batches, *value.shape[1:])
    everyone = TensorDict(gathered, batch_size=[dp_size, mini_batches, n // mini_batches], device=batch.device)
    vision = None
    if K.MULTI_MODAL_INPUTS in batch.keys():  # per row, in the order of `everyone` (rank, mini-batch, row)
        shared: list = [None] * dist.get_world_size()
        dist.all_gather_object(shared, per_row(batch, K.MULTI_MODAL_INPUTS))
        per = n // mini_batches
        vision = [[held[k * per : (k + 1) * per] for held in shared[::sp_size]] for k in range(mini_batches)]
    mine, mine_vision, before, after = [], [], [], []
    for k in range(mini_batches):
        rows = everyone[:, k].reshape(-1)
        lengths = row_tokens(rows)
        parts = partition_equal_counts(lengths.tolist(), dp_size)
        per_rank = lengths.view(dp_size, -1).sum(-1).float()
        before.append((per_rank.max() / per_rank.mean().clamp_min(1)).item())
        per_rank = torch.stack([lengths[p].sum() for p in parts]).float()
        after.append((per_rank.max() / per_rank.mean().clamp_min(1)).item())
        mine.append(rows[torch.tensor(parts[dp_rank], dtype=torch.long, device=rows.device)])
        if vision is not None:
            flat = [row for rank_rows in vision[k] for row in rank_rows]
            mine_vision += [flat[i] for i in parts[dp_rank]]
    stats = {"perf/tokens_max_over_mean_before_balance": sum(before) / len(before),
             "perf/tokens_max_over_mean": sum(after) / len(after)}
    out = torch.cat(mine)
    if vision is not None:
        out.set(K.MULTI_MODAL_INPUTS, NonTensorStack(*mine_vision))
    return out, stats


def gather_objects(fabric, obj) -> list:
    """Every rank's ``obj`` (picklable), in rank order."""
    if fabric.world_size == 1:
        return [obj]
    out = [None] * fabric.world_size
    dist.all_gather_object(out, obj)
    return out
