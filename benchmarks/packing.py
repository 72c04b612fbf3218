"""Padding removal and token-budget micro-batches, side by side in one process.

    python benchmarks/packing.py [--rows 32] [--max-len 256] [--micro 8] [--repeats 1]

A tiny Qwen2 (hidden 256, 4 layers, vocab 4096) scores a batch whose responses have
widely varying lengths (uniform in 8..max-len, prompts 16..64 tokens;
``--rows 64 --max-len 512`` is the bigger case, slow on 2 CPU cores), in four setups:

- padded, micro-batches of ``--micro`` rows (the default path);
- packed (``remove_padding=True``), same micro-batches;
- padded, token budget (``micro_batches(..., max_tokens=...)``: similar lengths grouped);
- packed + token budget.

For each: the scoring pass (no grad) and a training step (forward + backward of the
sum of masked log-probs), tokens/s counted over real (prompt + response) tokens, and
peak memory as the increase of the process's peak RSS (``resource.getrusage`` maxrss,
Linux, KiB) during the pass, each setup in a fresh subprocess so peaks do not mask
each other. Prints a table and writes ``packing.json`` next to this file.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from tensordict import TensorDict

from rlflow.data import keys as K
from rlflow.models.logprobs import TokenLogProbs
from rlflow.models.tiny import tiny_qwen2
from rlflow.trainer.batching import micro_batches, row_tokens

SETUPS = {
    "padded": dict(remove_padding=False, budget=False),
    "packed": dict(remove_padding=True, budget=False),
    "padded+budget": dict(remove_padding=False, budget=True),
    "packed+budget": dict(remove_padding=True, budget=True),
}


def make_batch(rows: int, max_len: int, vocab: int, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    p_lens = torch.randint(16, 65, (rows,), generator=g)
    r_lens = torch.randint(8, max_len + 1, (rows,), generator=g)
    P, R = int(p_lens.max()), int(r_lens.max())
    pm = (torch.arange(P)[None] >= P - p_lens[:, None]).long()
    rm = (torch.arange(R)[None] < r_lens[:, None]).long()
    pi = torch.randint(3, vocab, (rows, P), generator=g) * pm
    ri = torch.randint(3, vocab, (rows, R), generator=g) * rm
    return TensorDict({K.PROMPT_IDS: pi, K.PROMPT_MASK: pm, K.RESPONSE_IDS: ri, K.RESPONSE_MASK: rm},
                      batch_size=[rows])


def maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_one(name: str, args) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model = tiny_qwen2(4096, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=1024,
                       max_positions=1024, seed=0)
    cfg = SETUPS[name]
    scorer = TokenLogProbs(model, remove_padding=cfg["remove_padding"])
    batch = make_batch(args.rows, args.max_len, 4096)
    real_tokens = int(row_tokens(batch).sum())
    padded_tokens = batch[K.PROMPT_IDS].numel() + batch[K.RESPONSE_IDS].numel()
    budget = args.micro * (int(row_tokens(batch).float().mean()) + 1) if cfg["budget"] else None
    parts = micro_batches(batch, None if budget else args.micro, budget)

    def call(mb):
        if cfg["remove_padding"]:
            return scorer(mb[K.PROMPT_IDS], mb[K.PROMPT_MASK], mb[K.RESPONSE_IDS], mb[K.RESPONSE_MASK])
        return scorer(mb[K.PROMPT_IDS], mb[K.PROMPT_MASK], mb[K.RESPONSE_IDS])

    out = {"setup": name, "micro_batches": len(parts), "real_tokens": real_tokens, "padded_tokens": padded_tokens}
    with torch.no_grad():  # warm-up (allocator, kernels) on the smallest micro-batch
        call(min(parts, key=lambda p: int(row_tokens(p).sum())))
    for phase in ("score", "train"):
        times = []
        base = maxrss_mib()
        for _ in range(args.repeats):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            for mb in parts:
                if phase == "score":
                    with torch.no_grad():
                        call(mb)
                else:
                    lp, _ = call(mb)
                    (lp * mb[K.RESPONSE_MASK]).sum().backward()
            times.append(time.perf_counter() - t0)
        out[f"{phase}_s"] = min(times)
        out[f"{phase}_tok_per_s"] = real_tokens / min(times)
        out[f"{phase}_peak_rss_delta_mib"] = maxrss_mib() - base
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--micro", type=int, default=8, help="rows per micro-batch (budget: micro x mean row tokens)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args)))
        return
    results = []
    for name in SETUPS:  # one subprocess per setup: peak RSS is per process
        cmd = [sys.executable, __file__, "--one", name] + [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                                                           if k != "one"]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True, env=os.environ.copy())
        results.append(json.loads(res.stdout.strip().splitlines()[-1]))
    base = results[0]
    print(f"batch: {args.rows} rows, responses 8..{args.max_len}, real tokens {base['real_tokens']}, "
          f"padded tokens {base['padded_tokens']}")
    head = f"{'setup':<15}{'micro':>6}{'score tok/s':>13}{'x':>6}{'peak MiB':>10}{'train tok/s':>13}{'x':>6}{'peak MiB':>10}"
    print(head)
    for r in results:
        print(f"{r['setup']:<15}{r['micro_batches']:>6}{r['score_tok_per_s']:>13.0f}"
              f"{r['score_tok_per_s'] / base['score_tok_per_s']:>6.2f}{r['score_peak_rss_delta_mib']:>10.0f}"
              f"{r['train_tok_per_s']:>13.0f}{r['train_tok_per_s'] / base['train_tok_per_s']:>6.2f}"
              f"{r['train_peak_rss_delta_mib']:>10.0f}")
    out = Path(__file__).with_suffix(".json")
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
