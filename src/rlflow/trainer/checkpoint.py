"""Checkpoint layout (verl's): ``<dir>/global_step_N/state.ckpt`` and ``latest_checkpointed_iteration.txt``."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

TRACKER = "latest_checkpointed_iteration.txt"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"global_step_{step}"


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint named by the tracker file, or ``None`` when there is none."""
    tracker = Path(root) / TRACKER
    if not tracker.exists():
        return None
    path = step_dir(root, int(tracker.read_text().strip()))
    return path if path.exists() else None


def mark_latest(root: str | Path, step: int) -> None:
    Path(root, TRACKER).write_text(str(step))


def rng_state() -> dict:
    """Every RNG a step draws from, so a resumed run samples exactly what an uninterrupted one would."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    # plain types and tensors only, so the checkpoint loads with torch.load(weights_only=True)
    numpy_state = [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)]
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_state}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_hf_metadata(folder: Path, model, tokenizer) -> None:
    """Config and tokenizer beside the weights (verl's ``huggingface/``), so export needs nothing else."""
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


# ---------------------------------------------------------------- a Trainer's checkpoint
def stateful_roles(trainer) -> dict:
    """Non-model roles that carry state across steps (an adaptive KL coefficient, say)."""
    roles = {"rollout": trainer.rollout, "reward": trainer.reward, "estimator": trainer.estimator, "loss": trainer.loss}
    return {k: m for k, m in roles.items() if hasattr(m, "state_dict") and hasattr(m, "load_state_dict")}


def trainer_state(trainer) -> dict:
    """What ``state.ckpt`` holds: the policy and its optimizer (live objects Fabric saves and loads in place)."""
    return {"policy": trainer.policy.module, "optimizer": trainer.optimizer, "global_step": trainer.global_step,
            "schedulers": [s.state_dict() for s in trainer.schedulers],
            "loader": trainer.loader.state_dict() if trainer.loader else None, "rng": rng_state(),
            "roles": {name: m.state_dict() for name, m in stateful_roles(trainer).items()}}


def critic_state(trainer) -> dict:
    """The critic's share of a checkpoint, in a file of its own: a sharded checkpoint holds one model."""
    return {"critic": trainer.critic.module, "critic_optimizer": trainer.critic_optimizer}


def save(trainer) -> Path:
    """Write ``<checkpoint_dir>/global_step_N/state.ckpt`` (and ``critic.ckpt``) and mark it latest."""
    fabric = trainer.fabric
    path = step_dir(trainer.checkpoint_dir, trainer.global_step)
    fabric.save(path / "state.ckpt", trainer_state(trainer))
    if trainer.critic is not None:
        fabric.save(path / "critic.ckpt", critic_state(trainer))
    if fabric.global_rank == 0:
        save_hf_metadata(path / "huggingface", trainer.policy.model, trainer.policy.tokenizer)
        mark_latest(trainer.checkpoint_dir, trainer.global_step)
    fabric.barrier()
    return path


def load(trainer, path: str | Path) -> None:
    """Restore model, optimizer, schedule, RNG, data position and step from a checkpoint folder."""
    state = trainer_state(trainer)
    state |= trainer.fabric.load(Path(path) / "state.ckpt", state)
    if trainer.critic is not None:
        trainer.fabric.load(Path(path) / "critic.ckpt", critic_state(trainer))
    trainer.global_step = int(state["global_step"])
    for sched, s in zip(trainer.schedulers, state["schedulers"]):
        sched.load_state_dict(s)
    if trainer.loader is not None and state.get("loader"):
        trainer.loader.load_state_dict(state["loader"])
    set_rng_state(state["rng"])
    for name, m in stateful_roles(trainer).items():
        m.load_state_dict(state["roles"][name])
    trainer.rollout.sync_weights(trainer.policy.model)  # an engine with its own copy must see the loaded weights


def resume(trainer) -> None:
    """Load ``trainer.resume`` (``"auto"``: the latest checkpoint, if any) before the first step."""
    if trainer.resume is None:
        return
    path = latest_checkpoint(trainer.checkpoint_dir) if trainer.resume == "auto" else Path(trainer.resume)
    if path is None:
        return
    load(trainer, path)
    trainer.fabric.print(f"resumed from {path} at step {trainer.global_step}")
