"""Learning-rate schedules as ``LambdaLR`` factors, with verl's formulas (``verl.utils.torch_functional``).

``Optim(lr_schedule=...)`` takes ``"constant"``, ``"cosine"``, a :class:`Schedule` (a cosine with a floor
and a cycle count) or a :class:`ParamSchedule` (megatron-core's ``OptimizerParamScheduler``, below). With ``w`` warm-up steps and ``N`` steps in all, the factor at step ``s`` (0, 1, ...) is

- warm-up, ``s < w``: ``s / w`` (the first step runs at lr 0, as in verl and transformers);
- constant: ``1``;
- cosine: ``max(m, m + (1 - m) * (1 + cos(2 pi c p)) / 2)`` with ``p = (s - w) / max(1, N - w)``,
  ``m = min_lr_ratio`` and ``c = num_cycles`` (0.5: one half-wave from 1 down to ``m``).

``zero_indexed_step=False`` counts steps from 1 (verl's torchtitan option): the cosine, its warm-up included,
is evaluated at ``s + 1``. As in verl it applies to the cosine only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

SCHEDULES = ("constant", "cosine")
DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")  # megatron-core's lr_decay_style
WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class Schedule:
    """A schedule with verl's options (``optim.lr_scheduler_type``, ``min_lr_ratio``, ``num_cycles``,
    ``zero_indexed_step``); ``Schedule("cosine", min_lr_ratio=0.1)`` decays to 10 % of the base lr."""

    kind: str = "constant"
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5
    zero_indexed_step: bool = True

    def __post_init__(self):
        if self.kind not in SCHEDULES:
            raise ValueError(f"unknown lr_schedule '{self.kind}'; choose from {SCHEDULES}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

    def __str__(self) -> str:
        if self.kind == "constant":
            return "constant"
        return (f"cosine down to {self.min_lr_ratio:g} x lr, {self.num_cycles:g} cycles"
                + ("" if self.zero_indexed_step else ", steps counted from 1"))

    def factor(self, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
        """The multiplier of the base learning rate at each step (0-based, as ``LambdaLR`` counts)."""
        m, cycles, shift = self.min_lr_ratio, self.num_cycles, 0 if self.zero_indexed_step else 1
        cosine = self.kind == "cosine"

        def factor(step: int) -> float:
            step += shift if cosine else 0
            if step < warmup_steps:
                return step / max(1, warmup_steps)
            if not cosine:
                return 1.0
            progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
            return max(m, math.cos(math.pi * cycles * 2.0 * progress) * (1 - m) * 0.5 + (1 + m) * 0.5)

        return factor


@dataclass(frozen=True)
class ParamSchedule:
    """megatron-core's ``OptimizerParamScheduler`` (verl's Megatron ``optim`` keys), as factors of each
    optimizer's base lr, so that actor and critic keep their own learning rates.

    At step ``s`` with ``w`` warm-up steps, ``D = decay_steps`` (default: all steps) and ``m = min_lr_ratio``,
    ``i = init_lr_ratio``: warm-up ``0 < w`` and ``s <= w``: ``i + (1 - i) s / w``; then ``constant``: 1; past
    ``D``: ``m``; ``inverse-square-root``: ``max(m, sqrt(max(w, 1) / max(s, 1)))``; otherwise ``m + c (1 - m)``
    with ``r = (s - w) / (D - w)`` and ``c = 1 - r`` (linear), ``(1 + cos(pi r)) / 2`` (cosine), or for ``WSD`` 1
    until the last ``wsd_decay_steps`` of ``D``, then ``wsd_style`` over those. The weight decay goes from
    ``start_weight_decay`` to ``end_weight_decay`` over all steps (``weight_decay_style``: linear or cosine
    ``(1 + cos(pi (1 - s / N))) / 2``); ``None`` leaves the optimizer's own weight decay alone.
    """

    decay_style: str = "constant"
    init_lr_ratio: float = 0.0
    min_lr_ratio: float = 0.0
    decay_steps: int | None = None
    wsd_decay_steps: int | None = None
    wsd_style: str = "exponential"
    weight_decay_style: str = "constant"
    start_weight_decay: float | None = None
    end_weight_decay: float | None = None

    def __post_init__(self):
        for name, value, choices in (("decay_style", self.decay_style, DECAY_STYLES),
                                     ("wsd_style", self.wsd_style, WSD_STYLES),
                                     ("weight_decay_style", self.weight_decay_style, WD_STYLES)):
            if value not in choices:
                raise ValueError(f"unknown {name} {value!r}; choose from {choices}")
        if not 0.0 <= self.min_lr_ratio <= 1.0 or not 0.0 <= self.init_lr_ratio <= 1.0:
            raise ValueError(f"init_lr_ratio and min_lr_ratio must be in [0, 1] (the warm-up starts and the decay ends "
                             f"at most at the lr), got {self.init_lr_ratio} and {self.min_lr_ratio}")
        if self.decay_style == "WSD" and not self.wsd_decay_steps:
            raise ValueError("decay_style='WSD' needs wsd_decay_steps (verl: optim.lr_wsd_decay_steps)")
        if (self.start_weight_decay is None) != (self.end_weight_decay is None):
            raise ValueError("set both start_weight_decay and end_weight_decay, or neither")
        if self.weight_decay_style == "constant" and self.start_weight_decay != self.end_weight_decay:
            raise ValueError("weight_decay_style='constant' needs start_weight_decay == end_weight_decay")

    def __str__(self) -> str:
        text = f"Megatron {self.decay_style}" + (f" to {self.min_lr_ratio:g} x lr" if self.decay_style != "constant"
                                                  else "")
        text += f", warm-up from {self.init_lr_ratio:g} x lr" if self.init_lr_ratio else ""
        if self.start_weight_decay is not None:
            text += f", weight decay {self.start_weight_decay:g} -> {self.end_weight_decay:g} ({self.weight_decay_style})"
        return text

    def factor(self, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
        """The multiplier of each optimizer's base lr at step ``s`` (megatron-core's ``get_lr`` / max_lr)."""
        decay = self.decay_steps or total_steps
        if decay <= warmup_steps:
            raise ValueError(f"the decay steps ({decay}) must be more than the warm-up steps ({warmup_steps}), "
                             "as megatron-core requires")
        i, m = self.init_lr_ratio, self.min_lr_ratio

        def factor(s: int) -> float:
            if warmup_steps > 0 and s <= warmup_steps:
                return i + (1 - i) * s / warmup_steps
            if self.decay_style == "constant":
                return 1.0
            if s > decay:
                return m
            if self.decay_style == "inverse-square-root":
                return max(m, max(warmup_steps, 1) ** 0.5 / max(s, 1) ** 0.5)
            r = (s - warmup_steps) / (decay - warmup_steps)
            if self.decay_style == "linear":
                c = 1.0 - r
            elif self.decay_style == "cosine":
                c = 0.5 * (math.cos(math.pi * r) + 1.0)
            else:  # WSD: stable until its last wsd_decay_steps, then the anneal
                start = decay - self.wsd_decay_steps
                q = max(s - start, 0) / self.wsd_decay_steps
                c = {"linear": 1.0 - q, "cosine": 0.5 * (math.cos(math.pi * q) + 1.0),
                     "exponential": 2.0 * 0.5 ** q - 1.0, "minus_sqrt": 1.0 - math.sqrt(q)}[self.wsd_style]
            return m + c * (1 - m)

        return factor

    def weight_decay(self, total_steps: int) -> Callable[[int], float] | None:
        """The weight decay at step ``s`` (megatron-core's ``get_wd``), or None to keep the optimizer's."""
        if self.start_weight_decay is None:
            return None
        w0, w1 = self.start_weight_decay, self.end_weight_decay

        def wd(s: int) -> float:
            if s > total_steps or self.weight_decay_style == "constant":
                return w1
            r = s / max(total_steps, 1)
            c = r if self.weight_decay_style == "linear" else 0.5 * (math.cos(math.pi * (1 - r)) + 1.0)
            return w0 + c * (w1 - w0)

        return wd


class WeightDecayLR(torch.optim.lr_scheduler.LambdaLR):
    """``LambdaLR`` that also sets the weight decay of each param group that has one (megatron-core's scheduler
    sets both; groups built with weight decay 0, such as biases, keep 0)."""

    def __init__(self, optimizer, lr_lambda: Callable[[int], float], wd_lambda: Callable[[int], float]):
        self.wd_lambda = wd_lambda
        self.wd_on = [bool(g.get("weight_decay")) for g in optimizer.param_groups]
        super().__init__(optimizer, lr_lambda)

    def step(self, epoch=None):
        super().step(epoch)
        wd = self.wd_lambda(self.last_epoch)
        for group, on in zip(self.optimizer.param_groups, self.wd_on):
            group["weight_decay"] = wd if on else 0.0

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.pop("wd_lambda", None)  # a function: rebuilt from the schedule, never pickled
        return state


def lr_lambda(kind: str | Schedule | ParamSchedule, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """The multiplier of the base learning rate at each step, for a schedule name or a schedule object."""
    schedule = kind if isinstance(kind, (Schedule, ParamSchedule)) else Schedule(kind)
    return schedule.factor(warmup_steps, total_steps)


def make_scheduler(optimizer, kind: str | Schedule | ParamSchedule, warmup_steps: int, total_steps: int):
    """The scheduler the Trainer steps once per RL step: a ``LambdaLR``, or a :class:`WeightDecayLR` for a
    :class:`ParamSchedule` that changes the weight decay."""
    wd = kind.weight_decay(total_steps) if isinstance(kind, ParamSchedule) else None
    if wd is None:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(kind, warmup_steps, total_steps))
    return WeightDecayLR(optimizer, lr_lambda(kind, warmup_steps, total_steps), wd)


def step_schedulers(schedulers) -> None:
    """Advance the learning-rate schedules one RL step.

    A step whose gradient was not finite skips ``optimizer.step()`` on purpose (and counts it); the schedule
    still advances, as verl's does, so PyTorch's "``lr_scheduler.step()`` before ``optimizer.step()``"
    warning describes intended behaviour there and is silenced for this call only.
    """
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        for sched in schedulers:
            sched.step()
