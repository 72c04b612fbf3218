"""rlflow's Trainer vs a hand-written raw PyTorch + transformers GRPO loop, side by side.

    python benchmarks/trainer_overhead.py [--steps 40] [--rounds 3]

Both train the built-in task's warm-started model with the same settings (32
prompts x 8 samples, 4 new tokens, Adam lr 2e-4, clip 0.2, one update per
batch). Rounds alternate between the two so machine noise hits both; the
report is the ratio of median seconds per step (rlflow / raw). Writes
benchmarks/trainer_overhead.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rlflow.tasks.addition import AdditionTask, exact_match, warm_started_model
from rlflow.tasks.default_job import build_trainer


def raw_grpo_steps(model, tokenizer, rows, steps: int, batch: int = 32, n: int = 8) -> float:
    """The loop people write by hand (nanochat/GRPO-Zero style); returns seconds per step."""
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, weight_decay=0.0)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    g = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for _ in range(steps):
        idx = torch.randint(len(rows), (batch,), generator=g).tolist()
        prompts = [rows[i]["prompt"] for i in idx for _ in range(n)]
        truths = [rows[i]["ground_truth"] for i in idx for _ in range(n)]
        enc = tokenizer(prompts, padding=True, return_tensors="pt")
        model.eval()
        with torch.no_grad():
            seq = model.generate(**enc, do_sample=True, max_new_tokens=4, top_k=None, top_p=None,
                                 eos_token_id=eos, pad_token_id=pad)
        model.train()
        P = enc["input_ids"].shape[1]
        resp = seq[:, P:]
        is_eos = (resp == eos).long()
        mask = ((is_eos.cumsum(-1) - is_eos) == 0).long()
        texts = tokenizer.batch_decode(resp.masked_fill(mask == 0, pad), skip_special_tokens=True)
        r = torch.tensor([exact_match(t, gt) for t, gt in zip(texts, truths)]).view(batch, n)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1, 1)
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
    return (time.perf_counter() - start) / steps


def rlflow_steps(steps: int, run_dir: Path) -> float:
    trainer, data = build_trainer(seed=0, steps=steps, run_dir=run_dir, progress=False, loggers=())
    start = time.perf_counter()
    trainer.fit(data)
    return (time.perf_counter() - start) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    task = AdditionTask()
    model, tok = warm_started_model(task, seed=0)
    train, _, _ = task.splits()
    times = {"raw": [], "rlflow": []}
    with tempfile.TemporaryDirectory(prefix="rlflow-bench-") as tmp:  # portable: no fixed machine path
        for i in range(args.rounds):
            times["raw"].append(raw_grpo_steps(copy.deepcopy(model), tok, train, args.steps))
            times["rlflow"].append(rlflow_steps(args.steps, Path(tmp) / f"run-{i}"))
    med = {k: statistics.median(v) for k, v in times.items()}
    report = {"seconds_per_step": times, "median": med, "ratio_rlflow_over_raw": med["rlflow"] / med["raw"],
              "steps": args.steps, "rounds": args.rounds, "torch_threads": torch.get_num_threads()}
    print(f"{'loop':8} {'median s/step':>14}")
    for k, v in med.items():
        print(f"{k:8} {v:14.4f}")
    print(f"rlflow / raw = {report['ratio_rlflow_over_raw']:.2f}")
    Path(__file__).with_suffix(".json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
