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
