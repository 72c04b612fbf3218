"""Generation engines side by side: transformers' generate (HFRollout) vs in-process vLLM (VLLMRollout).

    python benchmarks/generation.py [--models tiny medium] [--rounds 3] [--steps 6]

Both engines sample the same prompts from the same model (float32, temperature 1). For each model:

1. generation alone: tokens/s of each engine over ``--rounds`` alternating rounds (the first call of each
   engine is a warm-up and is not counted; vLLM's start-up is reported separately);
2. a full GRPO step through the Trainer (rollout, reward, update, weight sync) with each engine: the median
   of each phase over ``--steps`` steps (after one warm-up step).

Models: ``tiny`` is the default job's (0.5M parameters, vocabulary 47, 32 prompts x 8 samples x 4 new tokens,
its real prompts); ``medium`` is a Qwen2 of ~25M parameters (hidden 512, 8 layers, 8 heads, vocabulary 4096,
16 prompts x 4 samples x 64 new tokens, random prompts of 16-32 tokens). vLLM runs eager (on CPU its compiled
mode costs tens of seconds of start-up). Writes benchmarks/generation.json. Needs vLLM (see
docs/rollout-engines.md); on a CUDA machine both engines run on the GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from rlflow import FunctionReward, Policy, PPOLoss, PromptData, Trainer, Batching, Hardware, Loop, Optim, RunDir
from rlflow.algorithms import GRPO
from rlflow.data import keys as K
from rlflow.data.prompts import collate, load_rows
from rlflow.models.tiny import char_tokenizer, tiny_qwen2
from rlflow.rollout import HFRollout, VLLMRollout
from rlflow.tasks.addition import AdditionTask

MODELS = {
    "tiny": dict(shape=dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512,
                            max_positions=64), vocab=None, prompts=32, n=8, new_tokens=4),
    "medium": dict(shape=dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1408,
                              max_positions=128), vocab=4096, prompts=16, n=4, new_tokens=64),
}


def build(name: str):
    """(model, tokenizer, prompt rows) of a benchmark model. The medium model's tokenizer has one character per
    token over ``vocab - 3`` code points (so every sampled id decodes), and its prompts are random strings."""
    spec = MODELS[name]
    tok = char_tokenizer() if spec["vocab"] is None else char_tokenizer("".join(
        chr(0x4E00 + i) for i in range(spec["vocab"] - 3)))
    model = tiny_qwen2(len(tok), seed=0, **spec["shape"])
    if spec["vocab"] is None:
        rows = AdditionTask().splits()[0][: 4 * spec["prompts"]]
    else:
        g = torch.Generator().manual_seed(0)
        rows = [{"prompt": "".join(chr(0x4E00 + int(i)) for i in torch.randint(0, spec["vocab"] - 3, (int(k),), generator=g)),
                 "ground_truth": "0", "data_source": "bench"}
                for k in torch.randint(16, 33, (4 * spec["prompts"],), generator=g)]
    return model, tok, rows


def engines(spec: dict, device: str):
    opts = dict(n=spec["n"], temperature=1.0, max_new_tokens=spec["new_tokens"])
    return {"hf": HFRollout(**opts),
            "vllm": VLLMRollout(**opts, dtype="float32", enforce_eager=device == "cpu",
                                max_model_len=spec["shape"]["max_positions"])}


def generation(name: str, rounds: int, device: str) -> dict:
    spec = MODELS[name]
    model, tok, rows = build(name)
    model.to(device)
    batch = collate(load_rows(rows[: spec["prompts"]])[0], tok).to(device)
    rollouts, out = engines(spec, device), {}
    start = time.perf_counter()
    rollouts["vllm"].bind(model, tok)
    out["vllm_start_s"] = time.perf_counter() - start
    rollouts["hf"].bind(model, tok)
    times = {k: [] for k in rollouts}
    tokens = {k: [] for k in rollouts}
    for r in range(rounds + 1):
        for key, rollout in rollouts.items():
            t0 = time.perf_counter()
            result = rollout(batch)
            elapsed = time.perf_counter() - t0
            if r:  # round 0 warms up (vLLM compiles its log-prob op on the first call)
                times[key].append(elapsed)
                tokens[key].append(int(result[K.RESPONSE_MASK].sum()))
    for key in rollouts:
        out[f"{key}_tokens_per_s"] = statistics.median(t / s for t, s in zip(tokens[key], times[key]))
        out[f"{key}_s_per_call"] = statistics.median(times[key])
    out["ratio_vllm_over_hf"] = out["vllm_tokens_per_s"] / out["hf_tokens_per_s"]
    return out


def grpo_steps(name: str, steps: int, device: str) -> dict:
    """Median seconds per phase of a GRPO step with each engine (a reward that varies, so updates happen)."""
    spec = MODELS[name]
    out = {}
    for key in ("hf", "vllm"):
        model, tok, rows = build(name)
        rollout = engines(spec, device)[key]
        reward = FunctionReward(lambda solution_str, ground_truth: float(len(set(solution_str)) % 2))
        trainer = Trainer(
            policy=Policy(model, tok), rollout=rollout, reward=reward, estimator=GRPO(), loss=PPOLoss(),
            optim=Optim(lr=1e-4), batching=Batching(batch_size=spec["prompts"]),
            loop=Loop(max_steps=steps + 1, progress=False),
            run=RunDir(path=f"runs/bench-generation-{name}-{key}", loggers=()),
            hardware=Hardware(accelerator="cuda" if device == "cuda" else "cpu"),
        )
        history = trainer.fit(PromptData(rows, seed=0))[1:]  # step 1 warms up
        phases = sorted({k for m in history for k in m if k.startswith("timing_s/")})
        out[key] = {p.removeprefix("timing_s/"): statistics.median(m.get(p, 0.0) for m in history) for p in phases}
    out["step_ratio_vllm_over_hf"] = out["vllm"]["step"] / out["hf"]["step"]
    out["gen_ratio_vllm_over_hf"] = out["vllm"]["gen"] / out["hf"]["gen"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=3, help="timed generation rounds per engine")
    parser.add_argument("--steps", type=int, default=6, help="timed GRPO steps per engine")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {"device": device, "torch_threads": torch.get_num_threads()}
    for name in args.models:
        model, _, _ = build(name)
        results[name] = {"parameters": sum(p.numel() for p in model.parameters()), **MODELS[name]}
        results[name]["generation"] = generation(name, args.rounds, device)
        results[name]["grpo_step_s"] = grpo_steps(name, args.steps, device)
        g, s = results[name]["generation"], results[name]["grpo_step_s"]
        print(f"{name} ({results[name]['parameters'] / 1e6:.1f}M params, {device}): tokens/s HF {g['hf_tokens_per_s']:.0f}"
              f"  vLLM {g['vllm_tokens_per_s']:.0f}  (vLLM/HF {g['ratio_vllm_over_hf']:.2f}; vLLM start {g['vllm_start_s']:.1f} s)")
        for key in ("hf", "vllm"):
            print(f"  GRPO step with {key:4s}: " + "  ".join(f"{p} {v:.3f}" for p, v in s[key].items()))
        print(f"  step vLLM/HF {s['step_ratio_vllm_over_hf']:.2f}, generation phase vLLM/HF {s['gen_ratio_vllm_over_hf']:.2f}")
    path = Path(__file__).with_suffix(".json")
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
