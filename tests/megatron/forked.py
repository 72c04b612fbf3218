"""Distributed workers forked from the (already warm) test process instead of started by torchrun.

A fresh interpreter pays ~13 s importing rlflow (transformers, Lightning, TorchRL) and ~3 s importing
megatron-core, per process, on a 2-core machine; a forked child pays neither. Each child gets the
environment torchrun would give it (Lightning sees a torchelastic launch), runs the scenarios of
``worker.py`` and leaves with ``os._exit``. CUDA cannot be used after a fork: the ``gpu`` tests use torchrun.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed.launch import free_port, torchrun

CTX = multiprocessing.get_context("fork")


def warm_megatron() -> None:
    """Import megatron-core's modules the plugin uses once here, so that the children inherit them. Its import
    warnings (Transformer Engine and Apex absent: they are, on CPU; deprecations in its own modules) are
    silenced: under torchrun they went to the ranks' stderr, not to this test report."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.models.gpt  # noqa: F401
        import megatron.core.optimizer  # noqa: F401
        import megatron.core.tensor_parallel  # noqa: F401


def _child(rank: int, nproc: int, port: int, out: Path, scenarios) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                      WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), ROLE_WORLD_SIZE=str(nproc),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="rlflow-forked",
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)  # as torchrun's children (OMP_NUM_THREADS=1)
    from .worker import run

    try:
        run(out, scenarios)
    except BaseException:
        (out / f"rank{rank}.error").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def fork_launch(nproc: int, out: Path, scenarios, timeout: float = 600) -> dict:
    """Run ``scenarios`` on ``nproc`` forked ranks; each scenario's rank-0 result, by name. A rank that fails
    stops the others (they would wait in a collective) and its traceback is the assertion message."""
    if dist.is_available() and dist.is_initialized():  # forked ranks would inherit it: fresh interpreters then
        return torchrun_launch(nproc, out, scenarios, timeout)
    warm_megatron()
    port = free_port()
    ranks = [CTX.Process(target=_child, args=(r, nproc, port, out, list(scenarios))) for r in range(nproc)]
    for p in ranks:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        while any(p.exitcode is None for p in ranks):
            if any(p.exitcode for p in ranks) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        for p in ranks:
            if p.exitcode is None:
                p.kill()
            p.join()
    errors = "\n".join(f.read_text() for f in sorted(out.glob("rank*.error")))
    codes = [p.exitcode for p in ranks]
    assert codes == [0] * nproc, f"ranks' exit codes {codes} (timeout {timeout} s)\n{errors}"
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in scenarios}


def torchrun_launch(nproc: int, out: Path, scenarios, timeout: float = 900) -> dict:
    """The same with fresh interpreters started by torchrun (for CUDA, or when this process holds a process group)."""
    proc = torchrun(nproc, out, *scenarios, worker=Path(__file__).with_name("worker.py"), timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in scenarios}
