"""CPU threads for single-process runs: one thread against torch's default (one per physical core).

    python benchmarks/threads.py                 # the default job's model (0.5M) and a 16M one
    python benchmarks/threads.py --busy 1        # with one extra process spinning on a core meanwhile

For each model, times a training step (forward + backward of 64 sequences of 32 tokens) and a
generation step (HF ``generate``, 64 prompts, 4 new tokens), at 1 thread and at torch's default,
side by side in one run, and prints what ``rlflow.threads.choose_threads`` picks on this machine
now. Each case runs in a fresh process with ``OMP_NUM_THREADS`` set before torch starts (the thread
pool cannot shrink reliably once started). Writes ``benchmarks/threads.json``. Medians of
``--repeats``; the figures depend on what else the machine runs (the load average is recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODELS = {"default job (0.5M)": (128, 2), "16M": (512, 4)}

CASE = r"""
import json, statistics, sys, time
import torch
from rlflow.models.tiny import tiny_qwen2
hidden, layers, repeats = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
model = tiny_qwen2(100, hidden_size=hidden, num_layers=layers, intermediate_size=4 * hidden, seed=0)
ids = torch.randint(3, 100, (64, 32), generator=torch.Generator().manual_seed(0))
def train():
    model(input_ids=ids, labels=ids).loss.backward()
@torch.no_grad()
def generate():
    model.generate(input_ids=ids[:, :8], attention_mask=torch.ones_like(ids[:, :8]), max_new_tokens=4,
                   do_sample=True, pad_token_id=0)
out = {"threads": torch.get_num_threads(), "params": sum(p.numel() for p in model.parameters())}
for name, fn in (("train_ms", train), ("generate_ms", generate)):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter(); fn(); times.append((time.perf_counter() - t0) * 1e3)
    out[name] = statistics.median(times)
print(json.dumps(out))
"""


def run_case(hidden: int, layers: int, threads: int | None, repeats: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    if threads is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    out = subprocess.run([sys.executable, "-c", CASE, str(hidden), str(layers), str(repeats)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--busy", type=int, default=0, help="extra processes spinning meanwhile (a shared machine)")
    parser.add_argument("--out", default=str(Path(__file__).with_name("threads.json")))
    args = parser.parse_args()
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        time.sleep(1 if spinners else 0)
        from rlflow.threads import choose_threads, physical_cores

        results = {"physical_cores": physical_cores(), "busy": args.busy,
                   "load_average_1min": os.getloadavg()[0], "cases": {}}
        for name, (hidden, layers) in MODELS.items():
            one = run_case(hidden, layers, 1, args.repeats)
            default = run_case(hidden, layers, None, args.repeats)
            chosen = choose_threads(one["params"], log=None)
            results["cases"][name] = {
                "params": one["params"], "threads_default": default["threads"], "rlflow_chooses": chosen,
                "train_ms": {"1 thread": round(one["train_ms"], 1), "default": round(default["train_ms"], 1)},
                "generate_ms": {"1 thread": round(one["generate_ms"], 1), "default": round(default["generate_ms"], 1)},
                "default_over_1_thread": {k: round(default[k] / one[k], 2) for k in ("train_ms", "generate_ms")},
            }
            print(f"{name:>20}: train {one['train_ms']:8.1f} ms (1 thread) vs {default['train_ms']:8.1f} ms "
                  f"({default['threads']} threads) = x{default['train_ms'] / one['train_ms']:.2f}; generate "
                  f"{one['generate_ms']:7.1f} vs {default['generate_ms']:7.1f} ms = "
                  f"x{default['generate_ms'] / one['generate_ms']:.2f}; rlflow picks {chosen}", flush=True)
    finally:
        for p in spinners:
            p.kill()
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
