"""FSDP2: ``fully_shard`` each decoder layer, then the root, over the data-parallel mesh."""

from __future__ import annotations

from datetime import timedelta
from functools import partial

import torch
from lightning_fabric.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from rlflow.models.qat import quantized_layers


def decoder_layers(module: nn.Module) -> list[nn.Module]:
    """The blocks to shard one by one: those Hugging Face marks as ``_no_split_modules``."""
    names: set[str] = set()
    for m in module.modules():
        names |= set(getattr(m, "_no_split_modules", None) or ())
    return [m for m in module.modules() if type(m).__name__ in names]


def fsdp2_parallelize(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    offload: bool = False,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard ``module`` with FSDP2: each decoder layer is one unit, the rest goes with the root.

    Args:
        module: the wrapper the Trainer sets up (policy log-prob module or value model).
        mesh: Fabric's device mesh; its ``data_parallel`` dimension is used.
        param_dtype: compute dtype of gathered parameters (e.g. ``torch.bfloat16``); ``None`` keeps fp32.
        reduce_dtype: dtype of gradient reduction (fp32 keeps small updates from vanishing).
        offload: keep sharded parameters, gradients and optimizer state on CPU (``offload_policy``).
        reshard_after_forward: free gathered parameters after each layer's forward (ZeRO-3 style).
    """
    dp_mesh = mesh["data_parallel"] if mesh.mesh_dim_names else mesh
    kwargs = dict(mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                  mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype))
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(module):
        fully_shard(layer, **kwargs)
    fully_shard(module, **kwargs)
    for layer in quantized_layers(module):  # QAT: engines get the weights quantized in the dtype computed with
        layer.compute_dtype = param_dtype
    return module


def FSDP2(world_size: int, *, param_dtype: torch.dtype | None = None, offload: bool = False,
          timeout: timedelta = timedelta(minutes=10), parallelize_fn=None) -> ModelParallelStrategy:
    """Fabric's ``ModelParallelStrategy`` running :func:`fsdp2_parallelize` (or your own ``parallelize_fn``).

    Every process is one data-parallel rank: ``world_size`` = devices per node x nodes.
    """
    fn = parallelize_fn or partial(fsdp2_parallelize, param_dtype=param_dtype, offload=offload)
    # Offloaded shards and gradients live on the CPU, which NCCL cannot reduce or gather (gradient clipping,
    # full tensors): give the process group gloo for CPU tensors beside NCCL for GPU ones, as torchtitan does.
    backend = "cuda:nccl,cpu:gloo" if offload else None
    return ModelParallelStrategy(parallelize_fn=fn, data_parallel_size=world_size, tensor_parallel_size=1,
                                 timeout=timeout, process_group_backend=backend)
