"""Token balancing across ranks and Ulysses sequence parallelism, on 2 CPU processes (gloo).

    python benchmarks/parallelism.py [--repeats 3] [--seq 1024]

Part 1, balancing: a Trainer under DDP on 2 processes runs its actor update on a batch
where rank 0 holds long responses and rank 1 short ones (as when one rank's prompts
happen to be harder), with and without ``balance_tokens`` (what ``balance_batch=True``
does before the updates). Reported: the step time (the slower rank sets it: gradients
are all-reduced), tokens/s, and the activation bytes each rank saves for the backward
pass (exact, counted with ``torch.autograd.graph.saved_tensors_hooks``; the largest rank).

Part 2, Ulysses: one forward + backward of ``TokenLogProbs`` over a packed batch of long
sequences, on one process alone vs split over 2 processes (``sequence_parallel_size=2``).
Reported: time and activation bytes saved for the backward per rank.

Prints tables and writes ``parallelism.json`` next to this file.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from rlflow import Batching, Hardware, Loop, Optim, RunDir


class SavedBytes:
    """Bytes of the tensors autograd saves for the backward pass inside the ``with`` block."""

    def __init__(self):
        self.total = 0

    def __enter__(self):
        import torch

        def pack(t):
            self.total += t.numel() * t.element_size()
            return t

        self.ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self.ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self.ctx.__exit__(*exc)


def skewed_batch(rank: int, rows: int, long: int, short: int, vocab: int):
    import torch
    from tensordict import TensorDict

    from rlflow.data import keys as K

    g = torch.Generator().manual_seed(rank)
    P, R = 16, long
    length = long if rank == 0 else short
    mask = torch.zeros(rows, R, dtype=torch.long)
    mask[:, :length] = 1
    return TensorDict({
        K.PROMPT_IDS: torch.randint(1, vocab, (rows, P), generator=g), K.PROMPT_MASK: torch.ones(rows, P, dtype=torch.long),
        K.RESPONSE_IDS: torch.randint(1, vocab, (rows, R), generator=g), K.RESPONSE_MASK: mask,
        K.ADVANTAGES: torch.randn(rows, R, generator=g) * mask,
    }, batch_size=[rows])


def balance_worker(out: str, repeats: int) -> None:
    import torch
    import torch.distributed as dist

    from rlflow import GRPO, FunctionReward, HFRollout, Policy, PPOLoss, Trainer
    from rlflow.models.tiny import tiny_qwen2
    from rlflow.trainer.batching import row_tokens
    from rlflow.trainer.distributed import balance_tokens

    vocab = 512
    model = tiny_qwen2(vocab, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256, seed=0)
    trainer = Trainer(
        Policy(model, remove_padding=True), HFRollout(n=1), FunctionReward(lambda s, g: 0.0), GRPO(), PPOLoss(),
        optim=Optim(lr=1e-5), batching=Batching(batch_size=2, micro_batch_size=4), loop=Loop(progress=False),
        run=RunDir(loggers=()), hardware=Hardware(devices=2, strategy="ddp"),
    )
    rank = trainer.fabric.global_rank
    batch = skewed_batch(rank, rows=8, long=384, short=32, vocab=vocab)
    results = {}
    for name in ("unbalanced", "balanced", "unbalanced", "balanced") * repeats:
        dist.barrier()
        start = time.perf_counter()
        b = balance_tokens(batch, trainer.fabric, rank, 2)[0] if name == "balanced" else batch
        with SavedBytes() as saved:
            trainer.update_actor(b)
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        tokens = torch.tensor([int(row_tokens(b).sum()), saved.total])
        everyone = trainer.fabric.all_gather(tokens)
        entry = results.setdefault(name, {"seconds": [], "tokens_per_rank": everyone[:, 0].tolist(),
                                          "saved_mib_per_rank": (everyone[:, 1] / 2**20).tolist()})
        entry["seconds"].append(elapsed.item())
    if rank == 0:
        Path(out, "balance.json").write_text(json.dumps(results))
    dist.barrier()


def ulysses_worker(out: str, repeats: int, seq: int) -> None:
    import torch
    import torch.distributed as dist

    from rlflow.models.logprobs import TokenLogProbs
    from rlflow.models.tiny import tiny_qwen2

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    vocab, rows = 512, 2
    g = torch.Generator().manual_seed(0)
    prompt_ids, prompt_mask = torch.randint(1, vocab, (rows, 32), generator=g), torch.ones(rows, 32, dtype=torch.long)
    response_ids = torch.randint(1, vocab, (rows, seq), generator=g)

    def make():
        model = tiny_qwen2(vocab, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256,
                           seed=0)
        return TokenLogProbs(model, remove_padding=True)

    alone, split = make(), make()
    split.sequence_parallel(group)
    results = {}
    for name in ("one process", "2 ranks, sequence-parallel") * (repeats + 1):
        module = alone if name == "one process" else split
        if name == "one process" and rank != 0:
            continue  # rank 1 idles while rank 0 runs alone
        start = time.perf_counter()
        with SavedBytes() as saved:
            logps, _ = module(prompt_ids, prompt_mask, response_ids)
        logps.sum().backward()
        entry = results.setdefault(name, {"seconds": [], "saved_mib_per_rank": saved.total / 2**20})
        entry["seconds"].append(time.perf_counter() - start)
        if name != "one process":
            dist.barrier()
    if rank == 0:
        for entry in results.values():
            entry["seconds"] = entry["seconds"][1:]  # the first run warms up
        Path(out, "ulysses.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def launch(part: str, out: str, args) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}", __file__,
           "--worker", part, "--out", out, "--repeats", str(args.repeats), "--seq", str(args.seq)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seq", type=int, default=1024, help="response tokens per row in the Ulysses part")
    parser.add_argument("--worker", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.worker == "balance":
        return balance_worker(args.out, args.repeats)
    if args.worker == "ulysses":
        return ulysses_worker(args.out, args.repeats, args.seq)
    with tempfile.TemporaryDirectory() as out:
        launch("balance", out, args)
        launch("ulysses", out, args)
        balance = json.loads(Path(out, "balance.json").read_text())
        ulysses = json.loads(Path(out, "ulysses.json").read_text())
    base = min(balance["unbalanced"]["seconds"])
    print("| balancing (DDP, 2 ranks) | tokens per rank | step s (best) | ratio | saved MiB per rank |")
    print("| --- | --- | ---: | ---: | --- |")
    for name, r in balance.items():
        best = min(r["seconds"])
        print(f"| {name} | {r['tokens_per_rank']} | {best:.3f} | {base / best:.2f} | "
              f"{[round(x, 1) for x in r['saved_mib_per_rank']]} |")
    base = min(ulysses["one process"]["seconds"])
    print(f"\n| Ulysses ({args.seq + 32} tokens x 2 rows) | fwd+bwd s (best) | ratio | saved MiB per rank |")
    print("| --- | ---: | ---: | ---: |")
    for name, r in ulysses.items():
        best = min(r["seconds"])
        print(f"| {name} | {best:.3f} | {base / best:.2f} | {r['saved_mib_per_rank']:.1f} |")
    Path(__file__).with_suffix(".json").write_text(json.dumps({"balance": balance, "ulysses": ulysses}, indent=1))


if __name__ == "__main__":
    main()
