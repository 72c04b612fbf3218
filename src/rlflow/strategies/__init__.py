"""Strategies: how the policy (and critic) are placed on devices.

``"auto"`` (one device), ``"ddp"`` (replicas), ``"fsdp2"`` (``fully_shard`` per
decoder layer over a device mesh, through Lightning Fabric's
``ModelParallelStrategy``) and ``"megatron"`` (megatron-core tensor / pipeline / expert
parallelism, :class:`rlflow.strategies.megatron.MegatronStrategy`: pass an instance for
other sizes than 1). A strategy may also be any Fabric strategy object;
:func:`rlflow.strategies.fsdp2.fsdp2_parallelize` is the parallelize function
users can replace.
"""

from __future__ import annotations

from datetime import timedelta

from lightning_fabric.strategies import DDPStrategy, ModelParallelStrategy, Strategy

from rlflow.strategies.fsdp2 import FSDP2, fsdp2_parallelize
from rlflow.strategies.megatron import MegatronStrategy  # megatron-core itself is imported when it starts

STRATEGY_NAMES = ("auto", "single", "ddp", "fsdp", "fsdp2", "megatron")

# A rank that waits longer than this in a collective gives up instead of hanging forever.
DEFAULT_TIMEOUT = timedelta(minutes=10)


def resolve_strategy(strategy: str | Strategy, world_size: int = 1, timeout: timedelta = DEFAULT_TIMEOUT):
    """A Fabric strategy from a name; objects pass through.

    ``"fsdp"`` is accepted as verl users type it and means FSDP2 here.
    """
    if not isinstance(strategy, str):
        return strategy
    if strategy in ("auto", "single"):
        return "auto"
    if strategy == "ddp":
        return DDPStrategy(timeout=timeout)
    if strategy in ("fsdp", "fsdp2"):
        return FSDP2(world_size, timeout=timeout)
    if strategy == "megatron":
        return MegatronStrategy(timeout=timeout)
    raise ValueError(f"unknown strategy '{strategy}'; choose from {STRATEGY_NAMES} or pass a Fabric strategy object")


def shards_parameters(strategy) -> bool:
    """True when parameters are sharded, so a generation engine needs its own full copy."""
    return isinstance(strategy, ModelParallelStrategy)


__all__ = ["FSDP2", "MegatronStrategy", "fsdp2_parallelize", "resolve_strategy", "shards_parameters", "STRATEGY_NAMES"]
