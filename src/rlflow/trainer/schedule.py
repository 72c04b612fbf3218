"""Learning-rate schedules as ``LambdaLR`` factors: linear warmup, then constant or cosine decay."""

from __future__ import annotations

import math
from typing import Callable

SCHEDULES = ("constant", "cosine")


def lr_lambda(kind: str, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> Callable[[int], float]:
    """The multiplier of the base learning rate at each step."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown lr_schedule '{kind}'; choose from {SCHEDULES}")

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


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
