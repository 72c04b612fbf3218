"""verl's optimizer keys -> the Trainer's optimizer, schedule, clipping and mini-batch shuffling.

rlflow's Trainer updates actor and critic with one schedule, one clipping norm and one mini-batching, so each
of these keys takes one value for both (``shared`` in :mod:`rlflow.config.verl.plan`: the side the user set wins;
both set and different is an error). The learning rates stay separate.

- ``optim.lr_scheduler_type`` (or its older name ``optim.warmup_style``, which wins when set, as in verl),
  ``optim.min_lr_ratio``, ``optim.num_cycles``, ``optim.zero_indexed_step`` -> a
  :class:`~rlflow.trainer.schedule.Schedule` with verl's formulas.
- verl's Megatron schedule keys ``optim.lr_decay_style``, ``lr_warmup_init``, ``min_lr``, ``lr_decay_steps``,
  ``lr_wsd_decay_style`` / ``lr_wsd_decay_steps`` and ``weight_decay_incr_style`` (any of them off its default,
  whatever the strategy) -> a :class:`~rlflow.trainer.schedule.ParamSchedule` (megatron-core's formulas). Its
  lr values are fractions of each role's lr, so actor and critic keep their own learning rates; verl passes
  ``start_wd = end_wd = weight_decay``, so the weight decay stays constant whatever its style (a note says so).
- ``optim.optimizer_impl`` (verl's): the module ``optim.optimizer`` is imported from (``torch.optim``, or a user's
  module on ``sys.path``: ``my_optimizers``).
- ``optim.clip_grad`` (verl 0.9's name), ``grad_clip`` (the older one) and the seed's ``max_grad_norm``: any of
  them; two set to different values is an error naming both (validation, ``aliases_agree``).
- ``shuffle`` with ``data_loader_seed`` -> ``Trainer(shuffle_seed=...)``.
- ``optim.override_optimizer_config``: with the Megatron strategy, fields of megatron-core's ``OptimizerConfig``
  (:mod:`rlflow.config.verl.megatron`); otherwise, as verl's FSDP engine does, extra keyword arguments of the
  ``torch.optim`` class (``eps``, ``foreach``, ...). verl's Megatron scripts' ``optimizer_cpu_offload`` there means
  the optimizer offload rlflow has (``fsdp_config.optimizer_offload``: nothing to move on CPU); the other Megatron
  optimizer fields get a note.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
from typing import Any, Callable

import torch

from rlflow.config.verl import tables
from rlflow.config.verl.loading import ConfigError, NotSupportedError, VerlConfig
from rlflow.trainer.schedule import DECAY_STYLES, SCHEDULES, WD_STYLES, WSD_STYLES, ParamSchedule, Schedule

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
    optimizer_cls = optimizer_class(same("optim.optimizer_impl"), name)
    weight_decay, betas = same("optim.weight_decay"), same("optim.betas")
    extra = optimizer_overrides(cfg, notes, optimizer_cls, devices)
    kind = same("optim.lr_scheduler_type", scheduler_kind(cfg, A, notes),
                scheduler_kind(cfg, C, notes) if with_critic else None, aliases=(f"{A}.optim.warmup_style",))
    min_ratio = same("optim.min_lr_ratio")
    schedule = megatron_schedule(cfg, notes, with_critic, same, kind, {A: lr, C: cfg[f"{C}.optim.lr"]}, weight_decay)
    if schedule is not None and min_ratio:
        notes.append(f"{A}.optim.min_lr_ratio={min_ratio} is not used: it is the floor of verl's FSDP cosine "
                     "(lr_scheduler_type); Megatron's schedule (lr_decay_style) ends at optim.min_lr")
    schedule = schedule or Schedule(kind, 0.0 if min_ratio is None else float(min_ratio),
                                    float(same("optim.num_cycles")), bool(same("optim.zero_indexed_step")))
    shuffle, seed = same("shuffle"), same("data_loader_seed")
    seed = cfg["data.seed"] if seed is None else seed  # verl: "None uses the global seed"
    return {"lr": lr, "critic_lr": cfg[f"{C}.optim.lr"], "weight_decay": weight_decay, "lr_schedule": schedule,
            "optimizer": functools.partial(optimizer_cls, lr=lr, weight_decay=weight_decay, betas=tuple(betas),
                                           **extra),
            "max_grad_norm": clip, "shuffle_seed": int(seed) if shuffle else None}


def optimizer_class(module: str | None, name: str) -> type:
    """verl's ``optim.optimizer_impl`` + ``optim.optimizer``: the class ``name`` of the module ``module`` (verl's
    Megatron names ``adam`` / ``sgd`` are torch.optim's AdamW / SGD, as megatron-core falls back to)."""
    module = module or "torch.optim"
    if module == "torch.optim":
        name = tables.MEGATRON_OPTIMIZERS.get(name, name)
    key = f"{A}.optim.optimizer_impl={module!r}"
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{key}: cannot import it ({e}); it must be a module on the Python path") from e
    cls = getattr(mod, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        what = "has no such class" if cls is None else "is not a torch.optim.Optimizer subclass"
        raise ConfigError(f"{A}.optim.optimizer={name!r}: {module} {what}")
    return cls


# verl's Megatron schedule keys (McoreOptimizerConfig); any of them off its default selects megatron-core's scheduler
MEGATRON_SCHEDULE = {"lr_decay_style": "constant", "lr_warmup_init": 0.0, "weight_decay_incr_style": "constant"}


def megatron_schedule(cfg: VerlConfig, notes: list[str], with_critic: bool, same: Callable, kind: str,
                      lrs: dict, weight_decay: float) -> ParamSchedule | None:
    """megatron-core's ``OptimizerParamScheduler`` as verl builds it (``get_megatron_optimizer_param_scheduler``),
    when a Megatron schedule key is off its default; ``None`` otherwise (verl's FSDP schedule)."""
    roles = (A, C) if with_critic else (A,)
    on = [f"{r}.optim.{k}" for r in roles for k, d in MEGATRON_SCHEDULE.items() if cfg[f"{r}.optim.{k}"] not in (d, None)]
    if not on:
        return None
    if kind != "constant":
        raise ConfigError(f"{on[0]}={cfg[on[0]]!r} and {A}.optim.lr_scheduler_type={kind!r}: two schedules. "
                          "lr_scheduler_type is verl's FSDP schedule, lr_decay_style / lr_warmup_init / "
                          "weight_decay_incr_style its Megatron one: set one")
    style, wsd_style, wd_style = (same(f"optim.{k}") for k in ("lr_decay_style", "lr_wsd_decay_style",
                                                                "weight_decay_incr_style"))
    for key, value, choices in ((f"{A}.optim.lr_decay_style", style, DECAY_STYLES),
                                (f"{A}.optim.lr_wsd_decay_style", wsd_style, WSD_STYLES),
                                (f"{A}.optim.weight_decay_incr_style", wd_style, WD_STYLES)):
        if value not in choices:
            raise ConfigError(f"{key}={value!r}: choose from {choices} (megatron-core's names)")
    decay, wsd = same("optim.lr_decay_steps"), same("optim.lr_wsd_decay_steps")
    if style == "WSD" and not wsd:
        raise ConfigError(f"{A}.optim.lr_decay_style=WSD needs {A}.optim.lr_wsd_decay_steps (the anneal's length)")
    if wd_style != "constant":
        notes.append(f"{A}.optim.weight_decay_incr_style={wd_style!r}: as in verl, which passes start_wd = end_wd = "
                     f"optim.weight_decay to megatron-core, the weight decay stays {weight_decay}")
    return ParamSchedule(style, lr_fraction(cfg, notes, roles, "lr_warmup_init", lrs),
                         lr_fraction(cfg, notes, roles, "min_lr", lrs), decay, wsd, wsd_style, wd_style,
                         weight_decay, weight_decay)


def lr_fraction(cfg: VerlConfig, notes: list[str], roles: tuple, key: str, lrs: dict) -> float:
    """A Megatron lr value (``lr_warmup_init``, ``min_lr``) as a fraction of its role's lr: rlflow's one schedule
    scales each role's own lr, so a value one role sets applies to the other as the same fraction."""
    fractions = {r: float(cfg[f"{r}.optim.{key}"] or 0.0) / lrs[r] for r in roles}
    given = [r for r in roles if cfg.is_provided(f"{r}.optim.{key}")]
    if len(given) == 2 and not math.isclose(fractions[A], fractions[C], rel_tol=1e-9, abs_tol=1e-12):
        raise ConfigError(f"{A}.optim.{key}={cfg[f'{A}.optim.{key}']} ({fractions[A]:g} x its lr) and {C}.optim.{key}="
                          f"{cfg[f'{C}.optim.{key}']} ({fractions[C]:g} x its lr) differ: rlflow's one schedule takes "
                          "them as fractions of each role's lr, so they must be the same fraction")
    role = given[0] if given else A
    fraction = fractions[role]
    if not 0.0 <= fraction <= 1.0:
        raise ConfigError(f"{role}.optim.{key}={cfg[f'{role}.optim.{key}']}: must be in [0, optim.lr={lrs[role]}] "
                          "(megatron-core's rule)")
    if len(given) == 1 and len(roles) == 2 and fraction:
        other = C if role == A else A
        notes.append(f"{role}.optim.{key}={cfg[f'{role}.optim.{key}']} is {fraction:g} x its lr; {other} uses the "
                     f"same fraction of its own lr ({fraction * lrs[other]:g})")
    return fraction


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
