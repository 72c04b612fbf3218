"""Megatron "dist checkpoints": megatron-core's own sharded weight format (``megatron.core.dist_checkpointing``).

verl's ``*.megatron.use_dist_checkpointing=True`` + ``dist_checkpointing_path`` start a role from such a folder
instead of the Hugging Face weights (verl's ``scripts/converter_hf_to_mcore.py`` writes one from a Hugging Face
model; verl's Megatron checkpoints hold one under ``model/dist_ckpt``). The folder is keyed by the names of
megatron-core's ``GPTModel.sharded_state_dict()`` (``decoder.layers.0.self_attention.linear_qkv.weight``, ...) and
each tensor is stored whole-shaped with the shards' offsets, so it loads at any tensor / pipeline layout: a folder
written at tensor parallel 2 loads at tensor parallel 1 or at pipeline parallel 2.

:func:`save` writes this rank's Megatron shard of a set-up module (``fabric.setup_module`` under
:class:`~rlflow.strategies.megatron.MegatronStrategy`; every rank calls it), :func:`load` reads one into it;
``MegatronStrategy(dist_checkpoints={"policy": path, ...})`` loads at set-up. On CPU processes megatron-core's
writer needs two workarounds (:mod:`.cpu`, items 5 and 6), installed with the strategy's others.

rlflow's own training checkpoints stay :mod:`.sharded_checkpoint`'s (transformers' names, any layout,
``rlflow export``); this module is for the weights verl's Megatron tooling reads and writes.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
from torch import nn

from rlflow.strategies.megatron.heads import MegatronValueModel

ROLES = ("policy", "reference", "critic")
METADATA = "metadata.json"  # what megatron-core writes first in a dist checkpoint folder


def _gpt(module: nn.Module):
    lm = getattr(module, "lm", None)
    gpt = getattr(lm, "gpt", None)
    if gpt is None:
        raise TypeError(f"{type(module).__name__} is not a module set up by the Megatron strategy (a MegatronLogProbs "
                        "or MegatronValueModel): dist checkpoints hold megatron-core weights")
    return gpt


def _state(module: nn.Module, prefix: str) -> dict:
    sharded = _gpt(module).sharded_state_dict(prefix=prefix)
    if isinstance(module, MegatronValueModel):  # a critic: its output layer is not the LM's (verl pops it too)
        sharded = {k: v for k, v in sharded.items() if "output_layer" not in k}
    return sharded


def save(module: nn.Module, path: str | Path, prefix: str = "") -> Path:
    """Write ``module``'s Megatron weights to the folder ``path`` (created; it must not hold a checkpoint yet).
    Collective: every rank of the strategy calls it."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if (path / METADATA).exists():
        raise FileExistsError(f"{path} holds a dist checkpoint already; save to a new folder")
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    try:
        dist_checkpointing.save(_state(module, prefix), str(path))
    finally:
        _stop_results_queue()
    return path


def _stop_results_queue() -> None:
    """megatron-core's writer collects its results through a ``multiprocessing`` Manager queue kept in a module
    global: a server process per rank that lives until the interpreter exits (a rank that leaves with
    ``os._exit``, as forked workers do, leaves it behind, holding the parent's output pipes). Stop it after each
    save; the next save starts a new one."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue, filesystem_async._results_queue = filesystem_async._results_queue, None
    manager = getattr(queue, "_manager", None)
    if manager is not None:
        manager.shutdown()


def check_folder(path: str | Path, key: str = "dist checkpoint") -> Path:
    """``path`` as a dist checkpoint folder, or a clear error naming ``key`` (the config key that gave it)."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"{key}={str(path)!r}: no such folder")
    if not (path / METADATA).is_file():
        raise ValueError(f"{key}={str(path)!r} is not a Megatron dist checkpoint (no {METADATA}: megatron-core's "
                         "dist_checkpointing writes one; a Hugging Face folder goes to actor_rollout_ref.model.path)")
    return path


def load(module: nn.Module, path: str | Path, prefix: str = "") -> None:
    """Read the dist checkpoint ``path`` into ``module``'s Megatron weights, at this strategy's layout. Every
    weight of the module must be in it (extra keys are allowed, as verl allows them); a checkpoint of another
    model is an error naming the folder. Collective."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import StrictHandling
    from torch.distributed.checkpoint.api import CheckpointException

    path = check_folder(path)
    gpt = _gpt(module)
    try:
        loaded = dist_checkpointing.load(_state(module, prefix), str(path), strict=StrictHandling.ASSUME_OK_UNEXPECTED)
    except (Exception, CheckpointException) as e:  # torch's reader raises the latter (a BaseException) per rank
        failures = getattr(e, "failures", None) or {}
        cause = next(iter(failures.values()), e)
        cause = cause[0] if isinstance(cause, tuple) else cause  # (exception, traceback) per failed rank
        raise ValueError(f"{path}: this dist checkpoint does not match the model ({type(cause).__name__}: "
                         f"{str(cause).splitlines()[0][:300]})") from e
    gpt.load_state_dict(loaded, strict=False)  # the tensors were read in place; this also sets any non-sharded state
