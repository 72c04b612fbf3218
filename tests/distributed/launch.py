"""Launching the distributed workers with torchrun, as users launch rlflow, and comparing their results."""

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

WORKER = Path(__file__).with_name("worker.py")
# The 2-process worker.py jobs of several test files (test_fsdp2.py, test_lora.py, tests/rewards/
# test_model_reward_distributed.py) that read nothing from another test's run: one launch, tests/conftest.py's
# ``fsdp2_launched``, runs them one after another (worker.py's "+"), each writing OUT/result.pt; a job whose rank 1
# fails comes last in that launch (it ends it).
FSDP2_JOBS = {"fsdp2": ("fsdp2", 1), "ddp": ("ddp", 1), "ddp_samples2": ("ddp", 1, "samples=2"),
              "fsdp2_samples2": ("fsdp2", 1, "samples=2"), "bf16": ("fsdp2", 1, "bf16=1"),
              "lora": ("fsdp2", 2, "lora=1"), "rm": ("fsdp2", 1, "rm=1")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc, *args, timeout=300, worker=WORKER):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           str(worker), *map(str, args)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _forked_rank(rank, nproc, port, out: Path, target, args) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                      WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), ROLE_WORLD_SIZE=str(nproc),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="rlflow-forked",
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)  # as torchrun's children (OMP_NUM_THREADS=1)
    log = open(out / f"rank{rank}.log", "w", buffering=1)  # noqa: SIM115 - the rank's output, until os._exit
    os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    try:
        target(*args)
    except BaseException:
        (out / f"rank{rank}.error").write_text(traceback.format_exc())
        sys.excepthook(*sys.exc_info())  # as an interpreter ends on an uncaught error (rlflow's watchdog explains it)
        log.flush()
        os._exit(1)
    os._exit(0)


def can_fork_ranks() -> bool:
    """Whether ranks may be forked from this process: not when it holds a process group (they would inherit it);
    then the caller starts fresh interpreters, slower, and a warning in the test report says so."""
    if dist.is_available() and dist.is_initialized():
        warnings.warn("this test process holds a process group (an in-process vLLM engine makes one): its ranks are "
                      "started by torchrun, not forked (each fresh interpreter imports rlflow again)", stacklevel=2)
        return False
    return True


def fork_ranks(nproc: int, out: Path, target, *args, timeout: float = 600) -> str:
    """``target(*args)`` on ``nproc`` ranks forked from this (already warm) process, each with the environment
    torchrun gives its workers (Lightning sees a torchelastic launch): a fresh interpreter pays ~6 CPU s importing
    rlflow (transformers, Lightning, TorchRL) per process, and torchrun's agent ~2 more; a forked child pays none.
    A rank that fails stops the others (they would wait in a collective) and its traceback (``out/rank*.error``)
    is the assertion message. Returns the ranks' output (``out/rank*.log``, rank 0's first), as torchrun's
    stdout and stderr. CUDA cannot be used after a fork: the ``gpu`` tests use torchrun."""
    assert not dist.is_initialized(), "this process holds a process group: launch fresh interpreters (torchrun)"
    out.mkdir(parents=True, exist_ok=True)  # the ranks' output goes there from the start
    port, fork = free_port(), multiprocessing.get_context("fork")
    ranks = [fork.Process(target=_forked_rank, args=(r, nproc, port, out, target, args)) for r in range(nproc)]
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
    output = "".join((out / f"rank{r}.log").read_text(errors="replace") for r in range(nproc)
                     if (out / f"rank{r}.log").exists())
    codes = [p.exitcode for p in ranks]
    assert codes == [0] * nproc, f"ranks' exit codes {codes} (timeout {timeout} s)\n{output[-3000:]}\n{errors}"
    return output


def run_ok(nproc, *args, worker=WORKER):
    proc = torchrun(nproc, *args, worker=worker)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = Path(args[0]) / "result.pt"
    return torch.load(result, weights_only=False) if result.exists() else None


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=2e-5, rtol=1e-4, msg=name)


def assert_updates(steps: dict) -> None:
    """The reference run really trains: every step's gradient is non-zero (else equal weights prove nothing)."""
    for step, record in steps.items():
        assert record["metrics"]["actor/grad_norm"] > 0.1, (step, record["metrics"]["actor/grad_norm"])


def metrics(run_dir):
    """Each step's metrics (metrics.jsonl) but wall times (``timing_s/*``, ``perf/throughput``, ``weight_sync/seconds``...)."""
    clock = ("timing_s/", "perf/throughput", "perf/time_per_step", "weight_sync/seconds", "weight_sync/load_s")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(clock)} for r in rows}


def launch_fsdp2_jobs(root):
    """One launch of FSDP2_JOBS under root, then a job whose rank 1 fails in its first step (root/failing). The
    timeout bounds the time the failure takes to end the launch (a rank left waiting would hang it)."""
    args = [a for name, job in FSDP2_JOBS.items() for a in ("+", root / name, *job)][1:]
    return torchrun(2, *args, "+", root / "failing", "fsdp2", 3, "-", 1, timeout=600)


def fsdp2_results(proc, root):
    """{job: (its steps' records, its run folder)} of FSDP2_JOBS."""
    missing = [name for name in FSDP2_JOBS if not (root / name / "result.pt").exists()]
    assert not missing, (missing, proc.stdout[-3000:] + proc.stderr[-3000:])
    return {name: (torch.load(root / name / "result.pt", weights_only=False), root / name) for name in FSDP2_JOBS}
