"""The Trainer's grouped arguments: ``Trainer(policy, rollout, reward, estimator, loss, optim=Optim(...),
batching=Batching(...), loop=Loop(...), run=RunDir(...), hardware=Hardware(...))``.

Five groups, one per question a newcomer asks of a run, named for that question:

- :class:`Optim` -- *how are the weights changed?* (learning rates, weight decay, schedule, clipping; torch's
  ``optim`` and torchtune's ``optimizer`` section say the same);
- :class:`Batching` -- *how is one step's data cut?* (prompts per step, mini- and micro-batches, epochs over it);
- :class:`Loop` -- *how long, and when does it look?* (steps or epochs, validation, critic warm-up, seed,
  progress bar: the things ``fit``'s loop does between steps);
- :class:`RunDir` -- *what does it keep, and where?* (the run's folder, checkpoints, resume, loggers);
- :class:`Hardware` -- *where does it run, and how is it split?* (Lightning Fabric's accelerator, devices, nodes,
  strategy and precision, plus sequence parallelism; named for what it is, not for the library under it).

Each group is a frozen dataclass whose fields have the Trainer's old keyword names (``RunDir.path`` was
``run_dir``) and defaults. Those flat keywords still work (``Trainer(batch_size=8, lr=1e-3)``) with one
``DeprecationWarning`` per call that names the group each belongs in; :func:`groups` sorts flat keywords into
groups for code that holds them as a dict (the verl entry point's builder). A field set both as a group and as a
flat keyword is refused, naming it; a keyword no group has is a ``TypeError``, as Python's own.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable


@dataclass(frozen=True)
class Optim:
    """How the weights are changed.

    Args:
        lr, critic_lr: AdamW's learning rate for the policy and for the critic.
        weight_decay: AdamW's (both).
        warmup_steps, lr_schedule: linear warm-up, then ``"constant"``, ``"cosine"`` or a
            :class:`~rlflow.trainer.schedule.Schedule` (verl's cosine with ``min_lr_ratio`` and ``num_cycles``).
        optimizer: ``params -> torch.optim.Optimizer`` to replace AdamW for the policy.
        max_grad_norm: gradient clipping (``None`` only measures the norm).
    """

    lr: float = 1e-6
    critic_lr: float = 1e-5
    weight_decay: float = 0.01
    warmup_steps: int = 0
    lr_schedule: Any = "constant"
    optimizer: Callable | None = None
    max_grad_norm: float | None = 1.0


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
class Loop:
    """How long ``fit`` runs and what it does between steps.

    Args:
        max_steps: RL steps to run; default ``epochs x steps per epoch``.
        epochs: passes over the prompts when ``max_steps`` is not given.
        val_every, val_n, val_sampling: validate every ``val_every`` steps (0: only when asked) with ``val_n``
            samples per prompt (1: greedy, else at the rollout's temperature), or with the rollout's options
            ``val_sampling`` (with ``n``; verl's ``rollout.val_kwargs``).
        critic_warmup_steps: the first N steps update only the critic (the policy and its schedule stay).
        seed: seeds every RNG at the start of ``fit`` (a resumed run restores the saved RNG state instead).
        progress: show a progress bar.
    """

    max_steps: int | None = None
    epochs: int = 1
    val_every: int = 0
    val_n: int = 1
    val_sampling: dict | None = None
    critic_warmup_steps: int = 0
    seed: int = 0
    progress: bool = True


@dataclass(frozen=True)
class RunDir:
    """The run's one folder and what goes in it.

    Args:
        path: the folder (verl's ``trainer.default_local_dir``): the loggers' files, and the checkpoints as
            ``path/global_step_N`` with ``path/latest_checkpointed_iteration.txt`` (``rlflow.trainer.training_state``).
            Checked to be writable before the first step.
        save_every: a checkpoint every N steps and at the last (0: none).
        resume: ``None``, ``"auto"`` (the latest checkpoint in ``path``, if any) or a ``global_step_N`` folder of
            any run, written by any number of processes.
        keep_checkpoints: keep only the newest N ``global_step_*`` folders (``None`` or <= 0: all; verl's
            ``max_actor_ckpt_to_keep``); older ones are deleted after each save.
        loggers: names from ``jsonl``, ``csv``, ``tensorboard``, ``wandb``, ``mlflow``, ``clearml``, ``trackio``,
            ``console`` (or logger objects).
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


@dataclass(frozen=True)
class Hardware:
    """Where the run executes and how it is split over devices.

    Args:
        accelerator, devices, num_nodes, precision: passed to ``lightning_fabric.Fabric``.
        strategy: ``"auto"``, ``"ddp"``, ``"fsdp2"`` (``"fsdp"`` too) or a Fabric strategy object
            (``rlflow.strategies``). With several processes each one rolls out its share of the prompts; losses
            use global token/sequence counts.
        sequence_parallel_size: ranks that split each sequence (Ulysses, ``rlflow.models.ulysses``; needs
            ``remove_padding`` on the policy, reference and critic). Consecutive ranks form a group; each rank
            generates and scores its own share of the prompts, and the group trains on their union.
    """

    accelerator: str = "cpu"
    devices: int = 1
    num_nodes: int = 1
    strategy: Any = "auto"
    precision: str = "32-true"
    sequence_parallel_size: int = 1


GROUPS = {"optim": Optim, "batching": Batching, "loop": Loop, "run": RunDir, "hardware": Hardware}
RENAMED = {(RunDir, "path"): "run_dir"}  # a field under another flat keyword name
# flat keyword -> (the Trainer's argument, its group's class, the field)
FLAT = {RENAMED.get((cls, f.name), f.name): (arg, cls, f.name) for arg, cls in GROUPS.items() for f in fields(cls)}


def split(flat: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Flat keywords sorted by group: ``{"optim": {"lr": 1e-3}, "run": {"path": ...}}``; a keyword no group has is
    a ``TypeError``, as Python's own for an unknown argument."""
    unknown = sorted(set(flat) - set(FLAT))
    if unknown:
        raise TypeError(f"Trainer() got an unexpected keyword argument {unknown[0]!r} (grouped arguments: "
                        f"{', '.join(f'{a}={c.__name__}(...)' for a, c in GROUPS.items())})")
    out: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        arg, _, name = FLAT[key]
        out.setdefault(arg, {})[name] = value
    return out


def groups(**flat) -> dict[str, Any]:
    """The Trainer's grouped arguments for flat keywords: ``groups(lr=1e-3, batch_size=8)`` ->
    ``{"optim": Optim(lr=1e-3), "batching": Batching(batch_size=8)}`` (only the groups some keyword sets)."""
    return {arg: GROUPS[arg](**values) for arg, values in split(flat).items()}


def with_groups(**kwargs) -> dict[str, Any]:
    """The Trainer's keyword arguments with the groups' fields gathered into their groups, the others as they are:
    ``with_groups(lr=1e-3, callbacks=cbs)`` -> ``{"callbacks": cbs, "optim": Optim(lr=1e-3)}``. For code that holds
    the Trainer's settings as keywords (a job's ``**trainer_kwargs``); a group given whole and by a field is refused."""
    flat = {k: v for k, v in kwargs.items() if k in FLAT}
    refuse_twice({arg: kwargs.get(arg) for arg in GROUPS}, flat)
    return {k: v for k, v in kwargs.items() if k not in FLAT} | groups(**flat)


def refuse_twice(given: dict[str, Any], flat: dict[str, Any]) -> None:
    """A ``ValueError`` naming the first flat keyword whose group is also given whole (``given``: arg -> group)."""
    for key in flat:
        arg, cls, name = FLAT[key]
        if given.get(arg) is not None:
            raise ValueError(f"{key}={flat[key]!r} is set twice: pass it in {cls.__name__}({name}=...) or as "
                             "a keyword argument, not both")


def values(group) -> tuple:
    """A group's field values in order (``dataclasses.astuple`` would deep-copy strategy and logger objects)."""
    return tuple(getattr(group, f.name) for f in fields(group))


def spelled(flat: dict[str, Any]) -> str:
    """Flat keywords written as the grouped arguments: ``optim=Optim(lr=...), batching=Batching(batch_size=...)``."""
    return ", ".join(f"{arg}={GROUPS[arg].__name__}({', '.join(f'{name}=...' for name in fields_)})"
                     for arg, fields_ in split(flat).items())


def resolve(given: dict[str, Any], legacy: dict[str, Any]) -> tuple:
    """The five groups, in ``GROUPS``' order, from the Trainer's group arguments ``given`` (``None``: the
    defaults) and its flat keywords ``legacy`` (deprecated: one warning naming the groups to use)."""
    for arg, group in given.items():
        if group is not None and not isinstance(group, GROUPS[arg]):
            raise TypeError(f"{arg}: expected a {GROUPS[arg].__name__}(...), got {type(group).__name__}")
    from_flat = groups(**legacy)
    refuse_twice(given, legacy)
    if legacy:
        warnings.warn(f"Trainer(...): flat keyword arguments ({', '.join(legacy)}) are deprecated; pass them grouped: "
                      f"{spelled(legacy)} (rlflow.trainer.options)", DeprecationWarning, stacklevel=3)
    return tuple(given[arg] or from_flat.get(arg) or cls() for arg, cls in GROUPS.items())


def check_settings(policy, rollout, estimator, critic, value_loss, batching: Batching, loop: Loop) -> None:
    """A ``ValueError`` for settings the Trainer's roles cannot run with, before any device is touched."""
    if abs(policy.temperature - rollout.temperature) > 1e-9:
        raise ValueError(f"policy temperature {policy.temperature} != rollout temperature {rollout.temperature}: "
                         "log-probs must be computed from the distribution that was sampled")
    if estimator.needs_critic and (critic is None or value_loss is None):
        raise ValueError(f"{type(estimator).__name__} needs a critic: pass critic=Critic(...) and "
                         "value_loss=ValueLoss()")
    if loop.critic_warmup_steps and critic is None:
        raise ValueError(f"critic_warmup_steps={loop.critic_warmup_steps} needs a critic: without one no step would "
                         "train")
    if batching.mini_batch_size is not None and batching.batch_size % batching.mini_batch_size:
        raise ValueError(f"batch_size={batching.batch_size} is not a multiple of "
                         f"mini_batch_size={batching.mini_batch_size}")
