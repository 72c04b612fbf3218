"""Wall time and held-out accuracy of the default job (``rlflow train``) over seeds.

    python benchmarks/default_job.py            # --seeds 0,1,2 --steps 200

For each seed, ``rlflow train --seed S --no-progress`` runs in a fresh process with an empty rlflow cache
(``RLFLOW_CACHE`` pointed at a new temporary folder): seeds 0-2 load the warm start shipped with rlflow,
another seed trains its warm start first (the report says which). The job's own ``summary.json`` gives its wall time
(model set-up, validation before, the GRPO steps, validation after) and held-out accuracy before (A) and after
(B); the process's total wall time (interpreter and imports included) is measured around it. Reports the
medians over seeds and each run's B - A, which the default job must keep at 0.30 or more. Torch uses one
thread (``--threads``). Writes benchmarks/default_job.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_job(seed: int, steps: int, cache: Path, run_dir: Path, threads: int) -> dict:
    env = os.environ | {"RLFLOW_CACHE": str(cache), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "rlflow.cli", "train", "--seed", str(seed), "--steps", str(steps),
           "--run-dir", str(run_dir), "--no-progress"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    process_s = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"[default_job] seed {seed} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"seed": seed, "warm_start": "shipped" if "shipped with rlflow" in proc.stdout else "trained here",
            "job_wall_s": summary["wall_s"], "process_wall_s": process_s, "before": summary["before"],
            "after": summary["after"], "gain": summary["after"] - summary["before"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="rlflow-default-job-") as tmp:
        for seed in (int(s) for s in args.seeds.split(",")):
            r = run_job(seed, args.steps, Path(tmp) / f"cache-{seed}", Path(tmp) / f"run-{seed}", args.threads)
            runs.append(r)
            print(f"seed {seed} (warm start {r['warm_start']}): job {r['job_wall_s']:6.1f} s, process "
                  f"{r['process_wall_s']:6.1f} s, accuracy {r['before']:.3f} -> {r['after']:.3f} "
                  f"(B - A = {r['gain']:+.3f})", flush=True)
    med = {k: statistics.median(r[k] for r in runs) for k in ("job_wall_s", "process_wall_s", "before", "after", "gain")}
    report = {"runs": runs, "median": med, "steps": args.steps, "min_gain": min(r["gain"] for r in runs),
              "load_average": os.getloadavg()}
    print(f"median: job {med['job_wall_s']:.1f} s, process {med['process_wall_s']:.1f} s, accuracy "
          f"{med['before']:.3f} -> {med['after']:.3f}, B - A {med['gain']:+.3f}")
    print(f"smallest B - A: {report['min_gain']:+.3f}; load average {report['load_average'][0]:.1f}")
    Path(__file__).with_suffix(".json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
