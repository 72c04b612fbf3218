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
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BATCH, N, NEW_TOKENS, LR, CLIP, MAX_GRAD_NORM = 32, 8, 4, 2e-4, 0.2, 1.0
TRL_MISSING = "TRL is not importable: `pip install trl==1.16.0` (no other change needed) to run its side"


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_rlflow(steps: int, run_dir: str) -> dict:
    from rlflow.tasks.default_job import build_trainer

    ends: list[float] = []
    cpu_ends: list[float] = []

    class StepEnds:
        def on_step_end(self, trainer, step, metrics):
            ends.append(time.perf_counter())
            cpu_ends.append(time.process_time())

    before = rss_mib()
    start, cpu_start = time.perf_counter(), time.process_time()
    trainer, data = build_trainer(seed=0, steps=steps, run_dir=run_dir, progress=False, loggers=("jsonl",),
                                  callbacks=[StepEnds()])
    trainer.fit(data)
    return {"step_ends": [start] + ends, "cpu_step_ends": [cpu_start] + cpu_ends, "rss_before_mib": before,
            "rss_peak_mib": rss_mib()}


def run_trl(steps: int, run_dir: str) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlflow.tasks.addition import AdditionTask, exact_match, warm_started_model

    task = AdditionTask()
    train, _, _ = task.splits()
    dataset = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["ground_truth"]} for r in train])

    def exact_match_reward(prompts, completions, ground_truth, **kwargs):  # TRL's reward form
        return [exact_match(c, g) for c, g in zip(completions, ground_truth)]

    ends: list[float] = []
    cpu_ends: list[float] = []

    class StepEnds(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())
            cpu_ends.append(time.process_time())

    before = rss_mib()
    start, cpu_start = time.perf_counter(), time.process_time()
    model, tokenizer = warm_started_model(task, seed=0)
    args = GRPOConfig(
        output_dir=run_dir, max_steps=steps, per_device_train_batch_size=BATCH * N, num_generations=N,
        gradient_accumulation_steps=1, max_completion_length=NEW_TOKENS, temperature=1.0, top_k=0, top_p=1.0,
        beta=0.0, epsilon=CLIP, loss_type="dapo", scale_rewards="group", num_iterations=1,
        learning_rate=LR, weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=MAX_GRAD_NORM,
        optim="adamw_torch", bf16=False, gradient_checkpointing=False,  # TRL's defaults are bf16 and checkpointing
        logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, seed=0,
        disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match_reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepEnds()])
    torch.manual_seed(0)
    trainer.train()
    return {"step_ends": [start] + ends, "cpu_step_ends": [cpu_start] + cpu_ends, "rss_before_mib": before,
            "rss_peak_mib": rss_mib()}


def side_main(side: str, steps: int, out: str, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix=f"rlflow-vs-trl-{side}-") as tmp:
        result = (run_rlflow if side == "rlflow" else run_trl)(steps, tmp)
    Path(out).write_text(json.dumps(result))


def summarise(result: dict, warmup: int) -> dict:
    ends = result["step_ends"]
    per_step = [b - a for a, b in zip(ends[:-1], ends[1:])][warmup:]
    cpu = result["cpu_step_ends"]
    cpu_per_step = [b - a for a, b in zip(cpu[:-1], cpu[1:])][warmup:]
    return {"s_per_step": statistics.median(per_step), "cpu_s_per_step": statistics.median(cpu_per_step),
            "rss_peak_mib": result["rss_peak_mib"],
            "rss_growth_mib": result["rss_peak_mib"] - result["rss_before_mib"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sides", default="rlflow,trl")
    p.add_argument("--side", help=argparse.SUPPRESS)  # internal: run one side in this process
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        return side_main(args.side, args.steps, args.out, args.threads)
    sides = args.sides.split(",")
    if "trl" in sides and importlib.util.find_spec("trl") is None:
        print(f"[vs_trl] skipping the TRL side: {TRL_MISSING}")
        sides.remove("trl")
    env = os.environ | {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
                        "TOKENIZERS_PARALLELISM": "false"}
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    with tempfile.TemporaryDirectory(prefix="rlflow-vs-trl-") as tmp:
        for r in range(args.rounds):
            for side in sides:
                out = Path(tmp) / f"{side}-{r}.json"
                cmd = [sys.executable, __file__, "--side", side, "--steps", str(args.steps), "--out", str(out),
                       "--threads", str(args.threads)]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if proc.returncode:
                    raise SystemExit(f"[vs_trl] {side} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
                runs[side].append(summarise(json.loads(out.read_text()), args.warmup))
                print(f"round {r + 1} {side:6} {runs[side][-1]['s_per_step']:.4f} s/step, "
                      f"peak RSS {runs[side][-1]['rss_peak_mib']:.0f} MiB", flush=True)
    med = {s: {k: statistics.median(run[k] for run in runs[s]) for k in runs[s][0]} for s in sides}
    report = {"runs": runs, "median": med, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
              "torch_threads": args.threads, "load_average": os.getloadavg()}
    print(f"\n{'':8} {'s/step':>8} {'CPU s/step':>10} {'peak RSS MiB':>13} {'RSS growth MiB':>15}")
    for s in sides:
        print(f"{s:8} {med[s]['s_per_step']:8.4f} {med[s]['cpu_s_per_step']:10.4f} {med[s]['rss_peak_mib']:13.0f} "
              f"{med[s]['rss_growth_mib']:15.0f}")
    if "trl" in med and "rlflow" in med:
        report["ratios_trl_over_rlflow"] = {k: med["trl"][k] / med["rlflow"][k] for k in med["rlflow"]}
        paired = [t["s_per_step"] / o["s_per_step"] for o, t in zip(runs["rlflow"], runs["trl"])]
        report["per_round_step_ratio_trl_over_rlflow"] = paired
        print(f"TRL / rlflow: step time {report['ratios_trl_over_rlflow']['s_per_step']:.2f}x "
              f"(per round {', '.join(f'{x:.2f}' for x in paired)}), peak RSS "
              f"{report['ratios_trl_over_rlflow']['rss_peak_mib']:.2f}x, RSS growth "
              f"{report['ratios_trl_over_rlflow']['rss_growth_mib']:.2f}x; CPU time per step "
              f"{report['ratios_trl_over_rlflow']['cpu_s_per_step']:.2f}x")
    print(f"load average {report['load_average'][0]:.1f}")
    Path(__file__).with_suffix(".json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
