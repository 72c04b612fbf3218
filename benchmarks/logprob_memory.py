"""Peak memory and time of log-probs + entropy + backward over a large vocabulary: naive vs rlflow's chunked heads.

    python benchmarks/logprob_memory.py                    # CPU: V = 151,936 (Qwen2.5), H = 128, 1,024 positions
    python benchmarks/logprob_memory.py --tokens 16384 --hidden 896   # the H200 case (CUDA)

Three ways to get the log-prob of the chosen token and the entropy at ``--tokens`` positions from hidden
states ``N x H`` and an LM head ``V x H``, then backpropagate ``sum(log_probs) + 0.1 sum(entropy)``:

- ``naive``: ``log_softmax(head(h).float())`` over all positions (a float32 ``N x V`` and its softmax kept for
  the backward pass): what a hand-written loop does.
- ``checkpointed``: rlflow's previous default, 4,096 positions per chunk, each chunk's head + softmax under
  activation checkpointing (the path rlflow still takes for heads that are not a plain ``nn.Linear``).
- ``fused``: rlflow's default now: ``ChunkedHeadLogProbs`` with chunks of at most 256 MiB of float32 logits and a
  hand-written backward that recomputes each chunk's logits in place.

Peak memory is measured per variant in a fresh forked process: on CUDA the growth of
``torch.cuda.max_memory_allocated``, on CPU the growth of the process's peak RSS (``ru_maxrss``), both from just
before the forward. The ``N x V`` float32 size is printed for scale. Writes benchmarks/logprob_memory.json
(``--json`` to choose another path).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch
from torch import nn

from rlflow.models.logprobs import auto_chunk_tokens, head_log_probs

VARIANTS = ("naive", "checkpointed", "fused")


def naive(hidden, ids, head):
    logp = torch.log_softmax(head(hidden).float(), -1)
    return logp.gather(-1, ids[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def run_variant(variant: str, tokens: int, hidden_size: int, vocab: int, device: str, dtype: torch.dtype) -> dict:
    """One forward + backward; returns peak memory growth (MiB) and seconds."""
    torch.manual_seed(0)
    head = nn.Linear(hidden_size, vocab, bias=False, device=device)
    hidden = torch.randn(tokens, hidden_size, device=device, requires_grad=True)
    ids = torch.randint(vocab, (tokens,), device=device)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.max_memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    with torch.autocast(device.split(":")[0], dtype=dtype, enabled=dtype != torch.float32):
        if variant == "naive":
            lp, ent = naive(hidden, ids, head)
        elif variant == "checkpointed":  # a wrapped head is not a plain nn.Linear: the checkpointed chunk path
            lp, ent = head_log_probs(hidden, ids, nn.Sequential(head), chunk_tokens=4096)
        else:
            lp, ent = head_log_probs(hidden, ids, head)
    (lp.sum() + 0.1 * ent.sum()).backward()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"peak_mib": peak / 2**20, "seconds": time.perf_counter() - start}


def in_child(fn, *args) -> dict:
    """``fn(*args)`` in a forked process (a fresh peak; CUDA must not be initialised in the parent)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            payload = json.dumps(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - reported by the parent
            payload = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
        os.write(write, payload.encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks))


def measure(tokens: int, hidden_size: int, vocab: int, device: str, dtype: torch.dtype = torch.float32,
            variants=VARIANTS, fork: bool = True) -> dict:
    """``{variant: {"peak_mib", "seconds"}}`` plus the sizes, each variant measured alone."""
    out = {"tokens": tokens, "hidden": hidden_size, "vocab": vocab, "device": device, "dtype": str(dtype),
           "full_logits_float32_mib": tokens * vocab * 4 / 2**20, "fused_chunk_tokens": auto_chunk_tokens(vocab)}
    for v in variants:
        out[v] = in_child(run_variant, v, tokens, hidden_size, vocab, device, dtype) if fork else \
            run_variant(v, tokens, hidden_size, vocab, device, dtype)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bf16", action="store_true", help="under bf16 autocast")
    p.add_argument("--json", default=str(Path(__file__).with_suffix(".json")))
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    result = measure(args.tokens, args.hidden, args.vocab, args.device, torch.bfloat16 if args.bf16 else torch.float32)
    print(f"N={args.tokens} positions, H={args.hidden}, V={args.vocab} on {args.device}: one N x V float32 is "
          f"{result['full_logits_float32_mib']:.0f} MiB; fused chunks of {result['fused_chunk_tokens']} positions")
    print(f"{'variant':14} {'peak MiB':>10} {'vs naive':>9} {'seconds':>9} {'vs naive':>9}")
    for v in VARIANTS:
        r, base = result[v], result["naive"]
        if "error" in r:
            print(f"{v:14} {r['error']}")
            continue
        print(f"{v:14} {r['peak_mib']:10.0f} {r['peak_mib'] / base['peak_mib']:9.3f} {r['seconds']:9.2f} "
              f"{r['seconds'] / base['seconds']:9.2f}")
    result["load_average"] = os.getloadavg()
    Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
