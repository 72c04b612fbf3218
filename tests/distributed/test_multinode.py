"""Several nodes without a cluster: two torchrun agents on 127.0.0.1 meet through a c10d rendezvous
(``--nnodes=2``, one gloo process each) and run the verl entry point as two "nodes".

A SIGKILLed rank makes the other stop within seconds naming it and the phase; resumed from their
checkpoint they train on with the metrics of the single-node 2-process run (one test: one run checks both);
``trainer.nnodes=2`` without torchrun fails at once saying how to start it.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlflow.config.verl.run import main as main_ppo

from .launch import free_port, metrics

PHASES = ("gen", "reward", "old_log_prob", "adv", "balance", "update_actor", "update_weights", "save", "fit")


def env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def start_two_nodes(args, run_dir, log_dir):
    """Two torchrun agents, each one "node" of one process, meeting at a c10d rendezvous on 127.0.0.1."""
    port, agents = free_port(), []
    for node in (0, 1):
        log = open(log_dir / f"node{node}.log", "w")
        agents.append((subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
             f"--rdzv-endpoint=127.0.0.1:{port}", "-m", "rlflow.trainer.main_ppo", *args, "trainer.nnodes=2",
             "trainer.n_gpus_per_node=1", f"trainer.default_local_dir={run_dir}"],
            env=env(), stdout=log, stderr=subprocess.STDOUT), log))
    return agents


def wait_all(agents, log_dir, timeout=240):
    codes = [proc.wait(timeout) for proc, _ in agents]
    for _, log in agents:
        log.close()
    return codes, [(log_dir / f"node{n}.log").read_text() for n in (0, 1)]


def worker_of_rank(agents, rank):
    """The pid of the training process torchrun started with RANK=rank (under either agent)."""
    parents = {proc.pid for proc, _ in agents}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            ppid = int(next(line for line in status.read_text().splitlines() if line.startswith("PPid:")).split()[1])
            if ppid in parents and f"RANK={rank}".encode() in (status.parent / "environ").read_bytes().split(b"\0"):
                return int(status.parent.name)
        except (OSError, StopIteration):
            continue  # a process that ended meanwhile
    return None


def test_a_killed_rank_stops_the_other_naming_it_and_the_resumed_run_equals_one_node(
        one_node_reference, job, tmp_path):
    """One two-node run for both checks (each launch starts two interpreters: the suite's cost): SIGKILL rank 1
    mid-run, the other stops naming it; resumed from its last checkpoint for one more step, every step's metrics
    are those of the same 2 ranks on one node (conftest.py's reference, shared with test_ray.py, running
    meanwhile; the learning rate is constant: the runs' different ``total_training_steps`` change no step)."""
    run = tmp_path / "two"
    agents = start_two_nodes([*job, "trainer.total_training_steps=500"], run, tmp_path)
    tracker = run / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + 240
    while not (tracker.exists() and int(tracker.read_text() or 0) >= 2):  # mid-run: 2 steps saved
        assert time.monotonic() < deadline and all(p.poll() is None for p, _ in agents), "the run did not get going"
        time.sleep(0.2)
    pid = worker_of_rank(agents, 1)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    codes, logs = wait_all(agents, tmp_path, timeout=60)  # generous: a report within seconds, not a hang
    assert time.monotonic() - killed < 60 and all(codes)
    report = [line for line in "".join(logs).splitlines() if line.startswith("[rlflow] rank 1 stopped")]
    assert report, "".join(logs)[-4000:]
    assert any(f"in phase '{p}'" in report[0] for p in PHASES) and f"(pid {pid})" in report[0], report
    assert any(line.startswith("[rlflow] this rank (0) was in phase") for line in "".join(logs).splitlines())

    last = int(tracker.read_text())
    assert (run / f"global_step_{last}" / "state.ckpt").is_dir()  # sharded
    codes, logs = wait_all(start_two_nodes([*job, f"trainer.total_training_steps={last + 1}"], run, tmp_path),
                           tmp_path)
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert f"global_step_{last}" in "".join(logs) and int(tracker.read_text()) == last + 1  # resumed, one more step
    assert "resumed from" in "".join(logs) and (run / f"global_step_{last + 1}").is_dir()

    reference, steps = one_node_reference.metrics(last + 1), list(range(1, last + 2))  # real updates
    two = metrics(run)  # the killed run's rows past its checkpoint were dropped by the resume
    assert sorted(two) == steps
    for step in steps:  # the same 2 ranks, on one node or two, killed and resumed or not: the same numbers
        assert two[step].keys() == reference[step].keys()
        for key, value in reference[step].items():
            assert two[step][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, key)


def test_several_nodes_without_torchrun_fail_at_once_saying_how_to_start(job, tmp_path, capsys, monkeypatch):
    for var in ("LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    start = time.perf_counter()
    assert main_ppo([*job, "trainer.nnodes=2", "trainer.n_gpus_per_node=2",
                     f"trainer.default_local_dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().err
    assert time.perf_counter() - start < 30 and not (tmp_path / "run").exists()  # nothing built
    assert "torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d --rdzv-endpoint HEAD:29500" in err
    assert "ray start --head" in err and "rlflow launch --slurm" in err

    monkeypatch.setenv("LOCAL_RANK", "0")  # a torchrun worker of a 2-process job, for a 1-process config
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert main_ppo([*job, "trainer.n_gpus_per_node=1", f"trainer.default_local_dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().err
    assert "torchrun started 2 process(es), 1 on this node" in err and "trainer.nnodes=2 trainer.n_gpus_per_node=1" in err
