"""Per-rank memory: Megatron tensor parallel 2 vs FSDP2 on 2 processes (and 1 process), on the same model.

    python benchmarks/megatron_memory.py            # --hidden 256 --layers 4 --vocab 4096 --rows 8 --tokens 96

Three launches (CPU, gloo): 1 process ("auto"), FSDP2 on 2 processes, ``MegatronStrategy(tensor_parallel=2)``
on 2 processes. Each sets up the policy's log-prob module (``TokenLogProbs`` of a tiny Qwen2 built in code)
through Lightning Fabric, as the Trainer does, and trains one step on the same global batch (``rows``
sequences of ``tokens`` random tokens, half prompt, half response): FSDP2 ranks take half the rows each
(data parallel), the tensor-parallel ranks all of them (a model replica trains on one batch). Then, per
rank, exact byte counts (not allocator figures):

- parameters, gradients, AdamW state: the tensors this rank holds (DTensor local shards for FSDP2);
- activations: the bytes autograd saves for the backward pass during one more forward (``saved_tensors_hooks``,
  each storage counted once), i.e. the activation memory of one micro-batch.

Not counted: the generation engine's full copy of the policy (the same for both on every rank) and
transient buffers (FSDP2's all-gathered layers, tensor parallelism's all-reduce outputs). Prints a table and
writes ``megatron_memory.json`` next to this file.
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

STRATEGIES = {"auto": 1, "fsdp2": 2, "megatron_tp2": 2}


def local_bytes(t) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def saved_bytes(run) -> int:
    """Bytes of the distinct storages autograd saves for the backward while ``run()`` executes."""
    import torch

    seen: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(seen.values()), out


def worker(out: str, strategy: str, args) -> None:
    import lightning_fabric as L
    import torch

    from rlflow.models.logprobs import TokenLogProbs
    from rlflow.models.tiny import tiny_qwen2

    from rlflow.strategies import FSDP2, MegatronStrategy

    world = int(os.environ.get("WORLD_SIZE", 1))
    chosen = {"auto": "auto", "fsdp2": FSDP2(world), "megatron_tp2": MegatronStrategy(tensor_parallel=2)}[strategy]
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=chosen)
    fabric.launch()
    model = tiny_qwen2(args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=4, num_kv_heads=2,
                       intermediate_size=4 * args.hidden, max_positions=max(64, args.tokens), seed=0)
    module = fabric.setup_module(TokenLogProbs(model))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(module.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(0)
    half = args.tokens // 2
    prompt = torch.randint(3, args.vocab, (args.rows, half), generator=g)
    response = torch.randint(3, args.vocab, (args.rows, args.tokens - half), generator=g)
    rows = slice(None) if strategy != "fsdp2" else slice(fabric.global_rank, None, world)  # FSDP2: data parallel
    prompt, response = prompt[rows], response[rows]
    mask = torch.ones_like(prompt)

    def step():
        lp, ent = module(prompt, mask, response)
        return (lp.sum() + 0.01 * ent.sum()) / args.rows

    fabric.backward(step())
    fabric.clip_gradients(module, optimizer, max_norm=1.0)
    optimizer.step()
    params = [p for p in module.parameters()]
    state = optimizer.optimizer.state if hasattr(optimizer, "optimizer") else optimizer.state
    activations, loss = saved_bytes(step)
    report = {
        "rank": fabric.global_rank, "world": world, "strategy": strategy, "rows": int(prompt.shape[0]),
        "param_bytes": sum(local_bytes(p) for p in params),
        "grad_bytes": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optim_bytes": sum(local_bytes(v) for s in state.values() for v in s.values() if torch.is_tensor(v)),
        "activation_bytes": activations,
    }
    Path(out, f"rank{report['rank']}.json").write_text(json.dumps(report))
    fabric.barrier()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(strategy: str, args) -> list[dict]:
    nproc = STRATEGIES[strategy]
    out = tempfile.mkdtemp(prefix=f"megatronmem_{strategy}_")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           __file__, "--worker", out, strategy] + [f"--{k}={v}" for k, v in vars(args).items() if k != "worker"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if res.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{res.stderr[-4000:]}")
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(nproc)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--worker", nargs=2, metavar=("OUT", "STRATEGY"))
    args = ap.parse_args()
    if args.worker:
        out, strategy = args.worker
        worker(out, strategy, args)
        return
    runs = {name: launch(name, args) for name in STRATEGIES}
    base = runs["auto"][0]
    keys = ("param_bytes", "grad_bytes", "optim_bytes", "activation_bytes")
    print(f"tiny Qwen2: hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}; one step on "
          f"{args.rows} x {args.tokens} tokens")
    columns = [("1 process", base)] + [(f"{name} r{r['rank']}", r) for name in ("fsdp2", "megatron_tp2")
                                        for r in runs[name]]
    print(f"{'bytes':<18}" + "".join(f"{title:>22}" for title, _ in columns))
    ratios = {}
    for key in keys:
        cells = [f"{r[key]:>14,} ({r[key] / base[key]:.2f})" for _, r in columns]
        ratios[key] = {title: r[key] / base[key] for title, r in columns}
        print(f"{key:<18}" + "".join(f"{c:>22}" for c in cells))
    path = Path(__file__).with_suffix(".json")
    path.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "worker"}, "runs": runs,
                                "ratios": ratios}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
