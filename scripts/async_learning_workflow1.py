"""Does fully asynchronous RL learn as well as the synchronous run on the real-model recipe? Both, over seeds.

    python scripts/async_learning_workflow1.py        # --seeds 1 2 3; about 10 min a run on 2 shared cores

``recipes/workflow1/run.sh`` (the seed's Workflow 1: GRPO on ``\\boxed{}`` addition, SmolLM2-135M-Instruct,
10 steps of 8 prompts x 4 samples, greedy validation on 25 held-out prompts at steps 0, 5 and 10;
docs/workflow1.md) with transformers generating (``ROLLOUT=hf``), seed by seed, each mode in turn:

- ``sync``: the recipe as written;
- ``fully-async``: the same command with verl's V1 keys for its fully asynchronous trainer, staleness <= 2
  (``FULLY_ASYNC``: ``FullyAsyncRollout(max_off_policy_threshold=2, max_off_policy_strategy="wait")``, the
  engine in its own process), and verl's fully-async recipe's correction, bypass mode (PPO's clipped ratio
  against the sampler's log-probs; docs/async.md). ``wait`` rather than verl's default ``drop``: no group
  older than the bound is trained, and none is dropped either (10 steps of 8 prompts leave little to drop).

Prints each run's held-out accuracy at steps 0 -> 5 -> 10, its batch reward (mean training reward over
steps 1-3 and 8-10, as docs/workflow1.md) and, for the fully async runs, the staleness verl logs
(``training/off_policy/trajectory_staleness*``: the trainer's version minus the newest / oldest version that
sampled a response); then per mode the medians over the seeds and the seed-to-seed spread (max - min) of the
accuracy at step 10. Writes ``scripts/async_learning_workflow1.json``. Runs go to ``--root``/<mode>-seed<N>
with their output in <mode>-seed<N>.log; ``--reuse`` reads a finished run there instead of running it again.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_SH = ROOT / "recipes" / "workflow1" / "run.sh"
ACCURACY = "val-core/workflow1/addition/reward/mean@1"
REWARD = "critic/score/mean"
FULLY_ASYNC = ("trainer.use_v1=true", "trainer.v1.trainer_mode=colocate_async",
               "trainer.v1.sampler.max_off_policy_threshold=2", "trainer.v1.sampler.max_off_policy_strategy=wait",
               "algorithm.rollout_correction.bypass_mode=true")
MODES = {"sync": (), "fully-async": FULLY_ASYNC}
STALENESS = "training/off_policy/trajectory_staleness"  # trainer's version - the newest that sampled a response
WORST = "training/off_policy/trajectory_staleness_worst"  # - the oldest
SUMMARY = re.compile(r"\[rlflow\] (\d+) RL steps \(\w+\) in (\d+) s \(\+ setup (\d+) s, validation (\d+) s\)")
# the last line of a run's log: this script's, or /usr/bin/time -f "TIME wall %e s user %U s sys %S s" by hand
TIMED = re.compile(r"(?:RUN wall ([\d.]+) s cpu ([\d.]+) s)|(?:TIME wall ([\d.]+) s user ([\d.]+) s sys ([\d.]+) s)")


def read_run(run_dir: Path, log: Path) -> dict | None:
    """The figures of a finished run (its metrics.jsonl and the summary line of its log), or None."""
    metrics, text = run_dir / "metrics.jsonl", log.read_text() if log.exists() else ""
    summary = SUMMARY.search(text)
    if not metrics.exists() or summary is None:
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    accuracy = {r["step"]: r[ACCURACY] for r in rows if ACCURACY in r}
    trained = [r for r in rows if REWARD in r]
    reward = [r[REWARD] for r in sorted(trained, key=lambda r: r["step"])]
    stale = [r for r in trained if f"{STALENESS}/mean" in r]
    return {"accuracy": accuracy, "reward": reward,
            "reward_first3": statistics.mean(reward[:3]), "reward_last3": statistics.mean(reward[-3:]),
            "staleness_mean": statistics.mean(r[f"{STALENESS}/mean"] for r in stale) if stale else None,
            "staleness_max": max(r[f"{STALENESS}/max"] for r in stale) if stale else None,
            "staleness_worst_max": max(r[f"{WORST}/max"] for r in stale) if stale else None,
            "spans_max": max(r["training/off_policy/trajectory_spans/max"] for r in stale) if stale else None,
            "dropped_groups": sum(r.get("async/dropped_groups", 0.0) for r in stale),
            "train_s": int(summary[2]), "setup_s": int(summary[3]), "validation_s": int(summary[4])} | (
        timing(timed) if (timed := TIMED.search(text)) else {})


def timing(found: re.Match) -> dict:
    if found[1]:
        return {"wall_s": float(found[1]), "cpu_s": float(found[2])}
    return {"wall_s": float(found[3]), "cpu_s": float(found[4]) + float(found[5])}


def run(mode: str, seed: int, root: Path, reuse: bool, extra: list[str]) -> dict:
    run_dir, log = root / f"{mode}-seed{seed}", root / f"{mode}-seed{seed}.log"
    done = read_run(run_dir, log) if reuse else None
    if done is None:
        env = os.environ | {"ROLLOUT": "hf", "SEED": str(seed), "RUN_DIR": str(run_dir)}
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        start, cpu = time.perf_counter(), os.times()
        with log.open("w") as out:
            rc = subprocess.run([str(RUN_SH), *MODES[mode], *extra], env=env, stdout=out, stderr=subprocess.STDOUT,
                                cwd=ROOT).returncode
        used = os.times()
        if rc != 0:
            sys.exit(f"{mode} seed {seed}: recipes/workflow1/run.sh exited {rc}; its output is in {log}")
        cpu_s = used.children_user + used.children_system - cpu.children_user - cpu.children_system
        with log.open("a") as out:
            out.write(f"RUN wall {time.perf_counter() - start:.2f} s cpu {cpu_s:.2f} s\n")
        done = read_run(run_dir, log)
    return {"mode": mode, "seed": seed} | done


def describe(r: dict) -> str:
    acc = " -> ".join(f"{a:.2f}" for _, a in sorted(r["accuracy"].items()))
    line = (f"{r['mode']:11s} seed {r['seed']}: held-out {acc}; batch reward {r['reward_first3']:.2f} -> "
            f"{r['reward_last3']:.2f} (steps 1-3 -> 8-10); {r['train_s']} s training"
            + (f", wall {r['wall_s']:.0f} s, CPU {r['cpu_s']:.0f} s" if "wall_s" in r else ""))
    if r["staleness_mean"] is not None:
        line += (f"; staleness mean {r['staleness_mean']:.2f}, max {r['staleness_max']:.0f} (oldest token "
                 f"{r['staleness_worst_max']:.0f}), spans <= {r['spans_max']:.0f}, dropped {r['dropped_groups']:.0f}")
    return line


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--root", default="runs/async-workflow1", help="folder for the runs and their logs")
    parser.add_argument("--reuse", action="store_true", help="read a run already finished under --root")
    parser.add_argument("--out", default=str(Path(__file__).with_name("async_learning_workflow1.json")))
    parser.add_argument("overrides", nargs="*", help="more key=value overrides for every run (e.g. smaller sizes)")
    args = parser.parse_args(argv)
    root = Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    load_start, runs = os.getloadavg(), []
    for seed in args.seeds:  # seed by seed, so that a run cut short leaves pairs
        for mode in args.modes:
            runs.append(run(mode, seed, root, args.reuse, args.overrides))
            print(describe(runs[-1]), flush=True)
    summary = {}
    for mode in args.modes:
        mine = [r for r in runs if r["mode"] == mode]
        last = max(mine[0]["accuracy"])
        after = [r["accuracy"][last] for r in mine]
        summary[mode] = {"steps": sorted(mine[0]["accuracy"]), "after": after, "spread": max(after) - min(after),
                         "median_accuracy": {s: statistics.median(r["accuracy"][s] for r in mine)
                                             for s in sorted(mine[0]["accuracy"])},
                         "median_reward_first3": statistics.median(r["reward_first3"] for r in mine),
                         "median_reward_last3": statistics.median(r["reward_last3"] for r in mine)}
        medians = " -> ".join(f"{a:.2f}" for a in summary[mode]["median_accuracy"].values())
        print(f"{mode:11s} median of {len(mine)} seeds: held-out {medians} (step {last}: "
              f"{', '.join(f'{a:.2f}' for a in after)}; spread {summary[mode]['spread']:.2f}); batch reward "
              f"{summary[mode]['median_reward_first3']:.2f} -> {summary[mode]['median_reward_last3']:.2f}")
    gap = None
    if {"sync", "fully-async"} <= summary.keys():
        sync, fa = summary["sync"], summary["fully-async"]
        gap = statistics.median(fa["after"]) - statistics.median(sync["after"])
        median, low, high = statistics.median(fa["after"]), min(sync["after"]), max(sync["after"])
        where = "below" if median < low else "above" if median > high else "inside"
        print(f"fully-async - sync, medians at the last step: {gap:+.2f}; the synchronous seeds span "
              f"{low:.2f}-{high:.2f} (spread {sync['spread']:.2f}): the fully async median is {where} that range")
    report = {"seeds": args.seeds, "modes": {m: list(MODES[m]) for m in args.modes}, "overrides": args.overrides,
              "runs": runs, "summary": summary, "median_gap": gap, "load_average_at_start": load_start,
              "load_average_at_end": os.getloadavg(), "cpus": os.cpu_count()}
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
