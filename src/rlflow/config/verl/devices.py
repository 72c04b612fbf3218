"""Devices, processes, strategy and precision of a verl config, checked against this machine."""

from __future__ import annotations

import os
from dataclasses import dataclass

from rlflow.config.verl import megatron as megatron_keys
from rlflow.config.verl.loading import ConfigError, NotSupportedError, VerlConfig
from rlflow.launch import ray as ray_launch

OFFLOAD_KEYS = (
    "actor_rollout_ref.actor.fsdp_config.param_offload", "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
    "actor_rollout_ref.actor.fsdp_config.offload_policy", "actor_rollout_ref.ref.fsdp_config.param_offload",
)
CRITIC_OFFLOAD_KEYS = ("critic.model.fsdp_config.param_offload", "critic.model.fsdp_config.optimizer_offload",
                       "critic.model.fsdp_config.offload_policy",  # and verl 0.9's names of the same three:
                       "critic.fsdp.param_offload", "critic.fsdp.optimizer_offload", "critic.fsdp.offload_policy")


@dataclass(frozen=True)
class Devices:
    accelerator: str      # "cpu" or "cuda", for lightning_fabric.Fabric
    precision: str        # Fabric precision, e.g. "32-true"
    strategy: object      # Fabric strategy: a name, or a strategy object (Megatron)
    processes: int        # n_gpus_per_node x nnodes
    per_node: int         # processes per node (Fabric's devices)
    nnodes: int
    offload: bool         # a CPU-offload key is on (only possible on CPU for now)
    strategy_kwargs: dict | None = None  # a strategy object's constructor arguments (the tree's node of it)


# Device nodes a CUDA (or ROCm, or WSL) GPU shows; without any, there is no GPU and torch need not load.
GPU_NODES = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def cuda_count() -> int:
    """CUDA devices torch sees; 0 at once (without importing torch) on a machine with no GPU driver."""
    if not any(os.path.exists(p) for p in GPU_NODES):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_devices(cfg: VerlConfig, notes: list[str], with_critic: bool, record: bool = True) -> Devices:
    """Check the request against the machine: too many GPUs and multi-process runs are clear errors.

    ``record=False`` (validation) reads the keys without counting them as used.
    """
    get = cfg.__getitem__ if record else cfg.flat.get
    device, per_node, nnodes = get("trainer.device"), get("trainer.n_gpus_per_node"), get("trainer.nnodes")
    found = cuda_count()
    if device not in ("auto", "cuda", "cpu"):
        raise NotSupportedError("trainer.device", device, f"device '{device}'", "Use trainer.device=cpu or cuda.")
    if per_node < 1 or nnodes < 1:
        raise ConfigError(f"trainer.n_gpus_per_node={per_node}, trainer.nnodes={nnodes}: both must be >= 1")
    wants_gpu = device == "cuda" or (device == "auto" and (found > 0 or per_node > 1))
    pool = (cfg.flat.get("actor_rollout_ref.rollout.nnodes") or 0) > 0
    if wants_gpu and per_node > found and (nnodes > 1 or pool) and not under_torchrun():
        # the driver of a Ray job: its workers run on the cluster's GPU nodes, not on this one (a head node
        # without a GPU is common), so the cluster's resources are what must fit
        address = ray_launch.find_cluster(cfg.flat.get("ray_kwargs.ray_init.address"))
        if address is not None:
            try:
                ray_launch.check_gpu_nodes(address, nnodes, per_node)
            except ray_launch.RayLaunchError as e:
                raise ConfigError(str(e)) from None
            found = per_node
    if wants_gpu and per_node > found:
        fix = (f"trainer.device=cpu trainer.n_gpus_per_node=1 (or keep trainer.n_gpus_per_node={per_node} "
               f"with trainer.device=cpu to run {per_node} CPU processes)"
               if found == 0 else f"trainer.n_gpus_per_node={found}")
        raise ConfigError(
            f"trainer.n_gpus_per_node={per_node} asks for {per_node} GPU(s) per node, but this machine has {found} "
            f"CUDA device(s) (torch.cuda.device_count() = {found}). To run on what is here, add: {fix}")
    accelerator = "cuda" if wants_gpu else "cpu"
    processes = per_node * nnodes
    strategy, strategy_kwargs = "auto", None
    if record:  # the plan; validation (record=False) stays torch-free: rlflow.strategies imports Lightning
        if megatron_keys.wants_megatron(cfg):
            strategy, strategy_kwargs = megatron_keys.megatron_strategy(cfg, notes, processes, accelerator, with_critic)
        else:
            megatron_keys.check_no_megatron_sizes(cfg)
    for role in () if strategy != "auto" else ("actor_rollout_ref.actor", "critic") if with_critic else (
            "actor_rollout_ref.actor",):
        if get(f"{role}.strategy") in ("fsdp", "fsdp2"):
            if processes == 1:
                if cfg.is_provided(f"{role}.strategy"):  # verl's default needs no note
                    notes.append(f"{role}.strategy={get(f'{role}.strategy')} on 1 process: rlflow runs Fabric's "
                                 "single-device strategy (FSDP shards across processes; with one there is nothing "
                                 "to shard)")
            else:
                strategy = "fsdp2"  # verl's fsdp and fsdp2 both mean FSDP2 (fully_shard) here
    offload = False
    for key in OFFLOAD_KEYS + (CRITIC_OFFLOAD_KEYS if with_critic else ()):
        if get(key):
            if accelerator != "cpu":
                raise NotSupportedError(key, True, "CPU offloading on a single GPU",
                                        "It needs FSDP2 across processes (the distributed issue).")
            offload = True
            notes.append(f"{key}=True: on trainer.device=cpu the weights and optimizer state already live in "
                         "CPU memory, so there is nothing more to offload")
    precision = get("trainer.precision")
    if precision == "auto":
        precision = "bf16-mixed" if accelerator == "cuda" else "32-true"
    return Devices(accelerator, precision, strategy, processes, per_node, nnodes, offload, strategy_kwargs)


def under_torchrun(env=os.environ) -> bool:
    """A torchrun (torch.distributed.run) worker: it sets LOCAL_RANK, WORLD_SIZE and the rendezvous."""
    return "LOCAL_RANK" in env and "WORLD_SIZE" in env


def check_launcher(per_node: int, nnodes: int, env=os.environ, ray_address: str | None = None,
                   rollout_nodes: int = 0) -> str | None:
    """Before anything loads: several nodes need a launcher on each node (torchrun) or a Ray cluster, and a
    torchrun job must be the size the config says (else every rank would train a different job, or wait
    forever for ranks that never come). Returns the Ray cluster's address when the run is to be placed on
    one (``trainer.nnodes>1`` outside torchrun, or a separate rollout pool, ``rollout_nodes`` =
    ``actor_rollout_ref.rollout.nnodes`` > 0, with a cluster running; ``ray_address``:
    ``ray_kwargs.ray_init.address``). A rollout pool without a cluster keeps verl's note: generation stays on
    the training processes."""
    if under_torchrun(env):
        world, local = int(env["WORLD_SIZE"]), int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"]))
        if world != per_node * nnodes or local != per_node:
            raise ConfigError(
                f"torchrun started {world} process(es), {local} on this node, but trainer.nnodes x "
                f"trainer.n_gpus_per_node = {nnodes} x {per_node} = {nnodes * per_node}: set "
                f"trainer.nnodes={world // max(local, 1)} trainer.n_gpus_per_node={local} (or start torchrun with "
                f"--nnodes {nnodes} --nproc_per_node {per_node})")
        return None
    if rollout_nodes > 0 and nnodes == 1:
        return ray_launch.find_cluster(ray_address, env)
    if nnodes > 1:
        address = ray_launch.find_cluster(ray_address, env)
        if address is not None:
            return address
        ray = ("start a Ray cluster (verl's way): `ray start --head --port=6379` on the head node and `ray start "
               "--address=HEAD:6379` on every other node, then run this command on any of them (it finds the "
               "cluster through ray_kwargs.ray_init.address, RAY_ADDRESS or the one running on this machine)"
               if ray_launch.ray_installed() else
               f"install Ray ({ray_launch.INSTALL}, rlflow's `ray` extra) and start a Ray cluster: `ray start "
               "--head --port=6379` on the head node, `ray start --address=HEAD:6379` on the others")
        raise ConfigError(
            f"trainer.nnodes={nnodes}: no Ray cluster found (ray_kwargs.ray_init.address and RAY_ADDRESS are unset "
            f"and no Ray cluster runs on this machine). Either {ray};\n"
            f"or start torchrun on every node (the same command on each, HEAD = the first node's address):\n"
            f"  torchrun --nnodes {nnodes} --nproc_per_node {per_node} --rdzv-backend c10d --rdzv-endpoint HEAD:29500 "
            f"--rdzv-id JOB -m rlflow.trainer.main_ppo trainer.nnodes={nnodes} trainer.n_gpus_per_node={per_node} ...\n"
            "or on SLURM: `rlflow launch --slurm --nodes N ... --dry-run` writes the sbatch script (docs/multi-node.md)")
    return None
