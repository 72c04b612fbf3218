"""verl's optimizer keys -> the Trainer's optimizer, schedule, clipping and mini-batch shuffling.

rlflow's Trainer updates actor and critic with one schedule, one clipping norm and one mini-batching, so each
of these keys takes one value for both (``shared`` in :mod:`rlflow.config.plan`: the side the user set wins;
both set and different is an error). The learning rates stay separate.

- ``optim.lr_scheduler_type`` (or its older name ``optim.warmup_style``, which wins when set, as in verl),
  ``optim.min_lr_ratio``, ``optim.num_cycles``, ``optim.zero_indexed_step`` -> a
  :class:`~rlflow.trainer.schedule.Schedule` with verl's formulas.
- ``optim.clip_grad`` (verl 0.9's name), ``grad_clip`` (the older one) and the seed's ``max_grad_norm``: any of
  them; two set to different values is an error naming both (validation, ``aliases_agree``).
- ``shuffle`` with ``data_loader_seed`` -> ``Trainer(shuffle_seed=...)``.
- ``optim.override_optimizer_config``: with the Megatron strategy, fields of megatron-core's ``OptimizerConfig``
  (:mod:`rlflow.config.verl_megatron`); otherwise, as verl's FSDP engine does, extra keyword arguments of the
  ``torch.optim`` class (``eps``, ``foreach``, ...). verl's Megatron scripts' ``optimizer_cpu_offload`` there means
  the optimizer offload rlflow has (``fsdp_config.optimizer_offload``: nothing to move on CPU); the other Megatron
  optimizer fields get a note.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch

from rlflow.config import tables
from rlflow.config.loading import ConfigError, NotSupportedError, VerlConfig
from rlflow.trainer.schedule import SCHEDULES, Schedule

A, C = "actor_rollout_ref.actor", "critic"
# verl 0.9's name first: the value is the first of these the user set (validation made sure they agree)
CLIP_KEYS = {A: (f"{A}.optim.clip_grad", f"{A}.grad_clip", f"{A}.max_grad_norm"),
             C: (f"{C}.optim.clip_grad", f"{C}.grad_clip")}
# megatron-core OptimizerConfig fields verl's Megatron scripts set; with another strategy only the offload maps
MEGATRON_OFFLOAD = "optimizer_cpu_offload"
MEGATRON_ONLY = ("optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d", "use_precision_aware_optimizer",
                 "use_torch_optimizer_for_cpu_offload", "pin_cpu_grads", "pin_cpu_params")


def first_set(cfg: VerlConfig, keys: tuple[str, ...]) -> Any:
    """The value of the first key the user set (every key is read), else the first non-null default."""
    values = [cfg[k] for k in keys]
    for k, v in zip(keys, values):
        if cfg.is_provided(k) and v is not None:
            return v
    return next((v for v in values if v is not None), None)


def scheduler_kind(cfg: VerlConfig, role: str, notes: list[str]) -> str:
    """verl's ``FSDPOptimizerConfig``: the deprecated ``warmup_style``, when set, replaces ``lr_scheduler_type``."""
    style, kind = cfg[f"{role}.optim.warmup_style"], cfg[f"{role}.optim.lr_scheduler_type"]
    if style is not None and style != kind and cfg.is_provided(f"{role}.optim.lr_scheduler_type"):
        notes.append(f"{role}.optim.warmup_style={style!r} replaces {role}.optim.lr_scheduler_type={kind!r}, as in "
                     "verl (warmup_style is its deprecated name)")
    kind = style or kind
    if kind not in SCHEDULES:
        raise ConfigError(f"{role}.optim.lr_scheduler_type={kind!r}: choose from {SCHEDULES}")
    return kind


def optim_kwargs(cfg: VerlConfig, notes: list[str], with_critic: bool, same: Callable, devices) -> dict:
    """The Trainer's ``lr``, ``critic_lr``, ``weight_decay``, ``optimizer``, ``lr_schedule``, ``max_grad_norm`` and
    ``shuffle_seed``; ``same(name, actor_value, critic_value, aliases)`` is the plan's one-value rule."""
    lr = first_set(cfg, (f"{A}.lr", f"{A}.optim.lr"))  # the seed's actor.lr overrides verl's key when set
    clip = same("optim.clip_grad", first_set(cfg, CLIP_KEYS[A]), first_set(cfg, CLIP_KEYS[C]) if with_critic
                else None, aliases=CLIP_KEYS[A][1:], critic_aliases=CLIP_KEYS[C][1:])
    # verl's Megatron configs name Megatron's optimizers: its "adam" is decoupled weight decay (megatron-core
    # falls back to torch.optim.AdamW for it), "sgd" is SGD
    name = same("optim.optimizer")  # read once: the one-value rule may add a note
    name = tables.MEGATRON_OPTIMIZERS.get(name, name)
    if not hasattr(torch.optim, name):
        raise ConfigError(f"{A}.optim.optimizer={name!r}: torch.optim has no such optimizer")
    weight_decay, betas = same("optim.weight_decay"), same("optim.betas")
    extra = optimizer_overrides(cfg, notes, getattr(torch.optim, name), devices)
    kind = same("optim.lr_scheduler_type", scheduler_kind(cfg, A, notes),
                scheduler_kind(cfg, C, notes) if with_critic else None, aliases=(f"{A}.optim.warmup_style",))
    min_ratio = same("optim.min_lr_ratio")
    schedule = Schedule(kind, 0.0 if min_ratio is None else float(min_ratio), float(same("optim.num_cycles")),
                        bool(same("optim.zero_indexed_step")))
    shuffle, seed = same("shuffle"), same("data_loader_seed")
    seed = cfg["data.seed"] if seed is None else seed  # verl: "None uses the global seed"
    return {"lr": lr, "critic_lr": cfg[f"{C}.optim.lr"], "weight_decay": weight_decay, "lr_schedule": schedule,
            "optimizer": functools.partial(getattr(torch.optim, name), lr=lr, weight_decay=weight_decay,
                                           betas=tuple(betas), **extra),
            "max_grad_norm": clip, "shuffle_seed": int(seed) if shuffle else None}


def optimizer_overrides(cfg: VerlConfig, notes: list[str], optimizer: type, devices) -> dict:
    """``optim.override_optimizer_config`` outside Megatron: keyword arguments of the torch optimizer (verl's FSDP
    ``build_optimizer``), checked against its signature; Megatron's optimizer fields mapped or noted."""
    key = f"{A}.optim.override_optimizer_config"
    overrides = dict(cfg[key] or {})
    critic = cfg[f"{C}.optim.override_optimizer_config"] or {}
    if critic and critic != overrides:
        notes.append(f"{C}.optim.override_optimizer_config={critic!r} is not used: the critic's AdamW takes the "
                     "Trainer's defaults")
    if getattr(devices.strategy, "optimizer_overrides", None) is not None:
        return {}  # the Megatron strategy took them (megatron-core's OptimizerConfig)
    if overrides.pop(MEGATRON_OFFLOAD, False):
        if devices.accelerator != "cpu":
            raise NotSupportedError(f"{key}.{MEGATRON_OFFLOAD}", True, "optimizer offloading on a GPU",
                                    "It maps onto fsdp_config.optimizer_offload, which needs FSDP2 across processes.")
        notes.append(f"{key}.{MEGATRON_OFFLOAD}=True: rlflow's optimizer offload (fsdp_config.optimizer_offload); "
                     "on trainer.device=cpu the optimizer state already lives in CPU memory")
    megatron = {k: overrides.pop(k) for k in MEGATRON_ONLY if k in overrides}
    if megatron:
        notes.append(f"{key}: {megatron} are megatron-core OptimizerConfig fields; they have no effect without "
                     f"{A}.strategy=megatron (torch.optim.{optimizer.__name__} is used)")
    params = inspect.signature(optimizer).parameters
    for name in overrides:
        if name not in params or name in ("params", "lr", "weight_decay", "betas"):
            known = ", ".join(p for p in params if p not in ("self", "params"))
            raise ConfigError(f"{key}.{name}: torch.optim.{optimizer.__name__} takes no argument {name!r} here "
                              f"(its arguments: {known}; lr, weight_decay and betas have keys of their own)")
    return overrides
