"""Distributed workers forked from the (already warm) test process instead of started by torchrun.

A fresh interpreter pays ~13 s importing rlflow (transformers, Lightning, TorchRL) and ~3 s importing
megatron-core, per process, on a 2-core machine; a forked child pays neither. Each child gets the
environment torchrun would give it (tests/distributed/launch.py's ``fork_ranks``), runs the scenarios of
``worker.py`` and leaves with ``os._exit``. CUDA cannot be used after a fork: the ``gpu`` tests use torchrun.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from ..distributed.launch import can_fork_ranks, fork_ranks, torchrun


def warm_megatron() -> None:
    """Import megatron-core's modules the plugin uses once here, so that the children inherit them. Its import
    warnings (Transformer Engine and Apex absent: they are, on CPU; deprecations in its own modules) are
    silenced: under torchrun they went to the ranks' stderr, not to this test report."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.models.gpt  # noqa: F401
        import megatron.core.optimizer  # noqa: F401
        import megatron.core.tensor_parallel  # noqa: F401


def fork_launch(nproc: int, out: Path, scenarios, timeout: float = 600) -> dict:
    """Run ``scenarios`` on ``nproc`` forked ranks (tests/distributed/launch.py's ``fork_ranks``); each scenario's
    rank-0 result, by name."""
    if not can_fork_ranks():  # forked ranks would inherit this process's group: fresh interpreters then
        return torchrun_launch(nproc, out, scenarios, timeout)
    warm_megatron()
    from .worker import run

    fork_ranks(nproc, out, run, out, list(scenarios), timeout=timeout)
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in scenarios}


def torchrun_launch(nproc: int, out: Path, scenarios, timeout: float = 900) -> dict:
    """The same with fresh interpreters started by torchrun (for CUDA, or when this process holds a process group)."""
    proc = torchrun(nproc, out, *scenarios, worker=Path(__file__).with_name("worker.py"), timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in scenarios}
