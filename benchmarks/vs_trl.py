"""rlflow vs TRL's ``GRPOTrainer``, side by side: same model, data, batch, sampling, loss and optimizer.

    pip install trl==1.16.0            # TRL's own environment: any with transformers 5.x and torch
                                       # (or: pip install --target DIR --no-deps trl==1.16.0; PYTHONPATH=DIR)
    python benchmarks/vs_trl.py        # --steps 12 --rounds 3; --sides rlflow to run rlflow alone

Without TRL installed the TRL side is skipped with a message (rlflow's side still runs).

The setup is the default job's: the built-in addition task's warm-started 0.5M-parameter Qwen2 (made in code,
cached), 32 prompts x 8 samples per step, at most 4 new tokens, temperature 1 without top-k/top-p, exact-match
reward, GRPO advantages (group mean, divided by the group std), the clipped policy loss with epsilon 0.2 and no
KL term (no reference model), token-mean loss (TRL's default ``loss_type="dapo"``), one AdamW step per batch
(lr 2e-4, no weight decay, constant schedule), gradients clipped at norm 1.0, logging every step, no checkpoints.

Each side runs in its own subprocess (``--side``; memory figures of one side never include the other's), the
rounds alternate sides so machine load hits both, and torch uses one thread on both sides. Per-step time is the
wall time between consecutive step ends (everything a step costs: data, generation, reward, update, logging),
median over the steps after the first ``--warmup`` ones, then median over rounds. CPU time per step
(``time.process_time``, all threads, between the same step ends) is reported too: other processes on a loaded
machine disturb it far less than wall time. Peak memory is the process's peak RSS (``ru_maxrss``) at the end and
its growth during training (from just before the trainer is built).
Writes benchmarks/vs_trl.json.

``--model smollm2``: the same comparison on a real model, SmolLM2-135M-Instruct (``rlflow get-model smollm2``'s
float32 folder; both sides load it from there): chat prompts "What is A + B?" (A, B in 1-50, seeded) through
its chat template, in file order on both sides (no shuffling), so both generate from the same prompt token ids
(recorded at generation on both sides and checked equal), 8 prompts x 4 samples per step, at most 32 new tokens,
temperature 0.7 without top-k/top-p, reward 1.0 when the sum appears as a number in the response (one TRL-form
function for both), GRPO advantages, clip 0.2, no KL, token-mean loss, AdamW lr 1e-6, no weight decay, clipping
at 1.0, float32, HF ``generate`` on both (TRL without vLLM). Defaults --steps 4 --warmup 1 --rounds 3. The
samples differ between the sides (different random streams), so response lengths do too: the mean per step is
reported with the times (and the mean reward). Per-phase seconds per step: rlflow's own ``timing_s/*``; TRL's from timing its methods
(``model.generate``, ``_generate_and_score_completions``, ``compute_loss``, ``training_step``).
Writes benchmarks/vs_trl_smollm2.json.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib.util
import json
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from rlflow import Batching, Loop, Optim, RunDir

BATCH, N, NEW_TOKENS, LR, CLIP, MAX_GRAD_NORM = 32, 8, 4, 2e-4, 0.2, 1.0
# --model smollm2: the real model's setup (see the docstring)
REAL = {"batch": 8, "n": 4, "new_tokens": 32, "lr": 1e-6, "temperature": 0.7, "rows": 64}
TRL_MISSING = "TRL is not importable: `pip install trl==1.16.0` (no other change needed) to run its side"


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def sum_rows(k: int = REAL["rows"], seed: int = 0) -> list[dict]:
    """Chat prompts of simple sums, the same list on both sides."""
    rng = random.Random(seed)
    pairs = [(rng.randint(1, 50), rng.randint(1, 50)) for _ in range(k)]
    return [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "ground_truth": str(a + b)}
            for a, b in pairs]


def contains_sum(prompts, completions, ground_truth, **kwargs):
    """1.0 when the sum appears as a number in the response (TRL's reward form; rlflow's FunctionReward reads it)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]  # TRL: chat completions
    return [float(re.search(rf"(?<!\d){g}(?!\d)", t) is not None) for t, g in zip(texts, ground_truth)]


def smollm2_dir() -> Path:
    from rlflow.models.gguf import smollm2_folder

    return smollm2_folder()


class Phases:
    """Seconds per phase within the current step (wrapped callables add to it); ``close`` ends a step."""

    def __init__(self):
        self.now, self.steps = collections.defaultdict(float), []

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.now[name] += time.perf_counter() - t
        return timed

    def close(self, extra: dict | None = None) -> None:
        self.steps.append(dict(self.now) | (extra or {}))
        self.now.clear()


def unpadded_prompts(ids, mask) -> list[list[int]]:
    """The distinct prompts of a generation call, as token-id lists without padding, sorted."""
    rows = {tuple(i for i, m in zip(r.tolist(), mr.tolist()) if m) for r, mr in zip(ids, mask)}
    return sorted(list(r) for r in rows)


def build_rlflow_smollm2(steps: int, run_dir: str, callbacks: list):
    from rlflow import Policy
    from rlflow.algorithms import GRPO, PPOLoss
    from rlflow.data.prompts import PromptData
    from rlflow.rewards import FunctionReward
    from rlflow.rollout.hf import HFRollout
    from rlflow.trainer.trainer import Trainer

    policy = Policy.from_pretrained(smollm2_dir(), temperature=REAL["temperature"])
    trainer = Trainer(
        policy=policy,
        rollout=HFRollout(n=REAL["n"], temperature=REAL["temperature"], max_new_tokens=REAL["new_tokens"]),
        reward=FunctionReward(contains_sum), estimator=GRPO(), loss=PPOLoss(clip_ratio=CLIP), callbacks=callbacks,
        optim=Optim(lr=REAL["lr"], weight_decay=0.0, max_grad_norm=MAX_GRAD_NORM),
        batching=Batching(batch_size=REAL["batch"]), loop=Loop(max_steps=steps, seed=0, progress=False),
        run=RunDir(path=run_dir, loggers=("jsonl",)),
    )
    return trainer, PromptData(sum_rows(), shuffle=False, seed=0)


def run_rlflow(steps: int, run_dir: str, model: str = "tiny") -> dict:
    from rlflow.tasks.default_job import build_trainer

    ends: list[float] = []
    cpu_ends: list[float] = []

    phases: list[dict] = []
    prompts: list[list[list[int]]] = []

    class StepEnds:
        def on_rollout_end(self, trainer, batch):
            from rlflow.data import keys as K

            prompts.append(unpadded_prompts(batch[K.PROMPT_IDS], batch[K.PROMPT_MASK]))

        def on_step_end(self, trainer, step, metrics):
            ends.append(time.perf_counter())
            cpu_ends.append(time.process_time())
            phases.append({k.removeprefix("timing_s/"): v for k, v in metrics.items() if k.startswith("timing_s/")}
                          | {"response_length": metrics.get("response_length/mean"),
                             "mean_reward": metrics.get("critic/score/mean")})

    before = rss_mib()
    start, cpu_start = time.perf_counter(), time.process_time()
    if model == "smollm2":
        trainer, data = build_rlflow_smollm2(steps, run_dir, [StepEnds()])
    else:
        trainer, data = build_trainer(seed=0, steps=steps, run_dir=run_dir, progress=False, loggers=("jsonl",),
                                      callbacks=[StepEnds()])
    trainer.fit(data)
    return {"step_ends": [start] + ends, "cpu_step_ends": [cpu_start] + cpu_ends, "rss_before_mib": before,
            "rss_peak_mib": rss_mib(), "phases": phases, "prompt_ids": prompts}


def run_trl(steps: int, run_dir: str, model_name: str = "tiny") -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlflow.tasks.addition import AdditionTask, exact_match, warm_started_model

    real = model_name == "smollm2"
    if real:
        dataset = Dataset.from_list(sum_rows())
        reward_fn = contains_sum
    else:
        task = AdditionTask()
        train, _, _ = task.splits()
        dataset = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["ground_truth"]} for r in train])

        def reward_fn(prompts, completions, ground_truth, **kwargs):  # TRL's reward form
            return [exact_match(c, g) for c, g in zip(completions, ground_truth)]

    ends: list[float] = []
    cpu_ends: list[float] = []
    phases = Phases()
    prompts: list[list[list[int]]] = []

    class StepEnds(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())
            cpu_ends.append(time.process_time())
            now, step = phases.now, ends[-1] - (ends[-2] if len(ends) > 1 else start)
            phases.close({"step": step, "backward": now["training_step"] - now["generate_and_score"] - now["forward_loss"],
                          "optimizer_and_rest": step - now["training_step"]})

        def on_log(self, args, state, control, logs=None, **kwargs):  # after on_step_end, same step
            if logs and "completions/mean_length" in logs and phases.steps:
                phases.steps[-1] |= {"response_length": logs["completions/mean_length"],
                                     "mean_reward": logs.get("reward")}

    before = rss_mib()
    start, cpu_start = time.perf_counter(), time.process_time()
    if real:
        folder = smollm2_dir()
        model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    else:
        model, tokenizer = warm_started_model(task, seed=0)
    batch, n, new_tokens, lr, temperature = ((REAL["batch"], REAL["n"], REAL["new_tokens"], REAL["lr"],
                                              REAL["temperature"]) if real else (BATCH, N, NEW_TOKENS, LR, 1.0))
    args = GRPOConfig(
        output_dir=run_dir, max_steps=steps, per_device_train_batch_size=batch * n, num_generations=n,
        gradient_accumulation_steps=1, max_completion_length=new_tokens, temperature=temperature, top_k=0, top_p=1.0,
        beta=0.0, epsilon=CLIP, loss_type="dapo", scale_rewards="group", num_iterations=1,
        shuffle_dataset=not real,  # the real model: prompts in file order, as rlflow's side reads them
        learning_rate=lr, weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=MAX_GRAD_NORM,
        optim="adamw_torch", bf16=False, gradient_checkpointing=False,  # TRL's defaults are bf16 and checkpointing
        logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, seed=0,
        disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepEnds()])
    generate = model.generate  # the model TRL generates with on one CPU process (unwrapping returns it)

    def recorded_generate(*a, **kw):
        prompts.append(unpadded_prompts(kw["input_ids"], kw["attention_mask"]))
        return generate(*a, **kw)

    model.generate = phases.wrap("gen", recorded_generate)
    for name, method in (("generate_and_score", "_generate_and_score_completions"), ("forward_loss", "compute_loss"),
                         ("training_step", "training_step")):
        setattr(trainer, method, phases.wrap(name, getattr(trainer, method)))
    torch.manual_seed(0)
    trainer.train()
    return {"step_ends": [start] + ends, "cpu_step_ends": [cpu_start] + cpu_ends, "rss_before_mib": before,
            "rss_peak_mib": rss_mib(), "phases": phases.steps, "prompt_ids": prompts}


def side_main(side: str, steps: int, out: str, threads: int, model: str) -> None:
    import torch

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix=f"rlflow-vs-trl-{side}-") as tmp:
        result = (run_rlflow if side == "rlflow" else run_trl)(steps, tmp, model)
    Path(out).write_text(json.dumps(result))


def summarise(result: dict, warmup: int) -> dict:
    ends = result["step_ends"]
    per_step = [b - a for a, b in zip(ends[:-1], ends[1:])][warmup:]
    cpu = result["cpu_step_ends"]
    cpu_per_step = [b - a for a, b in zip(cpu[:-1], cpu[1:])][warmup:]
    out = {"s_per_step": statistics.median(per_step), "cpu_s_per_step": statistics.median(cpu_per_step),
           "rss_peak_mib": result["rss_peak_mib"],
           "rss_growth_mib": result["rss_peak_mib"] - result["rss_before_mib"]}
    steps = result.get("phases", [])[warmup:]
    for k in sorted({k for p in steps for k in p}):  # per-phase seconds (and response length), median over steps
        vals = [p[k] for p in steps if p.get(k) is not None]
        if vals:
            out[f"phase/{k}"] = statistics.median(vals)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    p.add_argument("--steps", type=int, help="default 12 (tiny), 4 (smollm2)")
    p.add_argument("--warmup", type=int, help="first steps left out of the medians: default 2 (tiny), 1 (smollm2)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sides", default="rlflow,trl")
    p.add_argument("--side", help=argparse.SUPPRESS)  # internal: run one side in this process
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    real = args.model == "smollm2"
    args.steps = args.steps or (4 if real else 12)
    args.warmup = (1 if real else 2) if args.warmup is None else args.warmup
    if args.side:
        return side_main(args.side, args.steps, args.out, args.threads, args.model)
    sides = args.sides.split(",")
    if "trl" in sides and importlib.util.find_spec("trl") is None:
        print(f"[vs_trl] skipping the TRL side: {TRL_MISSING}")
        sides.remove("trl")
    env = os.environ | {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
                        "TOKENIZERS_PARALLELISM": "false"}
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    prompt_ids: dict[str, list] = {}
    with tempfile.TemporaryDirectory(prefix="rlflow-vs-trl-") as tmp:
        for r in range(args.rounds):
            for side in sides:
                out = Path(tmp) / f"{side}-{r}.json"
                cmd = [sys.executable, __file__, "--side", side, "--steps", str(args.steps), "--out", str(out),
                       "--threads", str(args.threads), "--model", args.model]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if proc.returncode:
                    raise SystemExit(f"[vs_trl] {side} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
                result = json.loads(out.read_text())
                prompt_ids.setdefault(side, result.get("prompt_ids"))
                runs[side].append(summarise(result, args.warmup))
                phase = ", ".join(f"{k[6:]} {v:.2f}" for k, v in runs[side][-1].items() if k.startswith("phase/"))
                print(f"round {r + 1} {side:6} {runs[side][-1]['s_per_step']:.4f} s/step, CPU "
                      f"{runs[side][-1]['cpu_s_per_step']:.4f} s/step, peak RSS {runs[side][-1]['rss_peak_mib']:.0f} "
                      f"MiB; {phase}", flush=True)
                if real:  # a partial record after each side's run (the real model's runs take long)
                    Path(__file__).with_name("vs_trl_smollm2.json").write_text(json.dumps(
                        {"partial": True, "runs": runs, "steps": args.steps, "warmup": args.warmup}, indent=2))
    med = {s: {k: statistics.median(run[k] for run in runs[s]) for k in runs[s][0]} for s in sides}
    report = {"model": args.model, "runs": runs, "median": med, "steps": args.steps, "warmup": args.warmup,
              "rounds": args.rounds, "torch_threads": args.threads, "load_average": os.getloadavg()}
    if real and len(prompt_ids) == 2:  # both sides generated from the same prompt token ids, step by step
        report["same_prompt_ids"] = prompt_ids["rlflow"] == prompt_ids["trl"]
        print(f"same prompt token ids on both sides, every step: {report['same_prompt_ids']}")
    print(f"\n{'':8} {'s/step':>8} {'CPU s/step':>10} {'peak RSS MiB':>13} {'RSS growth MiB':>15}")
    for s in sides:
        print(f"{s:8} {med[s]['s_per_step']:8.4f} {med[s]['cpu_s_per_step']:10.4f} {med[s]['rss_peak_mib']:13.0f} "
              f"{med[s]['rss_growth_mib']:15.0f}")
    if "trl" in med and "rlflow" in med:
        report["ratios_trl_over_rlflow"] = {k: med["trl"][k] / med["rlflow"][k] for k in med["rlflow"]
                                            if k in med["trl"] and not k.startswith("phase/")}
        paired = [t["s_per_step"] / o["s_per_step"] for o, t in zip(runs["rlflow"], runs["trl"])]
        report["per_round_step_ratio_trl_over_rlflow"] = paired
        print(f"TRL / rlflow: step time {report['ratios_trl_over_rlflow']['s_per_step']:.2f}x "
              f"(per round {', '.join(f'{x:.2f}' for x in paired)}), peak RSS "
              f"{report['ratios_trl_over_rlflow']['rss_peak_mib']:.2f}x, RSS growth "
              f"{report['ratios_trl_over_rlflow']['rss_growth_mib']:.2f}x; CPU time per step "
              f"{report['ratios_trl_over_rlflow']['cpu_s_per_step']:.2f}x")
    print(f"load average {report['load_average'][0]:.1f}")
    out = Path(__file__).with_suffix(".json")
    if real:
        out = out.with_name(f"{out.stem}_smollm2.json")
    out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
