"""LoRA weights into an in-process vLLM engine: merged weights (rlflow's path) vs vLLM's own LoRA support.

    python benchmarks/lora_vllm.py                      # the default job's model shape and a 20M one, 2 rounds

For each model shape, two ways to keep a vLLM engine in step with a LoRA policy, each in its own process
(an in-process vLLM cannot be torn down cleanly), alternating for ``--rounds`` rounds:

- ``merged``: a plain engine started from the base model; every update sends ``W + s B A`` of the adapted
  layers (``rlflow.models.lora.merged_weight_buckets(only_adapted=True)``) through the worker's
  ``reload_weights`` and resets the prefix cache (what ``VLLMRollout`` does for a LoRA policy);
- ``adapter``: an engine started with ``enable_lora=True``; every update writes the adapter (PEFT's
  ``save_pretrained``, a few MB) and generation names it in a new ``LoRARequest``, which vLLM loads and
  applies with its LoRA kernels (``PunicaWrapperCPU`` on CPU).

Each "step" changes the adapter (as an optimizer step would), syncs it and generates ``--prompts`` prompts x
``--n`` samples x ``--new-tokens`` tokens (EOS ignored, so both generate the same number of tokens). Median of
the steps after the first (the first compiles kernels). Prints a table and writes ``lora_vllm.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {"default-job": dict(hidden=128, layers=2, heads=4, kv_heads=2, vocab=47),
          "20M": dict(hidden=512, layers=4, heads=8, kv_heads=4, vocab=8192)}


def worker(args, variant: str, shape: str, out: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from peft import LoraConfig, get_peft_model
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from rlflow.models import lora as L
    from rlflow.models.tiny import char_tokenizer, tiny_qwen2

    s = SHAPES[shape]
    tok = char_tokenizer()
    base = tiny_qwen2(s["vocab"], hidden_size=s["hidden"], num_layers=s["layers"], num_heads=s["heads"],
                      num_kv_heads=s["kv_heads"], intermediate_size=4 * s["hidden"], max_positions=128, seed=0)
    folder = Path(out, "base")
    base.save_pretrained(folder)
    model = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear"))
    options = dict(model=str(folder), dtype="float32", enforce_eager=True, skip_tokenizer_init=True, seed=0,
                   kv_cache_memory_bytes=256 * 2**20, logprobs_mode="raw_logprobs", generation_config="vllm")
    if variant == "adapter":
        options |= dict(enable_lora=True, max_lora_rank=args.rank, max_loras=1)
    llm = LLM(**options)
    prompts = [TokensPrompt(prompt_token_ids=tok(f"{a}+{b}=")["input_ids"]) for a, b in
               zip(range(11, 11 + args.prompts), range(40, 40 + args.prompts))]
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.new_tokens, logprobs=0, seed=0,
                            detokenize=False, ignore_eos=True)
    syncs, gens, nbytes = [], [], 0
    for step in range(args.steps):
        with torch.no_grad():  # an optimizer step's worth of change in the adapter
            for _, p in L.trainable_parameters(model):
                p.add_(torch.randn_like(p) * 1e-3)
        start = time.perf_counter()
        if variant == "merged":
            buckets = list(L.merged_weight_buckets(model, only_adapted=True))
            nbytes = sum(t.numel() * t.element_size() for b in buckets for _, t in b)
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter([p for b in buckets for p in b])})
            llm.reset_prefix_cache()
            request = None
        else:
            adapter = Path(out, f"adapter{step}")
            model.save_pretrained(adapter)
            nbytes = (adapter / "adapter_model.safetensors").stat().st_size
            request = LoRARequest(f"step{step}", step + 1, str(adapter))
        syncs.append(time.perf_counter() - start)
        start = time.perf_counter()
        llm.generate(prompts, params, lora_request=request, use_tqdm=False)
        gens.append(time.perf_counter() - start)
    Path(out, "report.json").write_text(json.dumps({
        "sync_s": statistics.median(syncs[1:]), "generate_s": statistics.median(gens[1:]), "sync_bytes": nbytes,
        "first_generate_s": gens[0], "parameters": sum(p.numel() for p in base.parameters())}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--worker", nargs=3, metavar=("VARIANT", "SHAPE", "OUT"))
    args = ap.parse_args()
    if args.worker:
        worker(args, *args.worker)
        return
    flags = [f"--rank={args.rank}", f"--prompts={args.prompts}", f"--n={args.n}", f"--new-tokens={args.new_tokens}",
             f"--steps={args.steps}"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    results: dict = {}
    for shape in args.shapes:
        runs: dict[str, list[dict]] = {"merged": [], "adapter": []}
        for _ in range(args.rounds):
            for variant in runs:
                out = tempfile.mkdtemp(prefix=f"lora_vllm_{variant}_")
                subprocess.run([sys.executable, __file__, *flags, "--worker", variant, shape, out], check=True,
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                runs[variant].append(json.loads(Path(out, "report.json").read_text()))
                shutil.rmtree(out, ignore_errors=True)
        results[shape] = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in runs.items()}
    print(f"{args.prompts} prompts x {args.n} samples x {args.new_tokens} tokens per step, LoRA rank {args.rank} on "
          f"every linear layer; medians of steps 2-{args.steps}, of {args.rounds} rounds")
    print(f"{'model':<13}{'engine':<9}{'sync bytes':>13}{'sync s':>9}{'generate s':>12}{'step s':>9}{'ratio':>7}")
    for shape, by_variant in results.items():
        merged_total = by_variant["merged"]["sync_s"] + by_variant["merged"]["generate_s"]
        for variant, r in by_variant.items():
            total = r["sync_s"] + r["generate_s"]
            print(f"{shape:<13}{variant:<9}{r['sync_bytes']:>13,.0f}{r['sync_s']:>9.3f}{r['generate_s']:>12.3f}"
                  f"{total:>9.3f}{total / merged_total:>7.2f}")
    out = Path(__file__).with_suffix(".json")
    out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "worker"}, "results": results},
                              indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
