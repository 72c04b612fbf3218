"""What megatron-core 0.16.1 needs to run on CPU processes (gloo), kept narrow.

Each workaround touches one object that megatron-core owns, is installed only when the strategy
runs on the CPU, and is undone at teardown. Nothing in ``torch`` itself is patched: a global
"CUDA -> CPU" redirect of torch's factories corrupted transformers' rotary buffers in the same
process when this was measured (``shared/reference/backends-on-cpu.md``).

1. The RNG tracker: ``model_parallel_cuda_manual_seed`` reads CUDA's RNG state. Megatron's own
   ``inference_rng_tracker`` (a tracker whose ``fork()`` is a no-op) replaces it; rlflow builds
   every model with dropout 0, so no random numbers are drawn inside the tracker.
2. ``parallel_state``'s global memory buffer (the attention scores' scratch tensor) allocates on
   ``torch.cuda.current_device()``: it is replaced by :class:`CPUMemoryBuffer`.
3. ``tensor_parallel.mappings`` (the gathers of expert routing) and ``moe.router`` (which moves its
   weight "to the GPU" on first use) call ``torch.cuda.current_device()``: those two modules get a
   ``torch`` whose ``cuda.current_device()`` is the CPU; every other attribute is torch's own.
4. ``moe.moe_utils`` refers to ``te_general_gemm`` when Transformer Engine is missing without
   defining it (a ``NameError`` in the router): the name is defined as ``None``, which is what
   megatron's check ``te_general_gemm is not None`` expects.
5. ``dist_checkpointing``'s writer (:mod:`.dist_checkpoint`) copies each tensor "to the CPU" with
   ``non_blocking=True`` and then calls ``torch.cuda.synchronize()`` (``filesystem_async.preload_tensors``;
   on CPU: "Torch not compiled with CUDA enabled"): that module's ``torch.cuda.synchronize()`` is a no-op.
6. The writer's last step broadcasts a failure flag created on ``torch.cuda.current_device()``
   (``state_dict_saver.save_state_dict_async_finalize``): that module gets the same ``torch`` as item 3.
7. megatron-core's GatedDeltaNet (Qwen3.5's linear-attention layers) refuses to be built without the ``fla``
   package and allocates on ``torch.cuda.current_device()``: :func:`.qwen3_5.gated_delta_net_on_cpu`.

Three more CUDA defaults are never reached because rlflow passes explicit inputs (see
:mod:`~rlflow.strategies.megatron.model`): the causal mask (an explicit boolean mask), the rotary
table (computed from the Hugging Face model's ``inv_freq`` and the position ids) and the tied
embedding's copy on the last pipeline stage (loaded from the Hugging Face weights).
"""

from __future__ import annotations

import importlib
import math
import types

import torch

from rlflow.strategies.megatron.qwen3_5 import gated_delta_net_on_cpu

PATCHED_MODULES = ("megatron.core.tensor_parallel.mappings", "megatron.core.transformer.moe.router",
                   "megatron.core.dist_checkpointing.strategies.filesystem_async",
                   "megatron.core.dist_checkpointing.strategies.state_dict_saver")


class _CPUCuda:
    """``torch.cuda`` whose ``current_device()`` is the CPU and whose ``synchronize()`` does nothing (there is
    no CUDA stream to wait for)."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def synchronize(device=None) -> None:
        return None


class _TorchOnCPU(types.ModuleType):
    """``torch`` as seen by one Megatron module: only ``torch.cuda.current_device()`` and ``synchronize()`` differ."""

    cuda = _CPUCuda()

    def __getattr__(self, name):
        return getattr(torch, name)


class CPUMemoryBuffer:
    """Megatron's ``GlobalMemoryBuffer`` (named scratch tensors reused across calls), on the CPU."""

    def __init__(self):
        self.buffer: dict = {}

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        size = math.prod(tensor_shape)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < size:
            buf = self.buffer[(name, dtype)] = torch.empty(size, dtype=dtype)
        return buf[:size].view(*tensor_shape)


class CPUWorkarounds:
    """Installs the workarounds above after ``initialize_model_parallel``; :meth:`remove` undoes them."""

    def __init__(self):
        self._saved: list[tuple[object, str, object]] = []

    def _set(self, owner, name: str, value) -> None:
        self._saved.append((owner, name, getattr(owner, name, _MISSING)))
        setattr(owner, name, value)

    def install(self) -> None:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import random as mp_random

        mp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        self._set(parallel_state, "_GLOBAL_MEMORY_BUFFER", CPUMemoryBuffer())
        proxy = _TorchOnCPU("torch")
        for name in PATCHED_MODULES:
            module = importlib.import_module(name)
            if not isinstance(module.torch, _TorchOnCPU):  # another strategy of this process installed it
                self._set(module, "torch", proxy)
        moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
        if not hasattr(moe_utils, "te_general_gemm"):
            self._set(moe_utils, "te_general_gemm", None)
        gated_delta_net_on_cpu(self._set, proxy)

    def remove(self) -> None:
        from megatron.core.tensor_parallel import random as mp_random

        for owner, name, value in reversed(self._saved):
            if value is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        self._saved.clear()
        mp_random.initialize_rng_tracker(force_reset=True)


_MISSING = object()
