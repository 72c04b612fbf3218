"""Checkpoints in verl's layout, written atomically, that resume on any number of processes.

One folder holds a run: ``run_dir`` (the verl entry point's ``trainer.default_local_dir``)::

    run_dir/
      latest_checkpointed_iteration.txt   # the step of the newest complete checkpoint (written last)
      global_step_N/
        state.ckpt        # policy, optimizer, schedule, data position, RNG: a file (one process, DDP)
                          # or a torch.distributed.checkpoint folder (FSDP2, one shard per rank)
        critic.ckpt       # the same for the critic, when there is one
        huggingface/      # config and tokenizer, so ``rlflow export`` needs nothing else
        lora_adapter/     # with LoRA: the adapter's config (state.ckpt then holds the adapter, not the base weights)
      metrics.jsonl, csv/, tensorboard/   # the loggers' files

Atomic: a checkpoint is written into ``.global_step_N.partial`` and renamed to ``global_step_N`` when
complete; the tracker file is replaced (``os.replace``) after that. A process killed at any point
leaves the previous checkpoint and a tracker that names a complete folder.

Rotation (``RunDir(keep_checkpoints=N)``, verl's ``max_*_ckpt_to_keep``): after the tracker names the new
checkpoint, older ``global_step_*`` folders beyond the newest N are renamed to hidden ``.global_step_K.old``
folders (one atomic step each) and deleted; a run killed while deleting leaves hidden folders only, which
the next save removes.

Asynchronous (``Trainer(async_save=True)``, verl's ``checkpoint.async_save``): the state is copied off the
training tensors into CPU memory (the step waits for that only), and a background thread writes the files,
publishes the folder and moves the tracker, in the same order; the next save, a load and the end of ``fit``
wait for it (an error it met is raised there). Sharded checkpoints (FSDP2, Megatron: every rank writes its
shard) are written synchronously.

Any layout: a one-file checkpoint loads on FSDP2 (Fabric consolidates it), and a sharded folder loads on
one process or on DDP (:func:`load_sharded_unsharded`), whatever the number of ranks that wrote it.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import threading
import warnings
from pathlib import Path

from rlflow.trainer.watchdog import phase  # a rank that dies or fails while saving is reported so (stdlib only)


# torch, numpy and Lightning are imported where used: the config check (check_run_dir) stays light.

TRACKER = "latest_checkpointed_iteration.txt"
STEP_DIR = re.compile(r"global_step_(\d+)")
PARTIAL = ".partial"  # suffix of a checkpoint being written (a dot-folder: never taken for a checkpoint)
LIGHTNING_METADATA = "meta.pt"  # the non-tensor part of a sharded Fabric checkpoint


class CheckpointError(RuntimeError):
    """A checkpoint (or the folder for it) cannot be written or read; the message names the path."""


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"global_step_{step}"


def partial_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f".global_step_{step}{PARTIAL}"


def complete_steps(root: str | Path) -> list[int]:
    """Steps of the finished ``global_step_N`` folders under ``root``, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := STEP_DIR.fullmatch(p.name)) and p.is_dir())


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint the tracker file names (verl's rule); without a usable tracker, the newest complete
    ``global_step_N`` (a run killed after its first checkpoint was renamed, before the tracker was written)."""
    root = Path(root)
    tracker = root / TRACKER
    text = tracker.read_text().strip() if tracker.is_file() else ""
    if text.isdigit() and step_dir(root, int(text)).is_dir():
        return step_dir(root, int(text))
    steps = complete_steps(root)
    return step_dir(root, steps[-1]) if steps else None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def mark_latest(root: str | Path, step: int) -> None:
    """Replace the tracker file in one step (write a temporary file, then ``os.replace``)."""
    tmp = Path(root, f".{TRACKER}.tmp")
    with open(tmp, "w") as f:
        f.write(str(step))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, Path(root, TRACKER))
    _fsync(Path(root))


def publish(partial: Path, final: Path) -> None:
    """Make a fully written ``partial`` folder the checkpoint ``final`` (flushed to disk, then renamed)."""
    for dirpath, _, files in os.walk(partial):
        for name in files:
            _fsync(Path(dirpath, name))
    if final.exists():  # a step written again after resuming from an older checkpoint: swap, then drop the old one
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(partial, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(partial, final)
    _fsync(final.parent)


def rotate(root: str | Path, keep: int | None, latest: int) -> list[int]:
    """Delete the complete checkpoints older than the newest ``keep`` up to step ``latest`` (the one the tracker
    names, never deleted); returns the deleted steps. ``keep`` None or <= 0 keeps all (verl's rule for
    ``max_ckpt_to_keep``). Folders of later steps (left by a run that resumed from an earlier checkpoint,
    replaced when this run reaches them) are not counted and not touched."""
    if not keep or keep <= 0:
        return []
    steps = [s for s in complete_steps(root) if s <= latest]
    doomed = [s for s in steps[:-keep] if s != latest]
    for s in doomed:  # hidden in one rename first: a half-deleted folder is never taken for a checkpoint
        hidden = Path(root, f".global_step_{s}.old")
        shutil.rmtree(hidden, ignore_errors=True)
        os.replace(step_dir(root, s), hidden)
        shutil.rmtree(hidden, ignore_errors=True)
    return doomed


def checkpoint_bytes(*modules) -> int:
    """A checkpoint's size: the weights and AdamW's two moments of each module (full, not per-rank, sizes)."""
    return sum(3 * p.numel() * p.element_size() for m in modules if m is not None for p in m.parameters())


def check_run_dir(run_dir: str | Path, need_bytes: int = 0) -> None:
    """Fail now, with the path in the message, if ``run_dir`` cannot be created or written, or has less free
    space than ``need_bytes`` (a checkpoint is written beside the previous one, which stays until the new one
    is complete)."""
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".rlflow-write-test-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(f"run folder {run_dir} is not writable ({e.strerror or e}): choose another "
                              "run_dir / trainer.default_local_dir") from None
    free = shutil.disk_usage(run_dir).free
    if need_bytes and free < need_bytes:
        raise CheckpointError(f"run folder {run_dir}: {free / 2**20:.0f} MiB free, a checkpoint needs about "
                              f"{need_bytes / 2**20:.0f} MiB: free some space or choose another folder")


# ---------------------------------------------------------------- RNG and Hugging Face metadata
def rng_state() -> dict:
    """Every RNG a step draws from, so a resumed run samples exactly what an uninterrupted one would."""
    import numpy as np
    import torch

    name, keys, pos, has_gauss, gauss = np.random.get_state()
    # plain types and tensors only, so the checkpoint loads with torch.load(weights_only=True)
    numpy_state = [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)]
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_state}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_hf_metadata(folder: Path, model, tokenizer) -> None:
    """Config and tokenizer beside the weights (verl's ``huggingface/``), so export needs nothing else;
    for a LoRA policy also the adapter's config in ``lora_adapter/`` next to it (export merges onto its base model)."""
    from rlflow.models.policy import lora_module

    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    if (lora := lora_module(model)) is not None:
        lora.save_adapter_config(model, folder.parent / lora.ADAPTER_DIR)


# ---------------------------------------------------------------- a sharded checkpoint on unsharded models
def load_sharded_unsharded(path: Path, state: dict) -> dict:
    """Load a ``torch.distributed.checkpoint`` folder (written by FSDP2 on any number of ranks) into
    unsharded objects, as ``fabric.load`` does for its own format: modules and optimizers in place, the
    rest of ``state`` replaced by the saved values; returns the saved entries ``state`` did not ask for.

    Works without a process group (one process) and on DDP (every rank reads the whole checkpoint).
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from lightning_fabric.wrappers import _unwrap_objects
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    state_objs = {k: _unwrap_objects(v) for k, v in state.items()}
    modules = {k: v for k, v in state_objs.items() if isinstance(v, torch.nn.Module)}
    optimizers = {k: v for k, v in state_objs.items() if isinstance(v, torch.optim.Optimizer)}
    (module_key, module), = modules.items()  # Fabric writes one model per sharded checkpoint
    no_dist = not torch.distributed.is_initialized()  # one process: read every shard here
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process": yes
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        model_state = {module_key: get_model_state_dict(module)}
        dcp.load(model_state, checkpoint_id=path, no_dist=no_dist)
        module.load_state_dict(model_state[module_key])
        for key, opt in optimizers.items():  # parameter-name keyed, as FSDP2 wrote them
            opt_state = {key: get_optimizer_state_dict(module, opt)}
            dcp.load(opt_state, checkpoint_id=path, no_dist=no_dist)
            set_optimizer_state_dict(module, opt, optim_state_dict=opt_state[key])
    metadata = torch.load(path / LIGHTNING_METADATA, weights_only=False)  # our own file
    for key in state.keys() - modules.keys() - optimizers.keys():
        if key in metadata:
            state[key] = metadata.pop(key)
    return metadata


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


def remove_hidden(root: str | Path) -> None:
    """Delete the hidden folders a run killed while saving (``.partial``) or rotating (``.old``) left."""
    for stale in Path(root).glob(".global_step_*"):
        shutil.rmtree(stale, ignore_errors=True)


def save(trainer) -> Path:
    """Write ``<run_dir>/global_step_N`` atomically (see the module docstring) and mark it latest; with
    ``trainer.async_save``, in the background after a copy of the state (:func:`wait` joins it)."""
    from rlflow.strategies import shards_parameters

    with phase("save"):
        wait(trainer)  # one save in flight at a time
        if getattr(trainer, "async_save", False) and not shards_parameters(trainer.fabric.strategy):
            return _save_in_background(trainer)
        return _save(trainer)


def _snapshot(fabric, state: dict) -> dict:
    """What ``fabric.save`` would write, copied to CPU memory: training can change the live tensors at once."""
    import torch
    from lightning_fabric.wrappers import _unwrap_objects

    def copy(value):
        if isinstance(value, torch.Tensor):
            return value.detach().to("cpu", copy=True)
        if isinstance(value, dict):
            return {k: copy(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(copy(v) for v in value)
        return value

    out = {}
    for key, obj in _unwrap_objects(state).items():
        if isinstance(obj, torch.nn.Module):
            obj = fabric.strategy.get_module_state_dict(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            obj = fabric.strategy.get_optimizer_state(obj)
        out[key] = copy(obj)
    return out


def _save_in_background(trainer) -> Path:
    fabric, root, step = trainer.fabric, trainer.checkpoint_dir, trainer.global_step
    partial, final = partial_dir(root, step), step_dir(root, step)
    if fabric.global_rank == 0:  # one process or DDP: rank 0 writes the files, as fabric.save does
        files = {"state.ckpt": _snapshot(fabric, trainer_state(trainer))}
        if trainer.critic is not None:
            files["critic.ckpt"] = _snapshot(fabric, critic_state(trainer))
        remove_hidden(root)
        save_hf_metadata(partial / "huggingface", trainer.policy.model, trainer.policy.tokenizer)
        keep, errors = getattr(trainer, "keep_checkpoints", None), []

        def write():
            try:
                for name, state in files.items():
                    fabric.strategy.checkpoint_io.save_checkpoint(state, partial / name)
                publish(partial, final)
                mark_latest(root, step)
                rotate(root, keep, step)
            except Exception as e:  # raised by wait(), in the training thread
                errors.append(e)

        thread = threading.Thread(target=write, name=f"rlflow-save-{step}", daemon=False)
        thread.start()
        trainer._save_in_flight = (thread, errors, final)
    return final


def wait(trainer) -> None:
    """Join the background save in flight, if any (every rank calls it; rank 0 holds the thread); an error it
    met is raised here, naming the checkpoint."""
    flight = getattr(trainer, "_save_in_flight", None)
    if flight is None and not getattr(trainer, "async_save", False):
        return
    trainer._save_in_flight = None
    if flight is not None:
        thread, errors, final = flight
        thread.join()
        if errors:
            e, previous = errors[0], latest_checkpoint(final.parent)
            raise CheckpointError(f"could not write checkpoint {final} in the background "
                                  f"({getattr(e, 'strerror', None) or e}); "
                                  f"{f'{previous} is still complete' if previous else 'no earlier checkpoint exists'}"
                                  ) from e
    trainer.fabric.barrier()  # every rank sees the published checkpoint


def _save(trainer) -> Path:
    fabric, root, step = trainer.fabric, trainer.checkpoint_dir, trainer.global_step
    partial, final = partial_dir(root, step), step_dir(root, step)
    if fabric.global_rank == 0:
        remove_hidden(root)
    fabric.barrier()
    try:
        fabric.save(partial / "state.ckpt", trainer_state(trainer))
        if trainer.critic is not None:
            fabric.save(partial / "critic.ckpt", critic_state(trainer))
        fabric.barrier()
        if fabric.global_rank == 0:
            save_hf_metadata(partial / "huggingface", trainer.policy.model, trainer.policy.tokenizer)
            publish(partial, final)
            mark_latest(root, step)
            rotate(root, getattr(trainer, "keep_checkpoints", None), step)
    except OSError as e:
        previous = latest_checkpoint(root)
        raise CheckpointError(f"could not write checkpoint {final} ({e.strerror or e}); "
                              f"{f'{previous} is still complete' if previous else 'no earlier checkpoint exists'}"
                              ) from e
    fabric.barrier()
    return final


def _checked(path: Path, what: str) -> Path:
    """``path/what``, or an error that says what the folder holds instead."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint folder {path} does not exist" if not path.exists()
                              else f"checkpoint {path} is a file; pass the global_step_N folder")
    target = path / what
    if not target.exists():
        found = sorted(p.name for p in path.iterdir())[:8]
        latest = latest_checkpoint(path)
        hint = f"; this looks like a run folder: its latest checkpoint is {latest}" if latest else ""
        raise CheckpointError(f"{path} is not an rlflow checkpoint: no {what} (found {found or 'an empty folder'}){hint}")
    return target


def _load_into(trainer, path: Path, state: dict) -> dict:
    """``fabric.load`` on any layout; unreadable files and mismatched models are named."""
    from rlflow.strategies import shards_parameters

    sharded_file = path.is_dir()
    try:
        if sharded_file and not shards_parameters(trainer.fabric.strategy):
            return load_sharded_unsharded(path, state)
        return trainer.fabric.load(path, state)
    except (RuntimeError, KeyError, ValueError, EOFError, OSError) as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        text = " ".join(lines[:2])[:400] if lines else type(e).__name__  # torch's state_dict errors: header, first key
        hint = ("the model does not match the one that wrote it" if "state_dict" in text or "size mismatch" in text
                else "it may be incomplete or damaged: resume from an earlier global_step_N")
        raise CheckpointError(f"cannot load {path}: {hint} ({type(e).__name__}: {text})") from e


def load(trainer, path: str | Path) -> None:
    """Restore model, optimizer, schedule, RNG, data position and step from a checkpoint folder."""
    wait(trainer)  # a background save of this run finishes first
    path = Path(path)
    state = trainer_state(trainer)
    state |= _load_into(trainer, _checked(path, "state.ckpt"), state)
    if trainer.critic is not None:
        _load_into(trainer, _checked(path, "critic.ckpt"), critic_state(trainer))
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
    if path is not None:
        load(trainer, path)
        trainer.fabric.print(f"resumed from {path} at step {trainer.global_step}")
        if trainer.fabric.global_rank == 0 and path.parent.resolve() == Path(trainer.checkpoint_dir).resolve():
            remove_hidden(path.parent)  # finish what a run killed while saving or rotating left undone
            rotate(path.parent, getattr(trainer, "keep_checkpoints", None), trainer.global_step)
    for logger in trainer.fabric.loggers:  # rows of steps after the checkpoint are logged again
        if hasattr(logger, "drop_after"):
            logger.drop_after(trainer.global_step)
