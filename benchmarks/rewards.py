"""Reward time with 1 worker vs N workers, side by side (what the Trainer logs as ``timing_s/reward``).

    python benchmarks/rewards.py [--samples 64] [--repeats 3] [--workers N]

Two CPU-heavy workloads:

- ``verify``: a pure-Python checker (exact rational arithmetic, about 20 ms a sample, like symbolic
  math verification) in ``FunctionReward``: on 1 and 4 threads (the GIL serialises them), and in 1 vs N
  worker processes (``FunctionReward(processes=...)``).
- ``code``: ``CodeReward`` running each sample's program against 3 stdin test cases in the sandbox,
  with 1 vs N concurrent sandbox runs.

Every variant scores the same batch; repeats alternate between variants so machine noise hits all; the
report is the median seconds per batch and its speed-up over the 1-worker variant. Worker start-up is
not timed (the pool starts on a warm-up call, as it would at a run's first step). Writes
benchmarks/rewards.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from fractions import Fraction
from pathlib import Path

import torch
from tensordict import NonTensorStack, TensorDict

from rlflow.data import keys as K
from rlflow.rewards import CodeReward, FunctionReward


def verify(response: str, ground_truth: str) -> float:
    """A deliberately CPU-heavy exact check: the harmonic sum H(n) as a fraction, compared with the answer."""
    n = 1500 + int(ground_truth) % 50
    total = sum(Fraction(1, k) for k in range(1, n + 1))
    return float(str(total.numerator % 97) == response.strip())


PROGRAM = "```python\nimport sys\nn = int(sys.stdin.readline())\nprint(sum(i * i for i in range(n)))\n```"
TESTS = json.dumps({"inputs": ["10\n", "1000\n", "20000\n"],
                    "outputs": [str(sum(i * i for i in range(n))) for n in (10, 1000, 20000)]})


def batch(texts: list[str], truths: list[str]) -> TensorDict:
    b = len(texts)
    return TensorDict({K.RESPONSE_TEXT: NonTensorStack(*texts), K.RESPONSE_MASK: torch.ones(b, 4, dtype=torch.long),
                       K.GROUND_TRUTH: NonTensorStack(*truths), K.DATA_SOURCE: NonTensorStack(*["bench"] * b),
                       K.EXTRA_INFO: NonTensorStack(*[None] * b)}, batch_size=[b])


def timed(reward, data: TensorDict) -> float:
    start = time.perf_counter()
    reward(data.clone(False))
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 2, help="N (default: the CPU count)")
    args = p.parse_args()
    n = args.workers
    verify_batch = batch([str(i % 97) for i in range(args.samples)], [str(i) for i in range(args.samples)])
    # distinct programs (a comment makes each unique), so the per-call cache does not hide the work
    code_batch = batch([PROGRAM.replace("import sys", f"import sys  # {i}") for i in range(args.samples // 4)],
                       [TESTS] * (args.samples // 4))
    variants = {
        ("verify", "1 thread"): (FunctionReward(verify, max_workers=1), verify_batch),
        ("verify", "4 threads"): (FunctionReward(verify, max_workers=4), verify_batch),
        ("verify", "1 process"): (FunctionReward(verify, processes=1), verify_batch),
        ("verify", f"{n} processes"): (FunctionReward(verify, processes=n), verify_batch),
        ("code", "1 sandbox at a time"): (CodeReward(workers=1), code_batch),
        ("code", f"{n} sandboxes at a time"): (CodeReward(workers=n), code_batch),
    }
    for reward, data in variants.values():  # warm-up: worker processes start, the sandbox probes its layers
        reward(data[:2].clone(False))
    times: dict[tuple[str, str], list[float]] = {k: [] for k in variants}
    for _ in range(args.repeats):
        for key, (reward, data) in variants.items():
            times[key].append(timed(reward, data))
    for reward, _ in variants.values():
        getattr(reward, "close", lambda: None)()
    rows = []
    for (workload, variant), values in times.items():
        base = statistics.median(times[(workload, "1 process" if workload == "verify" else "1 sandbox at a time")])
        median = statistics.median(values)
        rows.append({"workload": workload, "variant": variant, "median_s": round(median, 3),
                     "speedup_vs_1": round(base / median, 2), "samples": verify_batch.batch_size[0]
                     if workload == "verify" else code_batch.batch_size[0], "repeats": args.repeats})
    print(f"{'workload':8} {'variant':24} {'median s':>9} {'speed-up vs 1':>14}")
    for r in rows:
        print(f"{r['workload']:8} {r['variant']:24} {r['median_s']:9.3f} {r['speedup_vs_1']:14.2f}")
    out = Path(__file__).with_suffix(".json")
    out.write_text(json.dumps({"cpus": os.cpu_count(), "workers": n, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
