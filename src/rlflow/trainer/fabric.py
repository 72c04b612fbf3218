"""The Trainer's Lightning Fabric: launched on the run's devices (:func:`launch_fabric`), and its ranks split into
the groups that train on one batch (:func:`rank_groups`: a sequence-parallel group, or a Megatron model replica)."""

from __future__ import annotations

from pathlib import Path

import lightning_fabric as L

from rlflow.logs import quiet_other_ranks
from rlflow.strategies import resolve_strategy
from rlflow.trainer.callbacks import with_defaults
from rlflow.trainer.distributed import sequence_parallel_group
from rlflow.trainer.loggers import make_loggers
from rlflow.trainer.options import Hardware


def launch_fabric(hardware: Hardware, loggers, run_dir: Path, callbacks) -> L.Fabric:
    """Fabric on ``hardware``'s devices with the run's loggers and callbacks, launched (a no-op under torchrun or on
    one device); rank 0 alone prints warnings and library logs."""
    quiet_other_ranks()  # under torchrun (RANK set)
    fabric = L.Fabric(
        accelerator=hardware.accelerator, devices=hardware.devices, num_nodes=hardware.num_nodes,
        strategy=resolve_strategy(hardware.strategy, hardware.devices * hardware.num_nodes),
        precision=hardware.precision, loggers=make_loggers(loggers, run_dir), callbacks=with_defaults(callbacks),
    )
    fabric.launch()
    quiet_other_ranks(fabric.global_rank)  # processes Fabric launched itself
    return fabric


def rank_groups(fabric: L.Fabric, sequence_parallel_size: int, roles) -> tuple:
    """(ranks that train on one batch, this rank's sequence-parallel group or None, the data-parallel rank and size).
    With sequence parallelism, the modules of ``roles`` (None: absent) split each sequence over the group: call
    this before the strategy wraps them."""
    replica = getattr(fabric.strategy, "model_parallel_size", 1)  # Megatron's tensor x pipeline ranks
    size = sequence_parallel_size * replica
    group = sequence_parallel_group(fabric, size)
    dp_rank, dp_size = fabric.global_rank // size, fabric.world_size // size
    if group is not None and sequence_parallel_size > 1:
        for role in roles:
            if role is not None:
                role.module.sequence_parallel(group)
        fabric.print(f"[rlflow] sequence parallelism: {dp_size} group(s) of {size} processes split each sequence "
                     "(Ulysses)")
    return size, group, dp_rank, dp_size
