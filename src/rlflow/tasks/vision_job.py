"""``rlflow train --task vision``: GRPO on the built-in shapes task with a tiny Qwen2.5-VL, on CPU.

The same modules as the default job (Policy, HFRollout, FunctionReward, GRPO, PPOLoss, Trainer); the
Policy holds the processor and the prompts carry images. Prints held-out greedy accuracy before and
after and ends with the line ``held-out accuracy: A -> B``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from rlflow.algorithms import GRPO, PPOLoss
from rlflow.rewards import FunctionReward
from rlflow.rollout.hf import HFRollout
from rlflow.tasks.shapes import DATA_SOURCE, ShapesTask, exact_match, warm_started_policy
from rlflow.trainer.trainer import Trainer
from rlflow.trainer.options import with_groups

ACCURACY_KEY = f"val-core/{DATA_SOURCE}/reward/mean@1"
DEFAULT_STEPS = 80
VAL_EVERY = 20  # held-out accuracy every 20 steps and at the last (200 greedy pictures each)


def build_trainer(seed: int = 0, steps: int = DEFAULT_STEPS, run_dir: str | Path = "runs/vision", *,
                  task: ShapesTask | None = None, batch_size: int = 16, n: int = 8, lr: float = 2e-3,
                  progress: bool = True, **trainer_kwargs):
    """The modules of the vision job, assembled; returns ``(trainer, data)``."""
    task = task or ShapesTask()
    policy, data = warm_started_policy(task, seed, temperature=1.0)
    trainer = Trainer(
        policy=policy,
        rollout=HFRollout(n=n, temperature=1.0, max_new_tokens=task.max_new_tokens),
        reward=FunctionReward(exact_match), estimator=GRPO(), loss=PPOLoss(clip_ratio=0.2),
        **with_groups(batch_size=batch_size, lr=lr, weight_decay=0.0, max_steps=steps, run_dir=run_dir, seed=seed,
                      progress=progress, **trainer_kwargs),  # -> optim=Optim(...), loop=Loop(...), ...
    )
    return trainer, data


def run(seed: int = 0, steps: int = DEFAULT_STEPS, run_dir: str | Path = "runs/vision",
        progress: bool = True) -> tuple[float, float]:
    """Run the vision job; returns held-out accuracy before and after."""
    torch.manual_seed(seed)
    start = time.perf_counter()
    run_dir = Path(run_dir)
    trainer, data = build_trainer(seed, steps, run_dir, progress=progress, val_every=VAL_EVERY)
    before = trainer.validate(data)[ACCURACY_KEY]
    print(f"held-out accuracy before RL: {before:.3f} ({len(data.val)} pictures, greedy)")
    history = trainer.fit(data)  # validates at its last step: no second pass for "after"
    after = history[-1][ACCURACY_KEY] if history and ACCURACY_KEY in history[-1] else trainer.validate(data)[ACCURACY_KEY]
    elapsed = time.perf_counter() - start
    summary = {"seed": seed, "steps": steps, "before": before, "after": after, "wall_s": round(elapsed, 1)}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"{steps} GRPO steps in {elapsed:.0f} s; metrics in {run_dir}/metrics.jsonl")
    print(f"held-out accuracy: {before:.2f} -> {after:.2f}")
    return before, after
