"""verl's Workflow 3 on rlflow: ``trainer.nnodes=N trainer.n_gpus_per_node=G`` with a Ray cluster running.

The driver (the ``python -m rlflow.trainer.main_ppo`` the user starts, on any node of the cluster) connects to
the cluster, reserves N nodes with one placement group (``STRICT_SPREAD``: one bundle per node, of G CPUs on
CPU or G GPUs on GPU, so every node runs exactly G workers and no two "nodes" share a machine) and starts one
Ray actor per training process in its node's bundle. Each actor sets the environment torchrun would have set
(``MASTER_ADDR`` = rank 0's node IP, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ...) and then calls the very entry torchrun runs (``main`` of
``rlflow.trainer.main_ppo``, in the actor's process), so the processes meet in one torch.distributed group
(gloo or NCCL) and the Trainer does not know it runs under Ray.

Why Ray actors and not Ray Train's ``TorchTrainer``: TorchTrainer needs ``ray[train]`` and runs a training
function under its own session, with its own checkpoint and ``report`` API and its own restart rules; rlflow's
Trainer already checkpoints, resumes and reports faults (:mod:`rlflow.trainer.watchdog`). Ray is used for
what only it does here (finding nodes, reserving them, starting processes on them); the collectives stay
torch.distributed's, as under torchrun. This is also how verl itself uses Ray (placement groups and actors).

The rollout engines are colocated by default: each training process builds its own engine in its own
process, as on one machine (verl's hybrid engine). ``actor_rollout_ref.rollout.nnodes>0`` puts them in a
separate pool of nodes instead, vLLM servers as Ray actors (:mod:`rlflow.launch.rollout_pool`).

The driver waits for every worker. The first that dies (its actor died: killed, out of memory, ``os._exit``)
or fails (an exception, a non-zero exit code) stops the others; the driver exits non-zero naming the rank and
its node. ``ray`` is an optional extra (``pip install 'rlflow[ray]'``), imported only here, when used.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import socket
import sys
import time

from rlflow.launch import rollout_pool

INSTALL = "pip install 'ray[default]==2.60.0'"  # rlflow's `ray` extra


def find_cluster(configured: str | None = None, env=os.environ) -> str | None:
    """The cluster's address, found as verl's ``ray.init()`` finds it: ``ray_kwargs.ray_init.address``, else
    ``RAY_ADDRESS``, else the cluster the last ``ray start`` on this machine started (Ray's
    ``/tmp/ray/ray_current_cluster``, while a Ray GCS process runs here); ``None`` when there is none (or Ray
    is not installed). Nothing is started and nothing is connected to."""
    if configured:
        return str(configured)
    if env.get("RAY_ADDRESS"):
        return env["RAY_ADDRESS"]
    try:
        from ray._private.services import find_bootstrap_address, find_gcs_addresses
    except ImportError:
        return None
    latest = find_bootstrap_address(None)  # written by `ray start`, removed by `ray stop`
    return latest if latest and find_gcs_addresses() else None  # a file left by a crashed cluster is not one


def ray_installed() -> bool:
    return importlib.util.find_spec("ray") is not None


class RayLaunchError(RuntimeError):
    """The cluster cannot hold the job (too few nodes, or its resources never became free)."""


class Worker:
    """One training process: an actor that sets torchrun's environment, then runs the entry in its process."""

    def where(self) -> dict:
        import ray

        with socket.socket() as s:  # a free port on this node, used when this worker is rank 0
            s.bind(("", 0))
            port = s.getsockname()[1]
        return {"ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "gpus": [str(g) for g in ray.get_gpu_ids()], "port": port, "pid": os.getpid()}

    def prepare(self, modules: list[str]) -> None:
        for name in modules:  # imports only: nothing reads the rank's environment yet
            importlib.import_module(name)

    def run(self, entry: str, argv: list[str], env: dict[str, str]) -> int:
        os.environ.update(env)
        sys.argv = [entry, *argv]
        code = importlib.import_module(entry).main(argv)
        sys.stdout.flush()
        sys.stderr.flush()
        return int(code or 0)


def worker_env(rank: int, node: int, nnodes: int, per_node: int, master: dict, gpus: list[str]) -> dict[str, str]:
    """What torchrun sets in a worker (torch.distributed.run), for the worker of ``rank`` on node ``node``;
    on GPU every worker of a node sees that node's GPUs, its own at index LOCAL_RANK, as under torchrun."""
    world = nnodes * per_node
    env = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank % per_node, "LOCAL_WORLD_SIZE": per_node,
           "GROUP_RANK": node, "GROUP_WORLD_SIZE": nnodes, "ROLE_RANK": rank, "ROLE_WORLD_SIZE": world,
           "ROLE_NAME": "default", "MASTER_ADDR": master["ip"], "MASTER_PORT": master["port"],
           "TORCHELASTIC_RESTART_COUNT": 0, "TORCHELASTIC_MAX_RESTARTS": 0, "OMP_NUM_THREADS": 1}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    return {k: str(v) for k, v in env.items()}


def check_gpu_nodes(address: str, nnodes: int, per_node: int) -> None:
    """The driver's check of ``trainer.nnodes x trainer.n_gpus_per_node`` GPUs against the cluster's resources
    (``ray.nodes()``, ``ray.cluster_resources()``), not this machine's: the driver may run on a head node
    without a GPU. Raises :class:`RayLaunchError` naming what the cluster has."""
    import ray

    connected = ray.is_initialized()
    if not connected:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    try:
        gpus = sorted((int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n["Alive"]), reverse=True)
        total = int(ray.cluster_resources().get("GPU", 0))
    finally:
        if not connected:
            ray.shutdown()
    if sum(g >= per_node for g in gpus) < nnodes:
        raise RayLaunchError(
            f"trainer.nnodes={nnodes} trainer.n_gpus_per_node={per_node} asks for {nnodes} node(s) with {per_node} "
            f"GPU(s) each, but the Ray cluster at {address} has {sum(g >= per_node for g in gpus)} such node(s) "
            f"(GPUs per alive node: {gpus}, {total} in all); start GPU nodes with `ray start --address=HEAD:PORT "
            f"--num-gpus={per_node}`, or lower trainer.nnodes / trainer.n_gpus_per_node")


def reserve(ray, nnodes: int, per_node: int, use_gpu: bool, address: str, timeout: float = 120.0,
            pool: rollout_pool.Pool | None = None):
    """A placement group of one bundle per node (the training nodes', then the rollout pool's, all on
    different nodes); a clear error at once if the cluster has too few nodes for it, rather than a group that
    waits forever."""
    from ray.util.placement_group import placement_group

    bundle = {"CPU": per_node, "GPU": per_node} if use_gpu else {"CPU": per_node}
    nodes = [n for n in ray.nodes() if n["Alive"]]
    fit = [n for n in nodes if all(n["Resources"].get(k, 0) >= v for k, v in bundle.items())]
    what = f"{per_node} GPU(s)" if use_gpu else f"{per_node} CPU(s)"
    if len(fit) < nnodes:
        raise RayLaunchError(
            f"trainer.nnodes={nnodes} trainer.n_gpus_per_node={per_node}: the Ray cluster at {address} has "
            f"{len(nodes)} alive node(s), {len(fit)} of them with {what}; start more nodes with `ray start "
            f"--address=HEAD:PORT` (each with --num-{'gpus' if use_gpu else 'cpus'}={per_node} or more), or set "
            f"trainer.nnodes={len(fit)}" if fit else
            f"trainer.nnodes={nnodes} trainer.n_gpus_per_node={per_node}: no node of the Ray cluster at {address} "
            f"has {what} (its nodes: {[dict(n['Resources']) for n in nodes]})")
    bundles = [dict(bundle) for _ in range(nnodes)]
    if pool is not None:
        bundles += [rollout_pool.bundle(pool, use_gpu) for _ in range(pool.nnodes)]
        if len(nodes) < len(bundles):
            raise RayLaunchError(
                f"trainer.nnodes={nnodes} plus actor_rollout_ref.rollout.nnodes={pool.nnodes} (a separate rollout "
                f"pool, on nodes of its own) need {len(bundles)} nodes; the Ray cluster at {address} has "
                f"{len(nodes)} alive: start more with `ray start --address=HEAD:PORT`, or lower rollout.nnodes")
    group = placement_group(bundles, strategy="STRICT_SPREAD")
    if not group.wait(timeout):
        ray.util.remove_placement_group(group)
        raise RayLaunchError(f"the Ray cluster at {address} did not free {len(bundles)} node(s) ({bundles}) within "
                             f"{timeout:.0f} s (other jobs hold them? `ray status` shows what is in use)")
    return group


def run_workers(address: str, nnodes: int, per_node: int, argv: list[str], use_gpu: bool = False,
                entry: str = "rlflow.trainer.main_ppo", env: dict[str, str] | None = None,
                pool: rollout_pool.Pool | None = None) -> int:
    """Place ``nnodes x per_node`` workers running ``entry.main(argv)`` on the cluster at ``address`` (and
    the rollout ``pool``'s servers on nodes of their own, their URLs added to ``argv``), wait for them, return
    0 when all returned 0; else stop the rest and return 1 after naming the rank and node."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    passed = {k: os.environ[k] for k in ("PYTHONPATH", "PYTHONUNBUFFERED", "RLFLOW_HEARTBEAT_TIMEOUT",
                                         "RLFLOW_HEARTBEAT_STARTUP") if k in os.environ}
    ray.init(address=address, log_to_driver=True, runtime_env={"env_vars": {**passed, **(env or {})}} if (
        passed or env) else None)
    servers = []
    try:
        group = reserve(ray, nnodes, per_node, use_gpu, address, pool=pool)
        if pool is not None:  # the servers first: the training ranks get their URLs on the command line
            servers, places = rollout_pool.start_pool(ray, group, nnodes, pool, use_gpu)
        actor = ray.remote(Worker)
        workers = [actor.options(num_cpus=1, num_gpus=1 if use_gpu else 0, scheduling_strategy=(
            PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank // per_node))).remote()
            for rank in range(nnodes * per_node)]
        where = ray.get([w.where.remote() for w in workers])
        if pool is not None:  # the ranks import what they will need while the servers load (both take a while)
            imported = [w.prepare.remote([entry, *rollout_pool.TRAINER_IMPORTS]) for w in workers]
            rollout_pool.wait_pool(ray, servers)
            ray.get(imported)
            print(f"[rlflow] rollout pool: {len(places)} vLLM server(s) on {pool.nnodes} node(s) of their own: "
                  + ", ".join(f"{p['url']} ({p['node_id'][:8]})" for p in places), flush=True)
            argv = rollout_pool.trainer_arguments(argv, places)
        gpus = [[g for r in range(node * per_node, (node + 1) * per_node) for g in where[r]["gpus"]]
                for node in range(nnodes)]
        print(f"[rlflow] {nnodes} node(s) x {per_node} worker(s) on the Ray cluster at {address}: "
              + ", ".join(f"node {n} = {where[n * per_node]['ip']} ({where[n * per_node]['node_id'][:8]})"
                          for n in range(nnodes)), flush=True)
        runs = {w.run.remote(entry, argv, worker_env(rank, rank // per_node, nnodes, per_node, where[0],
                                                     gpus[rank // per_node])): rank
                for rank, w in enumerate(workers)}
        code = wait(ray, runs, workers, where, per_node)
        time.sleep(1.0)  # Ray forwards the workers' output from their log files every few 100 ms: the last
        return code      # lines (the run's summary) would be lost at shutdown
    finally:
        if servers:
            rollout_pool.stop_pool(ray, servers)
            print(f"[rlflow] rollout pool: stopped {len(servers)} vLLM server(s)", flush=True)
        ray.shutdown()  # the placement group and the actors end with the driver's job


def wait(ray, runs: dict, workers: list, where: list[dict], per_node: int) -> int:
    """Wait for every worker; the first failure stops the others and is named."""
    pending = list(runs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        rank = runs[done[0]]
        try:
            code, why = ray.get(done[0]), None
            if code != 0:
                why = f"exited with code {code}"
        except ray.exceptions.RayActorError as e:  # the process died: killed, out of memory, os._exit
            why = f"its process died ({type(e).__name__}: {str(e).strip().splitlines()[0]})"
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if getattr(e, "cause", None) is not None else e
            why = f"raised {type(cause).__name__}: {str(cause).strip().splitlines()[-1]}"
        if why is not None:
            started = time.monotonic()
            for w in workers:
                ray.kill(w)
            place = where[rank]
            print(f"rlflow: rank {rank} (node {rank // per_node}, {place['ip']}, Ray node "
                  f"{place['node_id'][:8]}, pid {place['pid']}) {why}; stopped the other "
                  f"{len(workers) - 1} rank(s) in {time.monotonic() - started:.1f} s. Start the run again with "
                  "trainer.resume_mode=auto to continue from the last checkpoint", file=sys.stderr, flush=True)
            return 1
    return 0
