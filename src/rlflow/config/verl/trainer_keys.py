"""verl 0.9's trainer selection and checkpoint hook: ``trainer.use_v1`` / ``trainer.v1.trainer_mode`` and
``trainer.checkpoint_callback_class``.

verl 0.9 runs its V1 trainer by default (``use_v1=True``) in ``sync`` mode, or its legacy trainer
(``use_v1=False``); both generate with the current weights, then train, as rlflow's one loop does. V1's
asynchronous modes (``colocate_async``, ``separate_async``) are fully asynchronous generation with partial
rollouts (``FullyAsyncRollout``, :func:`rlflow.config.verl.asynchronous.v1_async_plan`, docs/async.md).

``checkpoint_callback_class`` names a class (``my_pkg.callbacks.MyCallback``) that verl builds as
``cls(config=<the whole config>)`` and whose ``on_save(trainer=, global_step=, checkpoint_dir=, async_save=)``
it calls on the driver after each checkpoint; rlflow does the same on rank 0 (:class:`VerlCheckpointCallback`).
With ``checkpoint.async_save`` it is called as soon as the write has started (``async_save=True``), as in verl.
"""

from __future__ import annotations

import importlib
from typing import Any

from rlflow.config.verl.loading import ConfigError, VerlConfig

USE_V1, MODE, CALLBACK = "trainer.use_v1", "trainer.v1.trainer_mode", "trainer.checkpoint_callback_class"
V1_MODES = ("sync", "colocate_async", "separate_async")


def v1_mode(cfg: VerlConfig, notes: list[str]) -> None:
    """Check verl's trainer choice: sync (V1 or legacy) is rlflow's loop; the V1 asynchronous modes wrap the
    rollout (``v1_async_plan``)."""
    use_v1, mode = cfg[USE_V1], cfg[MODE]
    if mode not in V1_MODES:
        raise ConfigError(f"{MODE}={mode!r}: choose from {', '.join(V1_MODES)}")
    if not use_v1:
        if mode != "sync":
            notes.append(f"{MODE}={mode!r} has no effect with {USE_V1}=False (verl's legacy trainer is synchronous, "
                         "as rlflow's loop)")
        return
    # colocate_async / separate_async: FullyAsyncRollout (rlflow.config.verl.asynchronous.v1_async_plan)


class VerlCheckpointCallback:
    """An rlflow Trainer callback that runs a verl checkpoint callback: ``cls(config=config)`` is built when
    training starts and its ``on_save`` is called on rank 0 after each checkpoint (``trainer`` is rlflow's
    :class:`~rlflow.trainer.trainer.Trainer`, ``checkpoint_dir`` its ``global_step_N`` folder)."""

    def __init__(self, cls: type, config: dict):
        self.cls, self.config, self.callback = cls, config, None

    def on_fit_start(self, trainer) -> None:
        if self.callback is None:
            from omegaconf import OmegaConf

            self.callback = self.cls(config=OmegaConf.create(self.config))

    def on_save(self, trainer, global_step: int, checkpoint_dir: str, **kwargs: Any) -> None:
        if trainer.fabric.global_rank != 0:
            return
        self.on_fit_start(trainer)  # a save outside fit (trainer.save()) builds it too
        self.callback.on_save(trainer=trainer, global_step=global_step, checkpoint_dir=checkpoint_dir,
                              async_save=bool(getattr(trainer, "async_save", False)), **kwargs)

    def __repr__(self) -> str:
        return f"VerlCheckpointCallback({self.cls.__module__}.{self.cls.__qualname__})"


def checkpoint_callbacks(cfg: VerlConfig) -> list:
    """``[VerlCheckpointCallback(...)]`` for the Trainer's callbacks, or ``[]`` when the key is null; the class
    is imported now, so a bad name fails before any weights load."""
    fqn = cfg[CALLBACK]
    if not fqn:
        return []
    module, _, name = str(fqn).rpartition(".")
    if not module:
        raise ConfigError(f"{CALLBACK}={fqn!r}: give the class's fully qualified name (my_pkg.callbacks.MyCallback)")
    try:
        cls = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise ConfigError(f"{CALLBACK}={fqn!r}: cannot import module {module!r} ({e})") from e
    except AttributeError:
        raise ConfigError(f"{CALLBACK}={fqn!r}: module {module!r} has no {name!r}") from None
    if not callable(getattr(cls, "on_save", None)):
        raise ConfigError(f"{CALLBACK}={fqn!r}: {name} has no on_save(trainer, global_step, checkpoint_dir, "
                          "async_save, **kwargs) method (verl's CheckpointCallback interface)")
    return [VerlCheckpointCallback(cls, cfg.tree)]
