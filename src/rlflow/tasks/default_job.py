"""The default job (``rlflow train`` with no arguments): GRPO on the built-in addition task, on CPU.

Prints held-out greedy accuracy before and after, saves the reward curve as
``reward_curve.png`` in the run directory, and ends with the line
``held-out accuracy: A -> B``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from rlflow import roles
from rlflow.algorithms import GRPO, PPOLoss, TruncatedIS
from rlflow.models.policy import Policy
from rlflow.module import Chain
from rlflow.rewards import FunctionReward
from rlflow.rollout.async_rollout import AsyncRollout
from rlflow.rollout.hf import HFRollout
from rlflow.rollout.vllm import VLLMRollout
from rlflow.tasks.addition import DATA_SOURCE, AdditionTask, exact_match, warm_started_model
from rlflow.trainer.trainer import Trainer
from rlflow.trainer.options import with_groups

ACCURACY_KEY = f"val-core/{DATA_SOURCE}/reward/mean@1"


def vllm_rollout(n: int, max_new_tokens: int):
    """vLLM in the training process; float32 like the policy, so the sampler's log-probs are the policy's.

    Eager: on CPU, vLLM's compiled mode spends ~40 s compiling at start-up, more than it saves on this
    model in 200 steps (measured: 227 s compiled, 138 s eager for the whole job, same accuracy).
    """
    return VLLMRollout(n=n, temperature=1.0, max_new_tokens=max_new_tokens, dtype="float32", enforce_eager=True)


# --rollout NAME -> the rollout of the default job
ROLLOUTS = {"hf": lambda n, max_new_tokens: HFRollout(n=n, temperature=1.0, max_new_tokens=max_new_tokens),
            "vllm": vllm_rollout}


def warm_started_policy(seed: int = 0, *, task: AdditionTask | None = None, temperature: float = 1.0, lora=None,
                        progress: bool = False) -> Policy:
    """The default job's policy: the task's tiny model after the supervised warm start (shipped for seeds 0-2)."""
    model, tokenizer = warm_started_model(task or AdditionTask(), seed, progress=progress)
    return Policy(model, tokenizer, temperature=temperature, lora=lora)


def prompts(seed: int = 0, *, task: AdditionTask | None = None):
    """The default job's prompts: the task's training split, and its held-out split for validation."""
    return (task or AdditionTask()).data(seed)


def build_trainer(seed: int = 0, steps: int = 200, run_dir: str | Path = "runs/default", *, task: AdditionTask | None = None,
                  batch_size: int = 32, n: int = 8, lr: float = 2e-4, progress: bool = True,
                  estimator=None, loss=None, reward=None, rollout: str = "hf", lora=None,
                  max_staleness: int | None = None, **trainer_kwargs):
    """The modules of the default job, assembled; returns ``(trainer, data)``.

    ``estimator`` / ``loss`` / ``reward`` replace the default ``GRPO()`` / ``PPOLoss(clip_ratio=0.2)`` /
    ``FunctionReward(exact_match)`` (e.g. another advantage estimator on the same task, or the
    partial-credit ``FunctionReward(digit_match)``; validation then reports that reward too).
    ``rollout`` names the engine: ``"hf"`` (transformers) or ``"vllm"`` (in-process vLLM).
    ``lora``: a ``peft.LoraConfig`` to train LoRA adapters on the warm-started model instead of all weights.
    ``max_staleness`` (an integer) makes generation asynchronous (``AsyncRollout``: the engine in a process of
    its own, that many batches ahead) with truncated importance sampling in the loss by default
    (``Chain(TruncatedIS(), GRPO())``, ``PPOLoss(is_weights=True)``).
    """
    task = task or AdditionTask()
    policy = warm_started_policy(seed, task=task, lora=lora, progress=progress)
    sampler = ROLLOUTS[rollout](n, task.max_new_tokens)
    if max_staleness is not None:
        sampler = AsyncRollout(sampler, max_staleness=max_staleness)
        estimator = estimator if estimator is not None else Chain(TruncatedIS(), GRPO())
        loss = loss if loss is not None else PPOLoss(clip_ratio=0.2, is_weights=True)
    trainer = Trainer(
        policy=policy,
        rollout=sampler,
        reward=reward if reward is not None else FunctionReward(exact_match),
        estimator=estimator if estimator is not None else GRPO(),
        loss=loss if loss is not None else PPOLoss(clip_ratio=0.2),
        # the settings, and the caller's (val_every=..., ...), sorted into optim=Optim(...), loop=Loop(...), ...
        **with_groups(batch_size=batch_size, lr=lr, weight_decay=0.0, max_steps=steps, run_dir=run_dir, seed=seed,
                      progress=progress, **trainer_kwargs),
    )
    return trainer, prompts(seed, task=task)


def plot_rewards(history: list[dict], path: Path, before: float | None = None) -> None:
    """Batch reward (sampled at temperature 1), its moving average and held-out greedy accuracy per step.

    The legend sits below the axes (never over the curves), with a note on why the sampled reward
    runs below the greedy accuracy.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["training/global_step"] for m in history]
    scores = [m["critic/score/mean"] for m in history]
    k = max(1, len(scores) // 25)  # moving average over ~4% of the run
    smooth = [sum(scores[max(0, i - k + 1): i + 1]) / len(scores[max(0, i - k + 1): i + 1]) for i in range(len(scores))]
    fig, ax = plt.subplots(figsize=(6.5, 4.6))
    ax.plot(steps, scores, alpha=0.3, label="batch mean reward (sampled)")
    ax.plot(steps, smooth, label=f"moving average ({k} steps)")
    val = ([(0, before)] if before is not None else []) + [
        (m["training/global_step"], m[ACCURACY_KEY]) for m in history if ACCURACY_KEY in m]
    if val:
        ax.plot(*zip(*val), "o-", label="held-out accuracy (greedy)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(0, 1)
    ax.set_title("GRPO on reversed addition")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, fontsize=8, frameon=False)
    fig.text(0.5, 0.02, "The reward is of samples drawn at temperature 1 (exploration): a sample often takes a less "
                        "likely,\nwrong digit, so the batch reward sits below the accuracy of greedy decoding.",
             ha="center", va="bottom", fontsize=7.5, color="0.35")
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(seed: int = 0, steps: int = 200, run_dir: str | Path = "runs/default", progress: bool = True,
        rollout: str = "hf", max_staleness: int | None = None, started: float | None = None) -> tuple[float, float]:
    """Run the default job (generating with ``rollout``: hf or vllm; ``max_staleness`` batches ahead in a process of
    its own when given); returns held-out accuracy before and after.

    Prints the accuracy before RL, then ``N GRPO steps in X s (+ setup and warm start W s, validation V s)``:
    the RL time excludes the setup (imports from ``started``, a ``time.perf_counter()`` the command took
    before importing this module; default: now), the warm start (a cached one loads in a second) and the
    validation passes.
    """
    start = time.perf_counter() if started is None else started
    torch.manual_seed(seed)
    run_dir = Path(run_dir)
    trainer, data = build_trainer(seed, steps, run_dir, progress=progress, val_every=max(1, steps // 5),
                                  rollout=rollout, max_staleness=max_staleness)
    setup = time.perf_counter() - start
    try:
        t0 = time.perf_counter()
        before = trainer.validate(data)[ACCURACY_KEY]
        validation = time.perf_counter() - t0
        print(f"held-out accuracy before RL: {before:.3f} ({len(data.val)} prompts, greedy)")
        t0 = time.perf_counter()
        history = trainer.fit(data)
        fit = time.perf_counter() - t0
        t0 = time.perf_counter()
        after = trainer.validate(data)[ACCURACY_KEY]
    finally:
        close = roles.optional(trainer.rollout, roles.Rollout, "close")
        if close is not None:  # an asynchronous rollout's engine process
            close()
    in_fit = sum(m.get("timing_s/testing", 0.0) for m in history)  # validation inside fit (every steps // 5)
    validation += time.perf_counter() - t0 + in_fit
    rl = fit - in_fit
    elapsed = time.perf_counter() - start
    plot_rewards(history, run_dir / "reward_curve.png", before)
    summary = {"seed": seed, "steps": steps, "rollout": rollout, "max_staleness": max_staleness, "before": before,
               "after": after, "wall_s": round(elapsed, 1), "rl_s": round(rl, 1), "validation_s": round(validation, 1),
               "setup_s": round(setup, 1)}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"{steps} GRPO steps in {rl:.0f} s (+ setup and warm start {setup:.0f} s, validation {validation:.0f} s); "
          f"metrics in {run_dir}/metrics.jsonl, curve in {run_dir}/reward_curve.png")
    print(f"held-out accuracy: {before:.2f} -> {after:.2f}")
    return before, after
