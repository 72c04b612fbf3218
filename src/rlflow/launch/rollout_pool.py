"""A separate pool of rollout nodes on a Ray cluster: vLLM servers started as Ray actors on nodes of their own.

verl's keys choose it, as in its one-step-off and fully-async recipes (verl's standalone rollout): with a Ray
cluster running, ``actor_rollout_ref.rollout.nnodes=M`` (> 0) and ``actor_rollout_ref.rollout.n_gpus_per_node=G``
reserve M nodes beside the ``trainer.nnodes`` training nodes (one placement group, ``STRICT_SPREAD``, so no
rollout node is a training node: :func:`rlflow.launch.ray.reserve`). Each rollout node runs one actor that
holds the node's bundle (G GPUs on GPU, G CPUs on CPU) and starts a vLLM OpenAI server as its child process
(``--tensor-parallel-size`` = ``rollout.tensor_model_parallel_size`` on GPU, G // TP servers per node). The
driver waits until every server answers ``/health`` (a server that exits first is named with the end of its
log), then hands their URLs to the training ranks as ``actor_rollout_ref.rollout.server.url=[...]``: the
Trainer builds its :class:`~rlflow.rollout.server.ServerRollout` fleet from them and does not know about Ray.
Weights reach the servers by ``rlflow_gloo`` (the servers being on other machines by construction): one
gloo group over the trainer's rank 0 and every server's workers, each bucket passed down it once
(:class:`~rlflow.rollout.engines.weight_transfer_gloo.FleetBroadcast` for several servers, a fleet):
``actor_rollout_ref.rollout.server.weight_transfer``, unless the command sets another backend. A fleet
with ``weight_transfer=reload`` (or another backend) takes its updates through
``rollout.server.checkpoint_dir`` (a shared folder: required then).
The servers stop when the run ends or fails (the driver stops them, and the actors end with its job).

The actor builds the server's command line where it runs (``rlflow.rollout.server.vllm_server_command``,
imported by name in the actor's process, like the training entry of :class:`rlflow.launch.ray.Worker`): the
driver stays free of torch, vLLM and transformers.
"""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

R = "actor_rollout_ref.rollout"
GLOO = "rlflow_gloo"  # weight_transfer_gloo.GLOO, not imported: that module imports torch, which the driver does not
# what a training rank of a pool imports anyway (torch, transformers, the server rollout), imported while
# the servers start: on a 2-core CI machine about 15 s of the rank's start-up
TRAINER_IMPORTS = ("rlflow.config.verl.plan", "rlflow.rollout.server")


@dataclass(frozen=True)
class Pool:
    """The rollout pool a config asks for: ``nnodes`` nodes of ``per_node`` devices, ``tp`` per server."""

    nnodes: int
    per_node: int
    tp: int = 1
    server: dict = field(default_factory=dict)  # vllm_server_command's arguments, from the rollout keys

    def servers_per_node(self, use_gpu: bool) -> int:
        return max(self.per_node // self.tp, 1) if use_gpu else 1


def pool_from_config(flat: dict, use_gpu: bool) -> Pool | None:
    """``rollout.nnodes > 0``: the pool; else None (generation on the training processes, or on the servers
    of ``rollout.server.url``). A bad combination is a ValueError naming the keys."""
    nnodes = int(flat.get(f"{R}.nnodes") or 0)
    if nnodes <= 0:
        return None
    per_node = int(flat.get(f"{R}.n_gpus_per_node") or flat.get("trainer.n_gpus_per_node") or 1)
    tp = int(flat.get(f"{R}.tensor_model_parallel_size") or 1) if use_gpu else 1
    if flat.get(f"{R}.name") != "vllm":
        raise ValueError(f"{R}.nnodes={nnodes}: a separate rollout pool runs vLLM servers; set {R}.name=vllm "
                         f"(got {flat.get(f'{R}.name')!r})")
    if flat.get(f"{R}.server.url"):
        raise ValueError(f"{R}.nnodes={nnodes} starts the rollout servers; {R}.server.url names servers already "
                         "running: set one or the other")
    if use_gpu and per_node % tp:
        raise ValueError(f"{R}.n_gpus_per_node={per_node} is not a multiple of {R}.tensor_model_parallel_size={tp}")
    servers = nnodes * (per_node // tp if use_gpu else 1)
    transfer = flat.get(f"{R}.server.weight_transfer") or "auto"
    if servers > 1 and transfer not in ("auto", GLOO) and not flat.get(f"{R}.server.checkpoint_dir"):
        raise ValueError(f"{R}.nnodes={nnodes} x {R}.n_gpus_per_node={per_node} starts {servers} vLLM servers, a "
                         f"fleet, which with {R}.server.weight_transfer={transfer} takes each update through a "
                         f"checkpoint folder every server reads: set {R}.server.checkpoint_dir to a folder on a file "
                         f"system the rollout nodes share, or leave weight_transfer unset ({GLOO}: one gloo group "
                         "over the trainer and every server, no folder)")
    kv = (flat.get(f"{R}.engine_kwargs.vllm") or {}).get("kv_cache_memory_bytes")
    max_len = flat.get(f"{R}.max_model_len") or (flat.get("data.max_prompt_length", 0) + flat.get(f"{R}.response_length", 0))
    seed = flat.get(f"{R}.seed") if flat.get(f"{R}.seed") is not None else flat.get("data.seed", 0)
    server = {"model_dir": flat["actor_rollout_ref.model.path"], "dtype": flat.get(f"{R}.dtype", "auto"),
              "max_model_len": int(max_len) or None, "enforce_eager": bool(flat.get(f"{R}.enforce_eager")),
              "enable_prefix_caching": bool(flat.get(f"{R}.enable_prefix_caching", True)), "seed": int(seed or 0),
              "kv_cache_memory_bytes": None if use_gpu else int(kv or 256 * 2**20),
              "extra": ("--tensor-parallel-size", str(tp), "--gpu-memory-utilization",
                        str(flat.get(f"{R}.gpu_memory_utilization", 0.5))) if use_gpu else ()}
    return Pool(nnodes, per_node, tp, server)


def bundle(pool: Pool, use_gpu: bool) -> dict:
    return {"CPU": 1, "GPU": pool.per_node} if use_gpu else {"CPU": pool.per_node}


class Server:
    """One vLLM server on a rollout node: a Ray actor that starts it as a child process and stops it."""

    def __init__(self):
        self.process, self.log, self.url = None, None, None

    def start(self, server: dict) -> dict:
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
        serving = importlib.import_module("rlflow.rollout.server")  # vLLM's side, on this node only
        args = dict(server)
        cmd = serving.vllm_server_command(args.pop("model_dir"), port, host=ip, **args)
        self.log = os.path.join(tempfile.gettempdir(), f"rlflow-pool-server-{port}.log")
        env = {**os.environ, **serving.VLLM_SERVER_ENV}
        env.setdefault("OMP_NUM_THREADS", "1")
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        self.url = f"http://{ip}:{port}"
        return {"url": self.url, "ip": ip, "node_id": ray.get_runtime_context().get_node_id(),
                "pid": self.process.pid, "log": self.log}

    def wait(self, timeout: float) -> str:
        """Until the server answers ``/health``; raises naming its exit and the end of its log."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as answer:
                    if answer.status == 200:
                        return self.url
            except OSError:
                pass
            code = self.process.poll()
            if code is not None or time.monotonic() > deadline:
                with open(self.log, errors="replace") as f:
                    tail = f.read()[-3000:]
                what = f"exited with code {code}" if code is not None else f"did not answer within {timeout:.0f} s"
                raise RuntimeError(f"the vLLM server at {self.url} {what}; its log ({self.log}) ends:\n{tail}")
            time.sleep(0.5)

    def stop(self) -> int | None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, 15)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait()
        return None if self.process is None else self.process.returncode


def start_pool(ray, group, first_bundle: int, pool: Pool, use_gpu: bool):
    """Start the pool's servers in bundles ``first_bundle ...`` of ``group`` (not waiting for them: see
    :func:`wait_pool`); returns ``(actors, places)`` (``places``: each server's url / ip / node_id / pid / log)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    actor, per_node = ray.remote(Server), pool.servers_per_node(use_gpu)
    actors = [actor.options(num_cpus=1 if use_gpu else pool.per_node, num_gpus=pool.tp if use_gpu else 0,
                            scheduling_strategy=PlacementGroupSchedulingStrategy(
                                group, placement_group_bundle_index=first_bundle + i // per_node)).remote()
              for i in range(pool.nnodes * per_node)]
    try:
        return actors, ray.get([a.start.remote(pool.server) for a in actors])
    except Exception:
        stop_pool(ray, actors)
        raise


def wait_pool(ray, actors, timeout: float = 900.0) -> None:
    """Until every server answers ``/health``; the first that exits (or times out) raises, naming its log."""
    ray.get([a.wait.remote(timeout) for a in actors])


def stop_pool(ray, actors) -> None:
    """Stop every server (its process group), then its actor; a dead actor is skipped."""
    for stopped in [a.stop.remote() for a in actors]:
        try:
            ray.get(stopped, timeout=60)
        except Exception:  # noqa: BLE001 - the actor died already: its child went with its session
            pass
    for a in actors:
        ray.kill(a)


def trainer_arguments(argv: list[str], places: list[dict]) -> list[str]:
    """The training ranks' command line: the servers' URLs, and weights by gloo unless the command chose
    another backend (``auto`` picks gloo for a server on another machine anyway, and a fleet takes gloo or
    the disk)."""
    urls = ",".join(p["url"] for p in places)
    extra = [f"{R}.server.url=[{urls}]"]
    chosen = [a.split("=", 1)[1] for a in argv if a.split("=", 1)[0].lstrip("+") == f"{R}.server.weight_transfer"]
    if not chosen or chosen[-1].strip("'\"") == "auto":
        extra.append(f"{R}.server.weight_transfer={GLOO}")
    return [*argv, *extra]

