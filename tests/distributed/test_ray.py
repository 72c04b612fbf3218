"""verl's Workflow 3 for real: a 2-node Ray cluster on 127.0.0.1 (two ``ray start`` nodes of one CPU each),
and ``python -m rlflow.trainer.main_ppo trainer.nnodes=2 trainer.n_gpus_per_node=1`` placed on it by
rlflow.launch.ray (a placement group spread over the nodes, one actor per rank, one gloo group).

It trains, checkpoints and resumes with the metrics of the same 2 ranks under torchrun on one node; a rank
that fails or dies stops the other at once, named with its node; ``trainer.nnodes=2`` without a cluster
fails at once saying how to start one.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("ray")

from rlflow import Policy  # noqa: E402
from rlflow.config.verl.run import main as main_ppo  # noqa: E402
from rlflow.launch.ray import RayLaunchError, check_gpu_nodes, run_workers  # noqa: E402
from rlflow.launch.rollout_pool import pool_from_config, trainer_arguments  # noqa: E402

from .launch import free_port, metrics  # noqa: E402
from tests.rollout.conftest import write_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]  # the Ray workers import tests.distributed.ray_entry from here
RAY = [sys.executable, "-m", "ray.scripts.scripts"]


def env(**extra):
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path,
            "RAY_USAGE_STATS_ENABLED": "0", **extra}


def test_several_nodes_without_a_cluster_fail_at_once_saying_how_to_start_one(job, tmp_path, capsys, monkeypatch):
    for var in ("LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "RAY_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    start = time.perf_counter()
    assert main_ppo([*job, "trainer.nnodes=2", "trainer.n_gpus_per_node=1",
                     f"trainer.default_local_dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().err
    assert time.perf_counter() - start < 30 and not (tmp_path / "run").exists()  # nothing built
    assert "no Ray cluster found" in err and "ray start --head --port=6379" in err
    assert "ray start --address=HEAD:6379" in err and "torchrun --nnodes 2 --nproc_per_node 1" in err


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes on this machine (the CLI recipe of real-models-and-clusters.md), told apart by custom
    resources, in a temp dir of their own; stopped at the end by their process groups (not `ray stop`, which
    stops every Ray node of the machine). The worker node declares 2 GPUs, the head none (a CPU-only head
    node, for the driver's GPU check; nothing here asks Ray for a GPU)."""
    temp = Path(tempfile.mkdtemp(prefix="rlflow-ray-"))  # short: Ray's socket paths have a length limit
    port, groups = free_port(), []
    common = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--disable-usage-stats",
              f"--dashboard-agent-listen-port={free_port()}"]
    try:
        for name, args in (("head", ["--head", f"--port={port}", "--include-dashboard=false",
                                     f"--dashboard-port={free_port()}", f"--ray-client-server-port={free_port()}",
                                     f"--temp-dir={temp}", "--num-gpus=0"]),
                           ("worker", [f"--address=127.0.0.1:{port}", "--num-gpus=2"])):
            proc = subprocess.Popen([*RAY, "start", *args, *common, f"--resources={{\"node_{name}\": 1}}"],
                                    env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)  # its daemons stay in this process group
            groups.append(proc.pid)
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0, out[-3000:]
        yield f"127.0.0.1:{port}"
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for group in groups:
                try:
                    os.killpg(group, sig)
                except ProcessLookupError:
                    pass
            time.sleep(2 if sig == signal.SIGTERM else 0)
        shutil.rmtree(temp, ignore_errors=True)


def ppo(args, timeout=300, **extra):
    return subprocess.run([sys.executable, "-m", "rlflow.trainer.main_ppo", *args], env=env(**extra),
                          capture_output=True, text=True, timeout=timeout)


def test_ray_cluster_trains_resumes_and_equals_torchrun(one_node_reference, cluster, job, tmp_path):
    """The reference (conftest.py's, shared with test_multinode.py) is asked for first: run alone, this file starts
    it before the cluster, so that it runs while the cluster starts (Ray's start-up mostly waits)."""
    run, two_nodes = tmp_path / "ray", ["trainer.nnodes=2", "trainer.n_gpus_per_node=1"]
    first = ppo([*job, *two_nodes, "trainer.total_training_steps=2", f"trainer.default_local_dir={run}"],
                RAY_ADDRESS=cluster)  # found as ray.init finds it: RAY_ADDRESS
    out = first.stdout + first.stderr
    assert first.returncode == 0, out[-4000:]
    placed = re.search(r"2 node\(s\) x 1 worker\(s\) on the Ray cluster at \S+: node 0 = \S+ \((\w+)\), "
                       r"node 1 = \S+ \((\w+)\)", out)
    assert placed and placed.group(1) != placed.group(2), out[-4000:]  # one rank on each Ray node
    assert (run / "global_step_2" / "state.ckpt").is_dir()

    second = ppo([*job, *two_nodes, "trainer.total_training_steps=3", f"trainer.default_local_dir={run}",
                  f"ray_kwargs.ray_init.address={cluster}"])  # or verl's key
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-4000:]
    assert "resumed from" in out and (run / "global_step_3").is_dir()

    reference, placed_on_ray = one_node_reference.metrics(3), metrics(run)  # real updates
    assert sorted(reference) == sorted(placed_on_ray) == [1, 2, 3]
    for step in (1, 2, 3):
        assert placed_on_ray[step].keys() == reference[step].keys()
        for key, value in reference[step].items():
            assert placed_on_ray[step][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, key)


@pytest.mark.parametrize("how, said", [
    ("raise", "raised RuntimeError: bad shard: RANK=1 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 GROUP_RANK=1 "
              "MASTER_ADDR="),
    ("die", "its process died")])
def test_a_failed_or_dead_rank_stops_the_others_naming_rank_and_node(cluster, capsys, monkeypatch, how, said):
    monkeypatch.setenv("PYTHONPATH", env()["PYTHONPATH"])  # passed on to the workers
    start = time.monotonic()
    assert run_workers(cluster, 2, 1, [how], entry="tests.distributed.ray_entry") == 1
    assert time.monotonic() - start < 120  # rank 0 sleeps 600 s: it was stopped, not waited for
    err = capsys.readouterr().err
    report = next((line for line in err.splitlines() if line.startswith("rlflow: rank 1 (node 1, ")), "")
    assert said in report and "stopped the other 1 rank(s)" in report, err[-3000:]


def test_a_job_larger_than_the_cluster_is_an_error_at_once(cluster):
    with pytest.raises(RayLaunchError, match=r"trainer.nnodes=3 .* has 2 alive node\(s\), 2 of them with 1 CPU"):
        run_workers(cluster, 3, 1, ["raise"], entry="tests.distributed.ray_entry")
    with pytest.raises(RayLaunchError, match=r"no node of the Ray cluster at \S+ has 2 CPU\(s\)"):
        run_workers(cluster, 2, 2, ["raise"], entry="tests.distributed.ray_entry")


def test_the_drivers_gpu_check_reads_the_clusters_resources_not_its_machines(cluster, job, tmp_path, capsys):
    """The driver may run on a head node without a GPU (this machine has none): the cluster's nodes decide."""
    check_gpu_nodes(cluster, 1, 2)  # the worker node's 2 GPUs
    with pytest.raises(RayLaunchError, match=r"has 1 such node\(s\) \(GPUs per alive node: \[2, 0\], 2 in all\)"):
        check_gpu_nodes(cluster, 2, 1)
    assert main_ppo([*job, "trainer.device=cuda", "trainer.nnodes=2", "trainer.n_gpus_per_node=2",
                     f"ray_kwargs.ray_init.address={cluster}", f"trainer.default_local_dir={tmp_path}/run"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"asks for 2 node(s) with 2 GPU(s) each, but the Ray cluster at {cluster} has 1 such node(s)" in err, err
    assert "this machine has" not in err and not (tmp_path / "run").exists()


def test_a_separate_rollout_pool_by_verls_keys_gets_weights_by_gloo(cluster, job, tmp_path):
    """verl's standalone rollout keys (rollout.nnodes / rollout.n_gpus_per_node): the trainer on one Ray node,
    a vLLM server actor on the other; each step's rollout log-probs equal the policy's (the server got every
    update, by gloo broadcast), and the server is stopped when the run ends."""
    pytest.importorskip("vllm")

    model = write_model(tmp_path / "model")  # vLLM's CPU attention needs head_dim 32: the engine tests' model
    run = tmp_path / "run"
    args = [*(a for a in job if not a.startswith("actor_rollout_ref.model.path=")), f"actor_rollout_ref.model.path={model}",
            "trainer.nnodes=1", "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
            "actor_rollout_ref.rollout.dtype=float32", "actor_rollout_ref.rollout.enforce_eager=True",
            "actor_rollout_ref.rollout.max_model_len=64",
            "+actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes=134217728",
            "trainer.total_training_steps=2", "trainer.save_freq=-1", f"trainer.default_local_dir={run}"]
    done = ppo(args, timeout=600, RAY_ADDRESS=cluster)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    pool = re.search(r"rollout pool: 1 vLLM server\(s\) on 1 node\(s\) of their own: (http://\S+) \((\w+)\)", out)
    trainer = re.search(r"1 node\(s\) x 1 worker\(s\) on the Ray cluster at \S+: node 0 = \S+ \((\w+)\)", out)
    assert pool and trainer and pool.group(2) != trainer.group(1), out[-6000:]  # on different Ray nodes
    assert f"weights to the server at {pool.group(1)}: vLLM's weight-transfer protocol, backend rlflow_gloo" in out
    steps = metrics(run)
    nbytes = sum(p.numel() * p.element_size() for p in Policy.from_pretrained(model).model.parameters())
    assert sorted(steps) == [1, 2]
    for step in steps.values():  # step 2 samples with the weights step 1 trained: the update arrived
        assert step["training/rollout_probs_diff_max"] < 1e-4, step
        assert step["weight_sync/gb"] == pytest.approx(nbytes / 1e9), step  # the parameters' bytes, no more
    assert "rollout pool: stopped 1 vLLM server(s)" in out
    with pytest.raises(OSError):  # stopped: nothing answers there any more
        urllib.request.urlopen(f"{pool.group(1)}/health", timeout=5)


def test_the_pools_keys_are_checked_before_anything_starts():
    base = {"actor_rollout_ref.rollout.name": "vllm", "actor_rollout_ref.model.path": "m", "data.max_prompt_length": 8,
            "actor_rollout_ref.rollout.response_length": 4, "actor_rollout_ref.rollout.n_gpus_per_node": 8}
    assert pool_from_config(base, use_gpu=True) is None  # rollout.nnodes=0: colocated
    pool = pool_from_config({**base, "actor_rollout_ref.rollout.nnodes": 1,
                             "actor_rollout_ref.rollout.tensor_model_parallel_size": 8}, use_gpu=True)
    assert (pool.nnodes, pool.per_node, pool.tp, pool.servers_per_node(True)) == (1, 8, 8, 1)
    assert pool.server["max_model_len"] == 12 and "--tensor-parallel-size" in pool.server["extra"]
    fleet = pool_from_config({**base, "actor_rollout_ref.rollout.nnodes": 2}, use_gpu=False)  # gloo: no folder
    assert fleet.nnodes * fleet.servers_per_node(False) == 2
    places = [{"url": "http://a:1"}, {"url": "http://b:2"}]
    assert trainer_arguments(["x=1"], places)[-2:] == ["actor_rollout_ref.rollout.server.url=[http://a:1,http://b:2]",
                                                       "actor_rollout_ref.rollout.server.weight_transfer=rlflow_gloo"]
    assert trainer_arguments(["actor_rollout_ref.rollout.server.weight_transfer=reload"], places)[-1].endswith("b:2]")
    for extra, said in (({"actor_rollout_ref.rollout.name": "hf"}, "runs vLLM servers; set actor_rollout_ref.rollout.name=vllm"),
                        ({"actor_rollout_ref.rollout.server.url": "http://x:1"}, "set one or the other"),
                        ({"actor_rollout_ref.rollout.tensor_model_parallel_size": 3}, "not a multiple of"),
                        ({"actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
                          "actor_rollout_ref.rollout.server.weight_transfer": "reload"}, "starts 4 vLLM servers, a fleet")):
        with pytest.raises(ValueError, match=said):
            pool_from_config({**base, "actor_rollout_ref.rollout.nnodes": 1, **extra}, use_gpu=True)
