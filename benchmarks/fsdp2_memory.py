"""Per-rank memory of parameters, gradients and AdamW state: FSDP2 on 2 processes vs 1 process.

    python benchmarks/fsdp2_memory.py [--hidden 256] [--layers 4]

Launches ``torchrun --nproc_per_node 1`` (strategy "auto") and ``--nproc_per_node 2``
(strategy "fsdp2", CPU, gloo) on a tiny Qwen2, runs one GRPO step with the Trainer (so
AdamW has its state), then one more forward/backward (so gradients exist), and counts on
each rank the bytes of the tensors it holds: local shards of DTensors (``to_local()``)
for parameters, gradients and the AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``).
These are exact byte counts, not allocator measurements. Not counted: the full copy of
the policy the generation engine keeps under a sharding strategy (a sharded policy
cannot generate rank by rank), activations, and the reference model (none here).
Prints a table and writes ``fsdp2_memory.json`` next to this file.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from rlflow import Batching, Hardware, Loop, Optim, RunDir


def tensor_bytes(t) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def worker(out: str, strategy: str, hidden: int, layers: int) -> None:
    import torch

    from rlflow import GRPO, FunctionReward, HFRollout, Policy, PPOLoss, PromptData, Trainer
    from rlflow.models.tiny import char_tokenizer, tiny_qwen2
    from rlflow.tasks.addition import AdditionTask

    tok = char_tokenizer()
    model = tiny_qwen2(len(tok), hidden_size=hidden, num_layers=layers, num_heads=4, num_kv_heads=2,
                       intermediate_size=4 * hidden, seed=0)
    train, _, _ = AdditionTask().splits()
    world = int(os.environ.get("WORLD_SIZE", 1))
    trainer = Trainer(
        policy=Policy(model, tok), rollout=HFRollout(n=1, do_sample=False, max_new_tokens=4),
        reward=FunctionReward(lambda s, g: float(s[:1].isdigit())), estimator=GRPO(), loss=PPOLoss(),
        optim=Optim(lr=1e-3),
        batching=Batching(batch_size=4),
        loop=Loop(max_steps=1, progress=False),
        run=RunDir(path=out, loggers=()),
        hardware=Hardware(devices=world, strategy=strategy),
    )
    trainer.fit(PromptData(train[:16], seed=0))
    module = trainer.policy.module
    batch = trainer.rollout(trainer.fabric.to_device(next(PromptData(train[:4], seed=0).loader(4, tok))))
    lp, _ = trainer.policy.log_probs(batch)
    trainer.fabric.backward(lp.sum())
    params = list(module.parameters())
    state = trainer.optimizer.state if hasattr(trainer.optimizer, "state") else trainer.optimizer.optimizer.state
    report = {
        "rank": trainer.fabric.global_rank, "world": world, "strategy": strategy,
        "num_parameters": sum(p.numel() for p in params),  # global numel (DTensor.numel is the full size)
        "param_bytes": sum(tensor_bytes(p) for p in params),
        "grad_bytes": sum(tensor_bytes(p.grad) for p in params if p.grad is not None),
        "optim_bytes": sum(tensor_bytes(v) for s in state.values() for v in s.values() if torch.is_tensor(v)),
    }
    Path(out, f"rank{report['rank']}.json").write_text(json.dumps(report))
    trainer.fabric.barrier()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc: int, strategy: str, args) -> list[dict]:
    out = tempfile.mkdtemp(prefix=f"fsdp2mem{nproc}_")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           __file__, "--worker", out, strategy, f"--hidden={args.hidden}", f"--layers={args.layers}"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if res.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{res.stderr[-4000:]}")
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(nproc)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--worker", nargs=2, metavar=("OUT", "STRATEGY"))
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], args.hidden, args.layers)
        return
    single = launch(1, "auto", args)[0]
    sharded = launch(2, "fsdp2", args)
    print(f"tiny Qwen2: hidden {args.hidden}, {args.layers} layers, {single['num_parameters']:,} parameters")
    titles = [f"fsdp2 rank {r['rank']}" for r in sharded]
    print(f"{'':<14}{'1 process':>12}" + "".join(f"{t:>14}{'ratio':>7}" for t in titles))
    rows = {}
    for key in ("param_bytes", "grad_bytes", "optim_bytes"):
        line = f"{key:<14}{single[key]:>12,}"
        rows[key] = [r[key] / single[key] for r in sharded]
        for r in sharded:
            line += f"{r[key]:>14,}{r[key] / single[key]:>7.3f}"
        print(line)
    out = Path(__file__).with_suffix(".json")
    out.write_text(json.dumps({"args": {"hidden": args.hidden, "layers": args.layers}, "single": single,
                               "fsdp2": sharded, "ratios": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
