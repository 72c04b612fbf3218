"""rlflow's Trainer vs a hand-written raw PyTorch + transformers GRPO loop, side by side, phase by phase.

    python benchmarks/trainer_overhead.py [--steps 40] [--rounds 3]

Both train the built-in task's warm-started model with the same settings (32 prompts x 8 samples, 4 new
tokens, AdamW lr 2e-4 without weight decay, clip 0.2, gradient clipping at 1.0, one update per batch).
Rounds alternate between the two so machine noise hits both; the report is the ratio of the median (over
rounds) seconds per step, rlflow / raw, where a round's seconds per step is its whole wall time (``fit`` with
its set-up, or the raw loop) over its steps. The phases are medians over a round's steps, pooled over the
rounds: the raw loop times its own, rlflow's come from the Trainer's ``timing_s/*`` metrics, and
"outside the step" is what ``fit`` spends around ``Trainer.step`` (prompt batches, logging, set-up). Also
reported: process CPU seconds per step (``time.process_time``, all threads), whose ratio other processes
on a loaded machine disturb far less than the wall-time one.
Torch runs on one thread (``--threads``) on both sides. Writes benchmarks/trainer_overhead.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rlflow.tasks.addition import AdditionTask, exact_match, warm_started_model
from rlflow.tasks.default_job import build_trainer

PHASES = ("gen", "reward", "update", "other in step", "outside the step")


def raw_grpo_steps(model, tokenizer, rows, steps: int, batch: int = 32, n: int = 8) -> tuple[float, float, dict]:
    """The loop people write by hand (nanochat/GRPO-Zero style); returns (wall s/step, CPU s/step, phase times)."""
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, weight_decay=0.0)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    g = torch.Generator().manual_seed(0)
    phases = {k: [] for k in PHASES}
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(steps):
        t0 = time.perf_counter()
        idx = torch.randint(len(rows), (batch,), generator=g).tolist()
        prompts = [rows[i]["prompt"] for i in idx for _ in range(n)]
        truths = [rows[i]["ground_truth"] for i in idx for _ in range(n)]
        enc = tokenizer(prompts, padding=True, return_tensors="pt")
        model.eval()
        with torch.no_grad():
            seq = model.generate(**enc, do_sample=True, max_new_tokens=4, top_k=None, top_p=None,
                                 eos_token_id=eos, pad_token_id=pad)
        model.train()
        t1 = time.perf_counter()
        P = enc["input_ids"].shape[1]
        resp = seq[:, P:]
        is_eos = (resp == eos).long()
        mask = ((is_eos.cumsum(-1) - is_eos) == 0).long()
        texts = tokenizer.batch_decode(resp.masked_fill(mask == 0, pad), skip_special_tokens=True)
        r = torch.tensor([exact_match(t, gt) for t, gt in zip(texts, truths)]).view(batch, n)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1, 1)
        t2 = time.perf_counter()
        attn = torch.cat([enc["attention_mask"], torch.ones_like(resp)], 1)
        pos = (attn.cumsum(-1) - 1).clamp_min(0)
        logits = model(input_ids=seq, attention_mask=attn, position_ids=pos).logits[:, P - 1 : -1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, resp.unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())
        loss_tok = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
        loss = (loss_tok * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        for name, seconds in (("gen", t1 - t0), ("reward", t2 - t1), ("update", t3 - t2)):
            phases[name].append(seconds)
    return (time.perf_counter() - start) / steps, (time.process_time() - cpu_start) / steps, phases


def rlflow_steps(steps: int, run_dir: Path) -> tuple[float, float, dict]:
    trainer, data = build_trainer(seed=0, steps=steps, run_dir=run_dir, progress=False, loggers=())
    start, cpu_start = time.perf_counter(), time.process_time()
    history = trainer.fit(data)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    phases = {k: [] for k in PHASES}
    for m in history:
        parts = {"gen": m["timing_s/gen"], "reward": m["timing_s/reward"] + m["timing_s/adv"],
                 "update": m["timing_s/update_actor"] + m["timing_s/update_weights"]}
        for name, seconds in parts.items():
            phases[name].append(seconds)
        phases["other in step"].append(m["timing_s/step"] - sum(parts.values()))
    phases["outside the step"] = [(wall - sum(m["timing_s/step"] for m in history)) / steps]
    return wall / steps, cpu / steps, phases


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads on both sides")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    task = AdditionTask()
    model, tok = warm_started_model(task, seed=0)
    train, _, _ = task.splits()
    times, cpu_times = {"raw": [], "rlflow": []}, {"raw": [], "rlflow": []}
    phases = {"raw": {k: [] for k in PHASES}, "rlflow": {k: [] for k in PHASES}}
    with tempfile.TemporaryDirectory(prefix="rlflow-bench-") as tmp:  # portable: no fixed machine path
        for i in range(args.rounds):
            for name, run in (("raw", lambda: raw_grpo_steps(copy.deepcopy(model), tok, train, args.steps)),
                              ("rlflow", lambda: rlflow_steps(args.steps, Path(tmp) / f"run-{i}"))):
                seconds, cpu_seconds, per_phase = run()
                times[name].append(seconds)
                cpu_times[name].append(cpu_seconds)
                for k, v in per_phase.items():
                    phases[name][k] += v
    med = {k: statistics.median(v) for k, v in times.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu_times.items()}
    med_phases = {side: {k: statistics.median(v) for k, v in per.items() if v} for side, per in phases.items()}
    report = {"seconds_per_step": times, "median": med, "ratio_rlflow_over_raw": med["rlflow"] / med["raw"],
              "cpu_seconds_per_step": cpu_times, "cpu_median": cpu_med,
              "cpu_ratio_rlflow_over_raw": cpu_med["rlflow"] / cpu_med["raw"], "phases_median_s": med_phases,
              "steps": args.steps, "rounds": args.rounds,
              "torch_threads": torch.get_num_threads(), "load_average": os.getloadavg()}
    print(f"{'phase (median s)':20} {'raw':>8} {'rlflow':>8}")
    for k in PHASES:
        raw, ours = med_phases["raw"].get(k), med_phases["rlflow"].get(k)
        print(f"{k:20} {'-' if raw is None else f'{raw:.4f}':>8} {ours:8.4f}")
    print(f"{'s/step (median)':20} {med['raw']:8.4f} {med['rlflow']:8.4f}")
    print(f"rlflow / raw = {report['ratio_rlflow_over_raw']:.3f}   (per round: "
          f"{', '.join(f'{b / a:.3f}' for a, b in zip(times['raw'], times['rlflow']))}; "
          f"load average {report['load_average'][0]:.1f})")
    print(f"CPU s/step (median): raw {cpu_med['raw']:.4f}, rlflow {cpu_med['rlflow']:.4f}, "
          f"rlflow / raw = {report['cpu_ratio_rlflow_over_raw']:.3f} (process CPU time: what each side computes, "
          "not what it waits for the cores; the robust figure on a loaded machine)")
    Path(__file__).with_suffix(".json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
