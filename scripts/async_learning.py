"""Does fully asynchronous RL learn as well as the synchronous run? The default job, both ways, over seeds.

    python scripts/async_learning.py                 # --seeds 0 1 2 --steps 200 (about 1-3 min a run on 2 cores)

For each seed, ``rlflow train``'s job (GRPO on reversed addition from the shipped warm start, 32 prompts x 8
samples, <= 4 new tokens, 200 steps, ``rlflow.tasks.default_job.build_trainer``) runs once per mode, in turn:

- ``sync``: the job as ``rlflow train`` runs it;
- ``fully-async``: the same with ``FullyAsyncRollout(HFRollout(...), max_off_policy_threshold=2,
  max_off_policy_strategy="wait", chunk_tokens=2)`` (the engine in its own process, partial rollouts: a
  response's 4 tokens are generated in two chunks, so a weight update can land between them) and verl's
  fully-async recipe's correction (``fully_async_ppo_trainer.yaml``: ``bypass_mode=True``, ``rollout_is=null``,
  ``loss_type=ppo_clip``): the sampler's log-probs are the old ones and PPO's clipped ratio is taken against
  them (``Chain(RolloutAsOld(), GRPO())``, ``BypassLoss("ppo_clip")``);
- ``fully-async-is`` (``--modes``): the same rollout with decoupled truncated importance sampling instead
  (``Chain(TruncatedIS(), GRPO())``, ``PPOLoss(is_weights=True)``: old log-probs recomputed, the ratio to them
  unclipped at one update a step, each token weighted by ``min(pi_old / pi_rollout, 2)``), what rlflow's verl
  entry point adds for the V1 modes and what this script ran before.

Prints held-out greedy accuracy before and after for each run, the medians per mode, each mode's seed-to-seed
spread (max - min of the accuracy after) and the fully async runs' staleness. ``--jitters K ...`` runs each seed
from the warm start jittered by ``RLFLOW_WARM_START_JITTER=K`` too (more paths per seed; 0: as shipped). Writes
``scripts/async_learning.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rlflow import Policy, PPOLoss, Trainer
from rlflow.algorithms import GRPO, BypassLoss, RolloutAsOld, TruncatedIS
from rlflow.module import Chain
from rlflow.rewards import FunctionReward
from rlflow.rollout import FullyAsyncRollout, HFRollout
from rlflow.tasks.addition import AdditionTask, exact_match, warm_started_model
from rlflow.tasks.default_job import ACCURACY_KEY, build_trainer
from rlflow.trainer.options import with_groups

MODES = ("sync", "fully-async", "fully-async-is")
JITTER = "RLFLOW_WARM_START_JITTER"  # rlflow.tasks.warm_start


def fully_async_trainer(seed: int, steps: int, run_dir: Path, correction: str = "bypass"):
    """The default job's modules with a fully asynchronous rollout and ``correction`` (``"bypass"``: verl's
    fully-async recipe; ``"is"``: decoupled truncated IS; module docstring); returns (trainer, data)."""
    task = AdditionTask()
    model, tokenizer = warm_started_model(task, seed, progress=False)
    rollout = FullyAsyncRollout(HFRollout(n=8, temperature=1.0, max_new_tokens=task.max_new_tokens),
                                max_off_policy_threshold=2, max_off_policy_strategy="wait", chunk_tokens=2)
    if correction == "bypass":  # verl's fully_async_ppo_trainer.yaml: bypass_mode=True, loss_type=ppo_clip
        estimator, loss = Chain(RolloutAsOld(), GRPO()), BypassLoss("ppo_clip", clip_ratio=0.2)
    else:
        estimator, loss = Chain(TruncatedIS(), GRPO()), PPOLoss(clip_ratio=0.2, is_weights=True)
    trainer = Trainer(
        policy=Policy(model, tokenizer, temperature=1.0), rollout=rollout, reward=FunctionReward(exact_match),
        estimator=estimator, loss=loss,
        **with_groups(batch_size=32, lr=2e-4, weight_decay=0.0, max_steps=steps, run_dir=run_dir, seed=seed,
                      progress=False),
    )
    return trainer, task.data(seed)


def run(mode: str, seed: int, steps: int, run_dir: Path, jitter: int = 0) -> dict:
    os.environ[JITTER] = str(jitter)  # read when the warm start loads (0: the shipped weights)
    torch.manual_seed(seed)
    start = time.perf_counter()
    if mode == "sync":
        trainer, data = build_trainer(seed, steps, run_dir, progress=False)
    else:
        trainer, data = fully_async_trainer(seed, steps, run_dir, "bypass" if mode == "fully-async" else "is")
    try:
        before = trainer.validate(data)[ACCURACY_KEY]
        history = trainer.fit(data)
        after = trainer.validate(data)[ACCURACY_KEY]
    finally:
        if hasattr(trainer.rollout, "close"):
            trainer.rollout.close()
    stale = [m["async/staleness_mean"] for m in history if "async/staleness_mean" in m]
    return {"mode": mode, "seed": seed, "jitter": jitter, "before": before, "after": after,
            "wall_s": time.perf_counter() - start,
            "staleness_mean": statistics.mean(stale) if stale else 0.0,
            "staleness_max": max((m["async/staleness_max"] for m in history if "async/staleness_max" in m),
                                 default=0.0),
            "partial_frac": statistics.mean([m.get("async/partial_frac", 0.0) for m in history])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--jitters", type=int, nargs="+", default=[0], help="warm-start jitters per seed (0: none)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES[:2]))
    parser.add_argument("--out", default=str(Path(__file__).with_name("async_learning.json")))
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="rlflow-async-learning-"))
    load_start, runs = os.getloadavg(), []
    paths = [(seed, jitter) for jitter in args.jitters for seed in args.seeds]
    for i, (seed, jitter) in enumerate(paths):
        for mode in args.modes if i % 2 == 0 else args.modes[::-1]:  # alternate which mode runs first
            out = run(mode, seed, args.steps, tmp / f"{mode}-{seed}-{jitter}", jitter)
            runs.append(out)
            path = f"seed {seed}" + (f" jitter {jitter}" if jitter else "")
            print(f"{mode:14s} {path}: held-out accuracy {out['before']:.3f} -> {out['after']:.3f} "
                  f"({out['wall_s']:.0f} s; staleness mean {out['staleness_mean']:.2f}, max {out['staleness_max']:.0f}, "
                  f"partial {out['partial_frac']:.2f})", flush=True)
    summary = {}
    for mode in args.modes:
        after = [r["after"] for r in runs if r["mode"] == mode]
        summary[mode] = {"after": after, "median_after": statistics.median(after), "spread": max(after) - min(after),
                         "median_before": statistics.median(r["before"] for r in runs if r["mode"] == mode)}
        print(f"{mode:14s} median of {len(after)} runs: {summary[mode]['median_before']:.3f} -> "
              f"{summary[mode]['median_after']:.3f} (after: {', '.join(f'{a:.3f}' for a in after)}; "
              f"spread {summary[mode]['spread']:.3f})")
    gaps = {mode: summary[mode]["median_after"] - summary["sync"]["median_after"]
            for mode in args.modes if mode != "sync" and "sync" in summary}
    for mode, gap in gaps.items():
        print(f"{mode} - sync, medians: {gap:+.3f}; seed-to-seed spread of sync {summary['sync']['spread']:.3f}")
    report = {"steps": args.steps, "seeds": args.seeds, "jitters": args.jitters, "runs": runs, "summary": summary,
              "median_gap": gaps.get("fully-async"), "median_gaps": gaps,
              "load_average_at_start": load_start, "load_average_at_end": os.getloadavg(), "cpus": os.cpu_count()}
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
