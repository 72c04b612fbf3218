"""Synchronous vs one-step-off vs fully asynchronous RL steps, side by side in one run.

    python benchmarks/async_rl.py [--models tiny small] [--rounds 3] [--steps 4] [--engine hf|vllm]
    python benchmarks/async_rl.py --workload long-tail [--rounds 2] [--steps 4]

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

``--workload long-tail`` (most responses short, a few at the length limit, as reasoning traces are) runs
``sync``, ``async1`` and ``fully-async`` (``FullyAsyncRollout(max_off_policy_threshold=2, "wait")``, partial
rollouts in chunks of ``--chunk-tokens``) on the ``longtail`` model, a Qwen2 (hidden 128, 2 layers, vocabulary
1024; 16 prompts x 4 samples, <= 96 new tokens: generation about half the synchronous step) whose tied embeddings are edited so that its EOS probability
is bimodal: hidden dimension 0 of each token's embedding marks it "short" (-1: 90 % of the generated
vocabulary), "long" (+1: 10 %) or neutral (-0.01: the prompts' tokens), and EOS is -2 there. After a short
token the next one is EOS or short (EOS's logit is twice a short token's), after a long token EOS and short
tokens are suppressed, so a response stops within a few tokens or runs to the limit; which way it goes is
set mostly by the prompt (a random prompt of 20 neutral tokens). Measured from the initial weights (``length_hist``
in the JSON): 89 % of responses stop within 4 tokens, 11 % reach the limit, 14 % of prompts have one that does. Reported per mode: generated tokens per wall second, the
trainer's idle fraction (time waiting for a batch: ``timing_s/gen_wait`` in the async modes, generation itself,
``timing_s/gen``, in ``sync``; over the step) and staleness (versions between the weights that sampled a
response's oldest token and those it trains: ``async/staleness_mean|max``). With ``--pin`` (default) the
trainer's process runs on the first CPU the OS allows it and the engine's process on the second
(``os.sched_setaffinity``); ``sync`` has one process, on the first.
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
from rlflow.rollout import AsyncRollout, FullyAsyncRollout, HFRollout
from rlflow.tasks.addition import AdditionTask, exact_match, warm_started_model

MODES = ("sync", "sync+IS", "async0", "async1")
LONG_TAIL_MODES = ("sync", "async1", "fully-async")
MODELS = {
    "tiny": dict(prompts=32, n=8, new_tokens=4, lr=2e-4, max_len=64),
    "small": dict(shape=dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=704,
                             max_positions=128), vocab=4096, prompts=8, n=4, new_tokens=32, lr=1e-5, max_len=128),
    "longtail": dict(shape=dict(hidden_size=128, num_layers=2, max_positions=128), vocab=1024, prompts=16, n=4,
                     new_tokens=96, lr=1e-5, max_len=128),
}
PHASES = ("timing_s/gen", "timing_s/gen_wait", "timing_s/train_wait", "async/engine_gen_s", "timing_s/reward",
          "timing_s/old_log_prob", "timing_s/update_actor", "timing_s/update_weights")


def length_reward(solution_str: str, ground_truth: str) -> float:
    return len(solution_str) / 64


def long_tail_model(tok, spec: dict):
    """A random Qwen2 whose EOS probability is bimodal (module docstring): returns (model, the prompts' tokens)."""
    model = tiny_qwen2(len(tok), seed=0, **spec["shape"])
    ids = torch.arange(3, len(tok))  # 0-2: pad, bos, eos
    neutral, rest = ids[: len(ids) // 4], ids[len(ids) // 4:]
    long_, short = rest[: len(rest) // 10], rest[len(rest) // 10:]
    with torch.no_grad():  # tied: dimension 0 is both what a token says and what the next token's logit reads
        emb = model.get_input_embeddings().weight
        emb[:, 0] = 0.0
        emb[neutral, 0], emb[long_, 0], emb[short, 0] = -0.01, 1.0, -1.0
        emb[tok.eos_token_id, 0] = -2.0
    return model, neutral


def model_and_data(name: str):
    """(model, tokenizer, rows, reward function) of a benchmark model."""
    spec = MODELS[name]
    if name == "longtail":
        tok = char_tokenizer("".join(chr(0x4E00 + i) for i in range(spec["vocab"] - 3)))
        model, neutral = long_tail_model(tok, spec)
        g = torch.Generator().manual_seed(0)
        rows = [{"prompt": tok.decode([int(neutral[i]) for i in torch.randint(0, len(neutral), (20,), generator=g)]),
                 "ground_truth": "0", "data_source": "bench"} for _ in range(16 * spec["prompts"])]
        return model, tok, rows, length_reward
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


def pin(rollout, cpus: list[int] | None) -> str:
    """The trainer on ``cpus[0]``, the engine's child process (if any) on ``cpus[1]``; what was done, in words."""
    if not cpus:
        return "not pinned"
    if not hasattr(os, "sched_setaffinity") or len(cpus) < 2:
        return f"could not pin: sched_setaffinity {'missing' if not hasattr(os, 'sched_setaffinity') else 'has one CPU'}"
    os.sched_setaffinity(0, {cpus[0]})
    child = getattr(getattr(getattr(rollout, "engine", None), "process", None), "pid", None)
    if child is None:
        return f"trainer on CPU {cpus[0]} (no engine process)"
    os.sched_setaffinity(child, {cpus[1]})
    return f"trainer on CPU {cpus[0]}, engine (pid {child}) on CPU {cpus[1]}"


def run(mode: str, name: str, engine: str, steps: int, base, tok, rows, reward, tmp: Path,
        cpus: list[int] | None = None, chunk_tokens: int = 8) -> dict:
    spec = MODELS[name]
    rollout = sampler(engine, spec)
    corrected = mode != "sync"
    if mode.startswith("async"):
        rollout = AsyncRollout(rollout, max_staleness=int(mode[-1]))
    elif mode == "fully-async":  # partial rollouts: weights loaded between chunks, responses continue under them
        rollout = FullyAsyncRollout(rollout, max_off_policy_threshold=2, max_off_policy_strategy="wait",
                                    chunk_tokens=chunk_tokens)
    clock = StepClock()
    trainer = Trainer(
        policy=Policy(copy.deepcopy(base), tok), rollout=rollout, reward=FunctionReward(reward),
        estimator=Chain(TruncatedIS(), GRPO()) if corrected else GRPO(),
        loss=PPOLoss(clip_ratio=0.2, is_weights=corrected), callbacks=[clock],
        optim=Optim(lr=spec["lr"], weight_decay=0.0), batching=Batching(batch_size=spec["prompts"]),
        loop=Loop(max_steps=steps + 1, progress=False), run=RunDir(path=tmp / mode, loggers=()),
    )
    pinned = pin(rollout, cpus)
    try:
        history = trainer.fit(PromptData(rows, seed=0))
    finally:
        if hasattr(rollout, "close"):
            rollout.close()
        if cpus:
            os.sched_setaffinity(0, set(cpus))
    keys = PHASES + LONG_TAIL_KEYS
    out = {"step_s": clock.times[1:], **{k: [m[k] for m in history[1:] if k in m] for k in keys}}
    out["pinned"] = [pinned]
    return out


LONG_TAIL_KEYS = ("response_length/mean", "response_length/clip_ratio", "async/staleness_mean", "async/staleness_max",
                  "async/partial_frac", "training/off_policy/trajectory_spans/mean")


def long_tail_summary(results: dict, spec: dict) -> dict:
    """Per mode: generated tokens per wall second, the trainer's idle fraction, staleness (module docstring)."""
    rows = spec["prompts"] * spec["n"]
    out = {}
    for mode, res in results.items():
        steps = res["step_s"]
        tokens = [m * rows for m in res["response_length/mean"]]
        idle = res.get("timing_s/gen_wait") or res.get("timing_s/gen")  # sync: the trainer waits all of generation
        stale_mean, stale_max = res.get("async/staleness_mean") or [0.0], res.get("async/staleness_max") or [0.0]
        out[mode] = {
            "tokens_per_s": sum(tokens) / sum(steps), "step_s": median(steps),
            "idle_fraction": sum(idle) / sum(steps), "staleness_mean": statistics.mean(stale_mean),
            "staleness_max": max(stale_max), "response_length_mean": statistics.mean(res["response_length/mean"]),
            "at_length_limit": statistics.mean(res["response_length/clip_ratio"]),
            "partial_frac": statistics.mean(res["async/partial_frac"]) if res.get("async/partial_frac") else 0.0,
            **{k.split("/")[-1].removesuffix("_s") + "_s": median(res.get(k, [])) for k in PHASES},  # phase medians
        }
    return out


def length_hist(model, tok, rows, spec: dict) -> dict:
    """Lengths of 4 x 16 responses from the initial weights: the workload's shape, measured."""
    engine = HFRollout(n=spec["n"], max_new_tokens=spec["new_tokens"])
    engine.bind(copy.deepcopy(model), tok)
    from rlflow.rollout.engines.base import SamplingParams

    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows[:64]]
    done = engine.engine.generate(prompts, SamplingParams(n=spec["n"], max_new_tokens=spec["new_tokens"], seed=0))
    lengths = [len(c.token_ids) for cs in done for c in cs]
    limit = spec["new_tokens"]
    return {"responses": len(lengths), "within_4_tokens": sum(n <= 4 for n in lengths) / len(lengths),
            "at_limit": sum(n >= limit for n in lengths) / len(lengths),
            "prompts_with_a_response_at_limit": sum(any(len(c.token_ids) >= limit for c in cs) for cs in done) / len(done),
            "mean": statistics.mean(lengths)}


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small"], choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="measured steps per run (after one that fills the pipeline)")
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    parser.add_argument("--workload", choices=["default", "long-tail"], default="default")
    parser.add_argument("--chunk-tokens", type=int, default=8, help="fully-async: tokens per chunk (long-tail)")
    parser.add_argument("--no-pin", dest="pin", action="store_false", help="long-tail: do not pin to CPUs")
    parser.add_argument("--out", default=None, help="default: async_rl.json, async_rl_long_tail.json beside this")
    args = parser.parse_args()
    torch.manual_seed(0)
    tmp = Path(__import__("tempfile").mkdtemp(prefix="rlflow-async-bench-"))
    if args.workload == "long-tail":
        return long_tail(args, tmp)
    args.out = args.out or str(Path(__file__).with_name("async_rl.json"))
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
                out.pop("pinned")  # not pinned: this workload's figures are comparable with its earlier runs
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


def long_tail(args, tmp: Path) -> None:
    """sync, one-step-off and fully async on the long-tail workload, rounds interleaved."""
    name, spec = "longtail", MODELS["longtail"]
    cpus = sorted(os.sched_getaffinity(0))[:2] if args.pin and hasattr(os, "sched_getaffinity") else None
    base, tok, rows, reward = model_and_data(name)
    report = {"workload": "long-tail", "engine": args.engine, "rounds": args.rounds, "steps": args.steps,
              "chunk_tokens": args.chunk_tokens, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
              "load_average_at_start": os.getloadavg(), "length_hist": length_hist(base, tok, rows, spec)}
    print(f"workload: {report['length_hist']}", flush=True)
    results, rounds = {m: {} for m in LONG_TAIL_MODES}, {m: [] for m in LONG_TAIL_MODES}
    for r in range(args.rounds):
        order = LONG_TAIL_MODES[r % 3:] + LONG_TAIL_MODES[: r % 3]  # rotate: no mode always runs first
        for mode in order:
            out = run(mode, name, args.engine, args.steps, base, tok, rows, reward, tmp / f"lt{r}", cpus,
                      args.chunk_tokens)
            for k, v in out.items():
                results[mode].setdefault(k, []).extend(v)
            rounds[mode].append(median(out["step_s"]))
            print(f"[long-tail] round {r + 1} {mode:11s} step {median(out['step_s']):.3f} s ({out['pinned'][0]})",
                  flush=True)
    summary = long_tail_summary(results, spec)
    for m in LONG_TAIL_MODES:
        summary[m]["round_step_s"], summary[m]["pinned"] = rounds[m], results[m]["pinned"][0]
        summary[m]["sync step / this step, median of rounds"] = median(
            [a / b for a, b in zip(rounds["sync"], rounds[m])])
    report["modes"] = summary
    report["load_average_at_end"] = os.getloadavg()
    print(f"\nlong-tail: {args.rounds} rounds x {args.steps} steps, engine {args.engine}, chunk {args.chunk_tokens}")
    print(f"{'mode':12s} {'step s':>7s} {'tok/s':>7s} {'idle':>6s} {'stale mean':>10s} {'max':>4s} {'partial':>7s} "
          f"{'len':>5s} {'vs sync':>7s}")
    for m, v in summary.items():
        print(f"{m:12s} {v['step_s']:7.3f} {v['tokens_per_s']:7.1f} {v['idle_fraction']:6.2f} "
              f"{v['staleness_mean']:10.2f} {v['staleness_max']:4.0f} {v['partial_frac']:7.2f} "
              f"{v['response_length_mean']:5.1f} {v['sync step / this step, median of rounds']:7.2f}")
    print(f"load average (1, 5, 15 min): {report['load_average_at_start']} at start, {report['load_average_at_end']} "
          f"at the end, on {os.cpu_count()} CPUs")
    out = args.out or str(Path(__file__).with_name("async_rl_long_tail.json"))
    Path(out).write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
