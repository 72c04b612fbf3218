"""``rlflow train --task tools``: GRPO with a calculator tool on the built-in multiplication task, on CPU.

The rollout is an :class:`~rlflow.rollout.agent.AgentLoop` around an ``HFRollout``: each sample may call the
calculator, read its result and answer. Prints held-out greedy accuracy (the agent loop, greedy) before and
after, and ends with ``held-out accuracy: A -> B``; the tool metrics (turns, calls, errors, masked tokens)
go to the run's ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from rlflow.algorithms import GRPO, PPOLoss
from rlflow.models.policy import Policy
from rlflow.rewards import FunctionReward
from rlflow.rollout.agent import AgentLoop
from rlflow.rollout.hf import HFRollout
from rlflow.tasks.calculator import DATA_SOURCE, CalculatorTask, compute_score, warm_started_model
from rlflow.trainer.trainer import Trainer
from rlflow.trainer.options import with_groups

ACCURACY_KEY = f"val-core/{DATA_SOURCE}/reward/mean@1"
TOOL_METRICS = ("num_turns/mean", "agent/tool_calls/mean", "agent/tool_error_rate", "agent/masked_tokens/mean")


def build_trainer(seed: int = 0, steps: int = 30, run_dir: str | Path = "runs/tools", *,
                  task: CalculatorTask | None = None, batch_size: int = 16, n: int = 8, lr: float = 5e-4,
                  progress: bool = True, tools=None, reward=None, **trainer_kwargs):
    """The modules of the tool job, assembled; returns ``(trainer, data)``.

    ``tools`` replace the task's calculator (the warm-started model calls ``calc(expr)``: a replacement keeps
    that schema); ``reward`` replaces ``FunctionReward(compute_score)``.
    """
    task = task or CalculatorTask()
    model, tokenizer = warm_started_model(task, seed)
    rollout = AgentLoop(HFRollout(n=n, temperature=1.0, max_new_tokens=task.max_response_tokens),
                        task.tools() if tools is None else tools, max_assistant_turns=2)
    trainer = Trainer(
        policy=Policy(model, tokenizer, temperature=1.0), rollout=rollout,
        reward=FunctionReward(compute_score) if reward is None else reward, estimator=GRPO(),
        loss=PPOLoss(clip_ratio=0.2),
        **with_groups(batch_size=batch_size, lr=lr, weight_decay=0.0, max_steps=steps, run_dir=run_dir, seed=seed,
                      progress=progress, **trainer_kwargs),
    )
    return trainer, task.data(seed)


def run(seed: int = 0, steps: int = 30, run_dir: str | Path = "runs/tools", progress: bool = True) -> tuple[float, float]:
    """Run the tool job; returns held-out accuracy before and after."""
    torch.manual_seed(seed)
    start = time.perf_counter()
    run_dir = Path(run_dir)
    trainer, data = build_trainer(seed, steps, run_dir, progress=progress, val_every=max(1, steps // 3))
    before = trainer.validate(data)[ACCURACY_KEY]
    print(f"held-out accuracy before RL: {before:.3f} ({len(data.val)} prompts, greedy, with the calculator)")
    history = trainer.fit(data)
    after = history[-1][ACCURACY_KEY]  # fit validates at its last step
    elapsed = time.perf_counter() - start
    first, last = history[0], history[-1]
    for key in TOOL_METRICS:
        print(f"{key}: {first[key]:.2f} (step 1) -> {last[key]:.2f} (step {len(history)})")
    summary = {"seed": seed, "steps": steps, "before": before, "after": after, "wall_s": round(elapsed, 1),
               **{f"last/{k}": last[k] for k in TOOL_METRICS}}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"{steps} GRPO steps in {elapsed:.0f} s; metrics in {run_dir}/metrics.jsonl")
    print(f"held-out accuracy: {before:.2f} -> {after:.2f}")
    return before, after
