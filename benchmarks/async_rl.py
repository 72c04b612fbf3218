"""Synchronous vs one-step-off (asynchronous) RL steps, side by side in one run.

    python benchmarks/async_rl.py [--models tiny small] [--rounds 3] [--steps 4] [--engine hf|vllm]

Modes, each a fresh Trainer from the same initial weights for every round (rounds interleave the modes, in a
rotating order, so that machine load hits them alike):

- ``sync``: the rollout in the trainer's process, GRPO + PPO clip (the default job's shape);
- ``sync+IS``: the same with truncated importance sampling (``Chain(TruncatedIS(), GRPO())``,
  ``PPOLoss(is_weights=True)``): the correction costs one more forward pass per step (the old log-probs);
- ``async0``: ``AsyncRollout(max_staleness=0)``: the engine in its own process, nothing generated ahead (the
  cost of the process boundary: prompts and completions through a pipe, weights through shared memory);
- ``async1``: ``AsyncRollout(max_staleness=1)``, one-step-off, with truncated IS (the asynchronous mode's default).

Per mode: the median wall time per step (the first step of each run, which fills the pipeline, is left out)
and the medians of the Trainer's phases. The ideal one-step-off step is ``max(G, S - G)`` with ``S`` the
``sync+IS`` step and ``G`` the engine's generation time when nothing runs beside it (``async/engine_gen_s`` of
``async0``): generation hidden behind everything else, each side on a core of its own. On a machine whose
cores are all busy, generation and training compete for them and the overlap gains less.

Models: ``tiny`` is the default job's (0.5M parameters, 32 prompts x 8 samples x 4 new tokens; generation is
a small part of its step); ``small`` a Qwen2 of ~5M parameters (hidden 256, 4 layers, vocabulary 4096, 8 prompts
x 4 samples x 32 new tokens, random prompts of 16-32 tokens; generation a larger part of the step). ``--engine vllm`` generates with
``VLLMRollout`` (vLLM in the child process for the async modes; eager, float32). Writes
benchmarks/async_rl.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from pathlib import Path

import torch

from rlflow import FunctionReward, Policy, PPOLoss, PromptData, Trainer, Batching, Loop, Optim, RunDir
from rlflow.algorithms import GRPO, TruncatedIS
from rlflow.models.tiny import char_tokenizer, tiny_qwen2
from rlflow.module import Chain
from rlflow.rollout import AsyncRollout, HFRollout
from rlflow.tasks.addition import AdditionTask, exact_match, warm_started_model

MODES = ("sync", "sync+IS", "async0", "async1")
MODELS = {
    "tiny": dict(prompts=32, n=8, new_tokens=4, lr=2e-4, max_len=64),
    "small": dict(shape=dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=704,
                             max_positions=128), vocab=4096, prompts=8, n=4, new_tokens=32, lr=1e-5, max_len=128),
}
PHASES = ("timing_s/gen", "timing_s/gen_wait", "timing_s/train_wait", "async/engine_gen_s", "timing_s/reward",
          "timing_s/old_log_prob", "timing_s/update_actor", "timing_s/update_weights")


def length_reward(solution_str: str, ground_truth: str) -> float:
    return len(solution_str) / 64


def model_and_data(name: str):
    """(model, tokenizer, rows, reward function) of a benchmark model."""
    spec = MODELS[name]
    if name == "tiny":
        model, tok = warm_started_model(AdditionTask(), 0)
        return model, tok, AdditionTask().splits()[0], exact_match
    tok = char_tokenizer("".join(chr(0x4E00 + i) for i in range(spec["vocab"] - 3)))
    model = tiny_qwen2(len(tok), seed=0, **spec["shape"])
    g = torch.Generator().manual_seed(0)
    rows = [{"prompt": "".join(chr(0x4E00 + int(i)) for i in torch.randint(0, spec["vocab"] - 3, (int(k),), generator=g)),
             "ground_truth": "0", "data_source": "bench"}
            for k in torch.randint(16, 33, (16 * spec["prompts"],), generator=g)]
    return model, tok, rows, length_reward


def sampler(engine: str, spec: dict):
    opts = dict(n=spec["n"], temperature=1.0, max_new_tokens=spec["new_tokens"])
    if engine == "vllm":
        from rlflow.rollout import VLLMRollout

        return VLLMRollout(**opts, dtype="float32", enforce_eager=True, max_model_len=spec["max_len"])
    return HFRollout(**opts)


class StepClock:
    """Wall-clock time of every step, as the loop sees it (rollout to checkpoint)."""

    def __init__(self):
        self.last, self.times = None, []

    def on_fit_start(self, trainer):
        self.last = time.perf_counter()

    def on_step_end(self, trainer, step, metrics):
        now = time.perf_counter()
        self.times.append(now - self.last)
        self.last = now


def run(mode: str, name: str, engine: str, steps: int, base, tok, rows, reward, tmp: Path) -> dict:
    spec = MODELS[name]
    rollout = sampler(engine, spec)
    corrected = mode != "sync"
    if mode.startswith("async"):
        rollout = AsyncRollout(rollout, max_staleness=int(mode[-1]))
    clock = StepClock()
    trainer = Trainer(
        policy=Policy(copy.deepcopy(base), tok), rollout=rollout, reward=FunctionReward(reward),
        estimator=Chain(TruncatedIS(), GRPO()) if corrected else GRPO(),
        loss=PPOLoss(clip_ratio=0.2, is_weights=corrected), callbacks=[clock],
        optim=Optim(lr=spec["lr"], weight_decay=0.0), batching=Batching(batch_size=spec["prompts"]),
        loop=Loop(max_steps=steps + 1, progress=False), run=RunDir(path=tmp / mode, loggers=()),
    )
    try:
        history = trainer.fit(PromptData(rows, seed=0))
    finally:
        if hasattr(rollout, "close"):
            rollout.close()
    return {"step_s": clock.times[1:], **{k: [m[k] for m in history[1:] if k in m] for k in PHASES}}


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small"], choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="measured steps per run (after one that fills the pipeline)")
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    parser.add_argument("--out", default=str(Path(__file__).with_name("async_rl.json")))
    args = parser.parse_args()
    torch.manual_seed(0)
    tmp = Path(__import__("tempfile").mkdtemp(prefix="rlflow-async-bench-"))
    report = {"engine": args.engine, "rounds": args.rounds, "steps": args.steps, "threads": torch.get_num_threads(),
              "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg(), "models": {}}
    for name in args.models:
        base, tok, rows, reward = model_and_data(name)
        results = {m: {} for m in MODES}
        rounds = {m: [] for m in MODES}  # each round's median step: ratios within a round share its load
        for r in range(args.rounds):
            order = MODES[r % len(MODES):] + MODES[: r % len(MODES)]  # rotate: no mode always runs first
            for mode in order:
                out = run(mode, name, args.engine, args.steps, base, tok, rows, reward, tmp / f"{name}{r}")
                for k, v in out.items():
                    results[mode].setdefault(k, []).extend(v)
                rounds[mode].append(median(out["step_s"]))
                print(f"[{name}] round {r + 1} {mode:8s} step {median(out['step_s']):.3f} s", flush=True)
        summary = {m: {k: median(v) for k, v in res.items()} for m, res in results.items()}
        sync, sync_is, one_off = (summary[m]["step_s"] for m in ("sync", "sync+IS", "async1"))
        gen = summary["async0"]["async/engine_gen_s"]  # generation alone: the trainer waits meanwhile
        ideal = max(gen, sync_is - gen)
        paired = {f"{a} / {b}, median of rounds": median([x / y for x, y in zip(rounds[a], rounds[b])])
                  for a, b in (("sync", "async1"), ("sync+IS", "async1"), ("sync+IS", "async0"))}
        summary["round_step_s"] = rounds
        summary["ratios"] = {
            "sync / async1": sync / one_off, "sync+IS / async1": sync_is / one_off, **paired,
            "sync+IS / ideal async1": sync_is / ideal, "ideal async1 step_s": ideal,
            "achieved fraction of the ideal gain": (sync_is - one_off) / (sync_is - ideal) if sync_is > ideal else None,
        }
        report["models"][name] = summary
        print(f"\n{name}: median seconds per step ({args.rounds} rounds x {args.steps} steps, engine {args.engine})")
        print(f"{'mode':10s} {'step':>7s} " + " ".join(f"{p.split('/')[-1]:>12s}" for p in PHASES))
        for m in MODES:
            cells = " ".join(f"{summary[m].get(p):12.3f}" if summary[m].get(p) is not None else f"{'-':>12s}"
                             for p in PHASES)
            print(f"{m:10s} {summary[m]['step_s']:7.3f} {cells}")
        print("ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in summary["ratios"].items() if v is not None) + "\n")
    report["load_average_at_end"] = os.getloadavg()  # other jobs on the machine: read the ratios, not the seconds
    print(f"load average (1, 5, 15 min): {report['load_average_at_start']} at start, {report['load_average_at_end']} "
          f"at the end, on {os.cpu_count()} CPUs")
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
