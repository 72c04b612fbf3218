"""Weights in buckets: full tensors from training weights (possibly FSDP2-sharded DTensors), for any engine.

Weights travel in size-bounded buckets of ``(name, tensor)`` pairs: an engine receives one call per bucket,
never one per tensor. Sharded parameters (DTensors sharded on dim 0 over one mesh dimension, FSDP2's layout)
are gathered bucket by bucket: every rank lays its local shards, each padded to the shard size
``ceil(rows / world)``, end to end, one ``all_gather_into_tensor`` brings all ranks' buffers, and each full
tensor is cut back out. Parameters with any other placement are gathered with ``full_tensor()``.

With FSDP2's CPU offload the shards live on the CPU while the process group is NCCL, which cannot gather CPU
tensors: each bucket is moved to a device the group's backend serves (:func:`collective_device`, the current
GPU there) before the collective, one bucket at a time.

A leaf (torch only): the rollout engines, weight sync and LoRA's merged buckets (``rlflow.models.lora``) all
build on it, so none of them imports another for it. ``rlflow.rollout.weight_sync`` and
``rlflow.rollout.engines.base`` still export these names.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

DEFAULT_BUCKET_BYTES = 512 * 2**20


def _row_sharded(param: Tensor) -> bool:
    return (isinstance(param, DTensor) and param.device_mesh.ndim == 1 and len(param.placements) == 1
            and param.placements[0] == Shard(0))


_BACKEND_DEVICES = {"nccl": ("cuda",), "gloo": ("cpu", "cuda"), "mpi": ("cpu",), "xccl": ("xpu",), "hccl": ("npu",)}


def pick_device(supported: list[str], tensor_device: torch.device) -> torch.device:
    """The device a collective runs on: the tensor's own when the backend serves its device type, else the
    current device of the first type it serves (``cuda`` for NCCL: CPU-offloaded shards go to the GPU)."""
    if tensor_device.type in supported:
        return tensor_device
    kind = supported[0]
    module = getattr(torch, kind, None)
    index = module.current_device() if module is not None and module.is_available() else 0
    return torch.device(kind, index)


def collective_device(group, tensor_device: torch.device) -> torch.device:
    """:func:`pick_device` for ``group``'s backend (its device types as PyTorch records them)."""
    types = [d.type for d in getattr(group, "_device_types", None) or ()]
    if not types:  # older PyTorch: from the backend name ("nccl", or "cpu:gloo,cuda:nccl")
        name = dist.get_backend(group)
        types = [part.split(":")[0] for part in name.split(",")] if ":" in name else list(_BACKEND_DEVICES.get(name, ("cpu",)))
    return pick_device(types, tensor_device)


def gather_row_sharded(params: list[DTensor]) -> list[Tensor]:
    """Full tensors of DTensors sharded on dim 0 over the same 1-D mesh and of one dtype: one collective
    (on :func:`collective_device`; the full tensors are returned there)."""
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
    group = mesh.get_group()
    flat = torch.cat(pieces)
    flat = flat.to(collective_device(group, flat.device))  # CPU-offloaded shards under NCCL: to the GPU
    out = flat.new_empty(world * flat.numel())
    dist.all_gather_into_tensor(out, flat, group=group)
    out, offset, full = out.view(world, -1), 0, []
    for shape, size in layout:  # rank r's rows are r*chunk ...: concatenated in rank order, padding at the end
        full.append(out[:, offset : offset + size].reshape(-1, *shape[1:])[: shape[0]])
        offset += size
    return full


def full_weight_buckets(model: nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[list[tuple[str, Tensor]]]:
    """Yield ``[(name, full tensor), ...]`` lists of at most ``bucket_bytes`` (a larger tensor goes alone).

    A bucket holds one dtype; row-sharded DTensors of a bucket are gathered with one collective.
    A model whose weights a strategy keeps elsewhere (the Megatron strategy's shards) provides
    ``weight_buckets(bucket_bytes)``, which yields the same buckets. A parameter a module serves another value
    of (:func:`served_transforms`: quantization-aware training's fake-quantized weights) is sent as that value.
    """
    elsewhere = getattr(model, "weight_buckets", None)
    if elsewhere is not None:
        yield from elsewhere(bucket_bytes)
        return
    as_served = served_transforms(model)
    for bucket in tensor_buckets(model.named_parameters(), bucket_bytes):
        yield [(name, as_served[name](t) if name in as_served else t) for name, t in bucket] if as_served else bucket


def served_transforms(model: nn.Module) -> dict[str, Callable[[Tensor], Tensor]]:
    """``{parameter name: fn}`` for the parameters an engine is sent another value of: ``fn(full tensor)``.

    A module with a ``served_weights()`` method says which of its parameters and how (quantization-aware
    training's fake-quantized linear layers, ``rlflow.models.qat``: the quantized value the policy computes
    with). Asked once per sync, in module order on every rank (it may run collectives).
    """
    out: dict[str, Callable[[Tensor], Tensor]] = {}
    for prefix, module in model.named_modules():
        hook = getattr(module, "served_weights", None)
        if callable(hook):
            out.update({f"{prefix}.{k}" if prefix else k: fn for k, fn in hook().items()})
    return out


def tensor_buckets(named: Iterable[tuple[str, Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
                   ) -> Iterator[list[tuple[str, Tensor]]]:
    """:func:`full_weight_buckets` over any ``(name, tensor)`` pairs (e.g. only the trainable ones)."""
    bucket, size = [], 0
    for name, param in named:
        nbytes = param.numel() * param.element_size()  # of the full tensor
        if bucket and (size + nbytes > bucket_bytes or param.dtype != bucket[0][1].dtype):
            yield gather_full(bucket)
            bucket, size = [], 0
        bucket.append((name, param))
        size += nbytes
    if bucket:
        yield gather_full(bucket)


def gather_full(bucket: list[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
    """Full tensors for a bucket: one all-gather per mesh for the row-sharded ones, ``full_tensor()`` for other DTensors.

    Row-sharded tensors gathered together must share a dtype (:func:`tensor_buckets` makes buckets of one).
    """
    sharded = [(i, p) for i, (_, p) in enumerate(bucket) if _row_sharded(p)]
    full = [None if _row_sharded(p) else _full_tensor(p) if isinstance(p, DTensor) else p.detach()
            for _, p in bucket]
    by_mesh: dict[tuple[int, torch.dtype], list[tuple[int, DTensor]]] = {}
    for i, p in sharded:
        by_mesh.setdefault((id(p.device_mesh), p.dtype), []).append((i, p))
    for members in by_mesh.values():
        for (i, _), tensor in zip(members, gather_row_sharded([p for _, p in members])):
            full[i] = tensor
    return [(name, tensor) for (name, _), tensor in zip(bucket, full)]


def _full_tensor(param: DTensor) -> Tensor:
    """``full_tensor()`` of any other placement, its local part first moved where the mesh's backend can gather it."""
    local = param.to_local().detach()
    device = collective_device(param.device_mesh.get_group(), local.device)
    if device != local.device:
        param = DTensor.from_local(local.to(device), param.device_mesh, param.placements, run_check=False,
                                   shape=param.shape, stride=param.stride())
    return param.full_tensor().detach()


def tied_aliases(model: nn.Module) -> dict[str, list[str]]:
    """``{name: [other names of the same parameter]}``, e.g. ``lm_head.weight`` for tied embeddings."""
    first: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases.setdefault(first[id(param)], []).append(name)
        else:
            first[id(param)] = name
    return aliases


def hf_weight_buckets(model: nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[list[tuple[str, Tensor]]]:
    """:func:`full_weight_buckets` with every tied alias added to its bucket.

    ``named_parameters`` lists a tied parameter once (``model.embed_tokens.weight``); an engine that reloads
    in place (vLLM) restores the head from its own stale copy unless ``lm_head.weight`` arrives too.
    """
    aliases = tied_aliases(model)
    for bucket in full_weight_buckets(model, bucket_bytes):
        yield [pair for name, tensor in bucket for pair in [(name, tensor)] + [(a, tensor) for a in aliases.get(name, ())]]
