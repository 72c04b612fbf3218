"""The Trainer's grouped arguments: ``Trainer(..., batching=Batching(...), run=RunDir(...))``.

Each group is a frozen dataclass whose fields are the Trainer's keyword arguments of the same names, with
the same defaults; those keyword arguments are still accepted one by one (``Trainer(batch_size=8)``).
Setting a field both ways is an error that names it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class Batching:
    """How one RL step's samples are cut for the updates.

    Args:
        batch_size: prompts per RL step (each gives ``rollout.n`` samples).
        mini_batch_size: prompts per optimizer step (default: ``batch_size``, one update per step).
        micro_batch_size: samples per forward/backward (gradient accumulation; default: the mini-batch).
        max_tokens_per_micro_batch: token budget per forward/backward (verl's ``use_dynamic_bsz`` +
            ``ppo_max_token_len_per_gpu``; see ``rlflow.trainer.batching``); ``None``: split by rows only.
        ppo_epochs: passes over the batch per step.
        shuffle_seed: ``None`` splits each rank's rows into mini-batches in order; a seed deals them at random
            anew each epoch, as verl's ``actor.shuffle`` (:func:`~rlflow.trainer.batching.shuffled_mini_batches`).
        balance_batch: before the updates, re-deal each mini-batch's rows over the data-parallel ranks for equal
            token counts (verl ``trainer.balance_batch``; ``rlflow.trainer.distributed.balance_tokens``).
    """

    batch_size: int = 32
    mini_batch_size: int | None = None
    micro_batch_size: int | None = None
    max_tokens_per_micro_batch: int | None = None
    ppo_epochs: int = 1
    shuffle_seed: int | None = None
    balance_batch: bool = True


@dataclass(frozen=True)
class RunDir:
    """The run's one folder and what goes in it.

    Args:
        path: the folder (verl's ``trainer.default_local_dir``): the loggers' files, and the checkpoints as
            ``path/global_step_N`` with ``path/latest_checkpointed_iteration.txt`` (``rlflow.trainer.checkpoint``).
            Checked to be writable before the first step.
        save_every: a checkpoint every N steps and at the last (0: none).
        resume: ``None``, ``"auto"`` (the latest checkpoint in ``path``, if any) or a ``global_step_N`` folder of
            any run, written by any number of processes.
        keep_checkpoints: keep only the newest N ``global_step_*`` folders (``None`` or <= 0: all; verl's
            ``max_actor_ckpt_to_keep``); older ones are deleted after each save.
        loggers: names from ``jsonl``, ``csv``, ``tensorboard``, ``wandb`` (or logger objects).
        async_save: write each checkpoint in a background thread after copying the state to CPU memory (verl's
            ``checkpoint.async_save``); the next save, a load and the end of ``fit`` wait for it. Sharded
            checkpoints (FSDP2, Megatron) are written synchronously.
    """

    path: str | Path = "runs/rlflow"
    save_every: int = 0
    resume: str | Path | None = None
    keep_checkpoints: int | None = None
    loggers: tuple = ("jsonl", "csv", "tensorboard")
    async_save: bool = False


# RunDir's fields under the Trainer's keyword names
KEYWORDS = {RunDir: {"path": "run_dir"}}


def grouped(group, cls, given: dict) -> tuple:
    """``cls``'s field values, in order: from ``group`` when it is given, else from the keyword arguments in
    ``given`` (the Trainer's, by name); a keyword argument set away from its default together with a group is
    refused, naming it."""
    names = [(f, KEYWORDS.get(cls, {}).get(f.name, f.name)) for f in fields(cls)]
    if group is None:
        return tuple(given[key] for _, key in names)
    if not isinstance(group, cls):
        raise TypeError(f"expected a {cls.__name__}(...), got {type(group).__name__}")
    for f, key in names:
        if given[key] != f.default:
            raise ValueError(f"{key}={given[key]!r} is set twice: pass it in {cls.__name__}({f.name}=...) or as "
                             "a keyword argument, not both")
    return tuple(getattr(group, f.name) for f, _ in names)
