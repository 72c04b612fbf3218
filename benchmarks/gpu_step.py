"""One prepared GPU measurement of a GRPO step on a 0.5B-shaped model (a few minutes on one H200).

    python benchmarks/gpu_step.py              # CUDA: Qwen2-0.5B shape (494M parameters, V = 151,936), bf16-mixed
    python benchmarks/gpu_step.py --compile    # also time generation with a static KV cache + compiled decoding
    python benchmarks/gpu_step.py --tiny       # any machine (CPU): the same code on a tiny config, in seconds

The model is Qwen2-0.5B's shape built in code with random weights (nothing is downloaded), with a word-level
tokenizer over its vocabulary; prompts are 16-64 random tokens. The Trainer runs GRPO with HF generation
(``HFRollout``), ``precision="bf16-mixed"``, padding removal and a token budget per micro-batch (token balancing
across ranks is on; with one GPU it has nothing to move): 32 prompts x 8 samples x at most 128 new tokens
(random weights rarely stop early, so responses are about full length: an upper bound on generation work).

Reported (medians over the steps after a warm-up step):

- generation tokens/s (generated tokens / ``timing_s/gen``), training tokens/s (prompt + response tokens /
  ``timing_s/update_actor``), step seconds and the phases;
- MFU: training FLOPs ``6 x (non-embedding parameters x tokens + hidden x vocab x response tokens)`` (the LM head
  runs on response positions only; attention's quadratic term is left out: sequences are short) over the update
  time and the GPU's peak dense bf16 FLOP/s (``--peak-tflops``; 989 for H100/H200 SXM when the name says so); the
  same for generation with ``2 x`` instead of ``6 x`` (decoding is memory-bound: a small number is expected);
- peak GPU memory (``torch.cuda.max_memory_allocated``) over the steps;
- a bf16 check: the dtype of the LM head's output during generation (a forward hook), which must be bfloat16;
- log-probs + entropy + backward at the 150k vocabulary over 16,384 positions: naive vs rlflow's chunked head,
  peak memory and time (``benchmarks/logprob_memory.py``);
- with ``--compile``: generation alone, dynamic cache vs static cache + ``torch.compile`` decoding
  (``HFRollout(cache_implementation="static", compile=True)``), tokens/s; a failure is reported, not raised.

Writes benchmarks/gpu_step.json (``--json`` to choose another path).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # the sibling benchmark module
from logprob_memory import measure as logprob_memory  # noqa: E402

from rlflow import GRPO, FunctionReward, HFRollout, Policy, PPOLoss, PromptData, Trainer  # noqa: E402
from rlflow.data import keys as K  # noqa: E402
from rlflow import Batching, Hardware, Loop, Optim, RunDir

SHAPES = {  # Qwen2-0.5B; a tiny one for CPUs and tests
    "0.5b": dict(vocab=151_936, hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864),
    "tiny": dict(vocab=4096, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128),
}
RUNS = {
    "0.5b": dict(prompts=32, n=8, new_tokens=128, steps=4, budget=16384, logprob_tokens=16384),
    "tiny": dict(prompts=4, n=4, new_tokens=8, steps=3, budget=256, logprob_tokens=256),
}
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def word_tokenizer(vocab: int):
    """Word-level tokenizer over ``vocab`` ids (``w3`` ... ``w{vocab-1}``, plus pad/bos/eos), built in code."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<bos>": 1, "<eos>": 2} | {f"w{i}": i for i in range(3, vocab)}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   padding_side="left")


def build_model(shape: dict, max_positions: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=shape["vocab"], hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
                         num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                         intermediate_size=shape["intermediate"], max_position_embeddings=max_positions,
                         tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def even_tokens(solution_str: str, ground_truth: str) -> float:
    """Fraction of response words with an even id: cheap, and varies between samples."""
    words = solution_str.split()
    return sum(w[1:].isdigit() and int(w[1:]) % 2 == 0 for w in words) / max(len(words), 1)


def prompt_rows(count: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": " ".join(f"w{rng.randrange(3, vocab)}" for _ in range(rng.randint(16, 64))),
             "ground_truth": "", "data_source": "random"} for _ in range(count)]


def train_steps(shape: dict, run: dict, device: str, run_dir: str) -> dict:
    tokenizer = word_tokenizer(shape["vocab"])
    model = build_model(shape, max_positions=64 + run["new_tokens"] + 8)
    params = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    policy = Policy(model, tokenizer, temperature=1.0, remove_padding=True)
    generated_dtypes = []
    policy.model.lm_head.register_forward_hook(
        lambda m, i, out: None if torch.is_grad_enabled() else generated_dtypes.append(str(out.dtype)))
    trainer = Trainer(
        policy=policy, rollout=HFRollout(n=run["n"], temperature=1.0, max_new_tokens=run["new_tokens"]),
        reward=FunctionReward(even_tokens), estimator=GRPO(), loss=PPOLoss(clip_ratio=0.2), optim=Optim(lr=1e-6),
        batching=Batching(batch_size=run["prompts"], max_tokens_per_micro_batch=run["budget"], balance_batch=True),
        loop=Loop(max_steps=run["steps"], progress=False), run=RunDir(path=run_dir, loggers=()),
        hardware=Hardware(accelerator="cuda" if device == "cuda" else "cpu", precision="bf16-mixed"),
    )
    data = PromptData(prompt_rows(run["prompts"] * run["steps"], shape["vocab"]), seed=0)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    history = trainer.fit(data)[1:]  # the first step warms up (allocator, kernels)
    med = {k: statistics.median(m[k] for m in history) for k in (
        "timing_s/gen", "timing_s/update_actor", "timing_s/step", "timing_s/reward", "perf/total_num_tokens",
        "response_length/mean", "prompt_length/mean")}
    batch = run["prompts"] * run["n"]
    gen_tokens = med["response_length/mean"] * batch
    train_tokens = med["perf/total_num_tokens"]
    non_embedding = params - embedding
    train_flops = 6 * (non_embedding * train_tokens + shape["hidden"] * shape["vocab"] * gen_tokens)
    gen_flops = 2 * (non_embedding + shape["hidden"] * shape["vocab"]) * gen_tokens
    out = {"parameters": params, "non_embedding_parameters": non_embedding, "samples_per_step": batch,
           "median": med, "generated_tokens_per_step": gen_tokens, "trained_tokens_per_step": train_tokens,
           "generation_tokens_per_s": gen_tokens / med["timing_s/gen"],
           "training_tokens_per_s": train_tokens / med["timing_s/update_actor"],
           "train_tflops_per_s": train_flops / med["timing_s/update_actor"] / 1e12,
           "generation_tflops_per_s": gen_flops / med["timing_s/gen"] / 1e12,
           "generation_lm_head_dtypes": sorted(set(generated_dtypes)),
           "bf16_generation": set(generated_dtypes) == {"torch.bfloat16"}}
    if device == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def compiled_generation(shape: dict, run: dict, device: str) -> dict:
    """Generation alone: the default dynamic cache vs a static cache with compiled decoding (bf16 weights)."""
    tokenizer = word_tokenizer(shape["vocab"])
    model = build_model(shape, max_positions=64 + run["new_tokens"] + 8).to(device, torch.bfloat16)
    data = PromptData(prompt_rows(run["prompts"], shape["vocab"], seed=1), seed=0)
    prompts = data.collate(data.train, tokenizer).to(device)
    out = {}
    for name, options in (("dynamic cache", {}), ("static cache + compile", dict(cache_implementation="static",
                                                                                 compile=True))):
        try:
            rollout = HFRollout(n=run["n"], max_new_tokens=run["new_tokens"], **options)
            rollout.bind(model, tokenizer)
            times, tokens = [], 0
            for i in range(3):  # the first call compiles
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                sampled = rollout(prompts)
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                tokens = int(sampled[K.RESPONSE_MASK].sum())
            out[name] = {"first_call_s": times[0], "tokens_per_s": tokens / statistics.median(times[1:])}
        except Exception as exc:  # noqa: BLE001 - reported: compiled decoding is optional
            out[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="the tiny shape (default without CUDA)")
    p.add_argument("--compile", action="store_true", help="also time static cache + compiled decoding")
    p.add_argument("--peak-tflops", type=float, help="the GPU's peak dense bf16 TFLOP/s (for MFU)")
    p.add_argument("--json", default=str(Path(__file__).with_suffix(".json")))
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = "tiny" if args.tiny or device == "cpu" else "0.5b"
    shape, run = SHAPES[size], RUNS[size]
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    peak = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    report = {"device": name, "shape": size, "model": shape, "run": run, "torch": torch.__version__}
    # log-probs first: on CPU each variant runs in a forked child, which needs CUDA untouched in this process
    report["logprobs_150k" if size == "0.5b" else "logprobs"] = logprob_memory(
        run["logprob_tokens"], shape["hidden"], shape["vocab"], device, torch.bfloat16, fork=device == "cpu")
    with tempfile.TemporaryDirectory(prefix="rlflow-gpu-step-") as tmp:
        report["grpo_step"] = step = train_steps(shape, run, device, tmp)
    if peak:
        step["mfu_train"] = step["train_tflops_per_s"] / peak
        step["mfu_generation"] = step["generation_tflops_per_s"] / peak
    if args.compile:
        report["generation_compile"] = compiled_generation(shape, run, device)
    report["load_average"] = os.getloadavg()
    Path(args.json).write_text(json.dumps(report, indent=2))
    m = step["median"]
    print(f"{name}, {size} ({step['parameters'] / 1e6:.1f}M parameters): step {m['timing_s/step']:.2f} s "
          f"(gen {m['timing_s/gen']:.2f}, update {m['timing_s/update_actor']:.2f}, reward {m['timing_s/reward']:.3f})")
    print(f"generation {step['generation_tokens_per_s']:.0f} tokens/s, training {step['training_tokens_per_s']:.0f} "
          f"tokens/s, MFU train {step.get('mfu_train', float('nan')):.3f} / generation "
          f"{step.get('mfu_generation', float('nan')):.4f}, peak memory {step.get('peak_memory_gib', float('nan')):.1f} GiB")
    print(f"generation ran in {step['generation_lm_head_dtypes']} (bf16: {step['bf16_generation']})")
    lp = report.get("logprobs_150k") or report["logprobs"]
    print(f"log-probs at V={lp['vocab']}, {lp['tokens']} positions: " + ", ".join(
        f"{v} {lp[v]['peak_mib']:.0f} MiB / {lp[v]['seconds']:.3f} s" for v in ("naive", "checkpointed", "fused")
        if "peak_mib" in lp[v]))
    for variant, r in report.get("generation_compile", {}).items():
        print(f"generation, {variant}: {r}")
    return report


if __name__ == "__main__":
    main()
