"""Learning-rate schedules as ``LambdaLR`` factors, with verl's formulas (``verl.utils.torch_functional``).

``Optim(lr_schedule=...)`` takes ``"constant"``, ``"cosine"`` or a :class:`Schedule` (a cosine with a floor
and a cycle count). With ``w`` warm-up steps and ``N`` steps in all, the factor at step ``s`` (0, 1, ...) is

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

SCHEDULES = ("constant", "cosine")


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


def lr_lambda(kind: str | Schedule, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """The multiplier of the base learning rate at each step, for a schedule name or a :class:`Schedule`."""
    schedule = kind if isinstance(kind, Schedule) else Schedule(kind)
    return schedule.factor(warmup_steps, total_steps)


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
