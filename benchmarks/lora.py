"""LoRA vs full fine-tuning on the same model, side by side: trainable parameters, optimizer state,
reference weights, peak memory and step time; then the two ways to get LoRA weights into a generation
engine (merged weights vs the adapter alone), sync and generation timed.

    python benchmarks/lora.py                       # tiny Qwen2, hidden 512, 4 layers, vocab 8192 (~21M params)
    python benchmarks/lora.py --hidden 256 --layers 2 --steps 4     # quicker

Part 1. Each variant runs in its own subprocess (so one variant's peak memory cannot hide the other's):
the same GRPO job (PPOLoss with a KL term, so a reference is scored every step) for ``--steps`` steps,
with all weights trained ("full", the reference a frozen deep copy) or LoRA adapters on every linear
layer ("lora", rank ``--rank``, the reference is the same model with the adapter off). Exact byte counts
of trainable parameters, their gradients, the AdamW state and the reference's own weights; peak memory
as the growth of the process's peak RSS (``ru_maxrss``) from just before the Trainer is built; step
time as the median of the steps after the first; each variant runs ``--rounds`` times, alternating with the
other, and the table shows the medians (byte counts are the same every round).

Part 2. For the LoRA policy after one update: ``merged`` syncs ``W + s B A`` of the adapted layers (HF
names) into a plain transformers copy, which then generates at plain speed; ``adapter`` syncs the
adapter alone into a PEFT copy, which generates with the extra LoRA matmuls. Median of ``--repeats``
of each, alternating. Prints tables and writes ``lora.json`` next to this file.
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from rlflow import Batching, Loop, Optim, RunDir

LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def build(args, variant: str, run_dir: str):
    import torch
    from peft import LoraConfig

    from rlflow import GRPO, FunctionReward, HFRollout, Policy, PPOLoss, PromptData, Trainer
    from rlflow.models.tiny import char_tokenizer, tiny_qwen2
    from rlflow.tasks.addition import AdditionTask

    torch.manual_seed(0)
    tok = char_tokenizer()
    model = tiny_qwen2(args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=8, num_kv_heads=4,
                       intermediate_size=4 * args.hidden, max_positions=128, seed=0)
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=LINEAR) if variant == "lora" else None
    policy = Policy(model, tok, lora=lora)
    base_rss = rss_mib()
    train, _, _ = AdditionTask().splits()
    trainer = Trainer(
        policy=policy, rollout=HFRollout(n=4, max_new_tokens=args.new_tokens),
        reward=FunctionReward(lambda s, g: float(len(set(s))) / 8), estimator=GRPO(), loss=PPOLoss(kl_coef=1e-3),
        optim=Optim(lr=1e-4),
        batching=Batching(batch_size=args.prompts),
        loop=Loop(max_steps=args.steps, progress=False),
        run=RunDir(path=run_dir, loggers=()),
    )
    return trainer, PromptData(train[: args.prompts * args.steps], seed=0), base_rss


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def worker(args, variant: str, out: str) -> None:
    import torch

    trainer, data, base_rss = build(args, variant, out)
    history = trainer.fit(data)
    policy, reference = trainer.policy, trainer.reference
    trainable = [p for p in policy.model.parameters() if p.requires_grad]
    own = {p.data_ptr() for p in policy.model.parameters()}
    state = trainer.optimizer.optimizer.state if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer.state
    report = {
        "variant": variant,
        "base_parameters": sum(p.numel() for p in policy.model.parameters() if not p.requires_grad or variant == "full"),
        "trainable_parameters": sum(p.numel() for p in trainable),
        "gradient_bytes": tensor_bytes(trainable),  # one fp32 gradient per trainable parameter after backward
        "optimizer_state_bytes": tensor_bytes(v for s in state.values() for v in s.values() if torch.is_tensor(v)),
        "reference_weight_bytes": tensor_bytes(p for p in reference.model.parameters() if p.data_ptr() not in own),
        "peak_rss_growth_mib": peak_rss_mib() - base_rss,
        "step_s": statistics.median(m["timing_s/step"] for m in history[1:]),
        "update_actor_s": statistics.median(m["timing_s/update_actor"] for m in history[1:]),
        "ref_s": statistics.median(m["timing_s/ref"] for m in history[1:]),
        "gen_s": statistics.median(m["timing_s/gen"] for m in history[1:]),
    }
    Path(out, "report.json").write_text(json.dumps(report))


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sync_choices(args) -> dict:
    """Part 2: merged weights vs the adapter alone, for a LoRA policy after one update."""
    import torch

    from rlflow import HFRollout
    from rlflow.data.prompts import collate, load_rows
    from rlflow.models import lora as L
    from rlflow.rollout.weight_sync import sync_weights
    from rlflow.tasks.addition import AdditionTask

    trainer, data, _ = build(args, "lora", str(Path(args.tmp, "sync")))
    trainer.max_steps = 1
    trainer.fit(data)
    policy = trainer.policy.model
    engines = {"merged": L.merged_copy(policy), "adapter": copy.deepcopy(policy)}
    rows = load_rows(AdditionTask().splits()[2][: args.gen_prompts])[0]
    prompts = collate(rows, trainer.policy.tokenizer)
    out, rollouts = {}, {}
    for name, engine in engines.items():
        sync_weights(policy, engine)  # the first, full sync; then what each update changes
        metrics = sync_weights(policy, engine, changed_only=True)
        rollouts[name] = HFRollout(n=4, max_new_tokens=args.new_tokens, do_sample=False)
        rollouts[name].bind(engine, trainer.policy.tokenizer)
        out[name] = {"sync_bytes": metrics["weight_sync/gb"] * 1e9, "sync_buckets": metrics["weight_sync/buckets"],
                     "sync_s": [], "generate_s": []}
    torch.manual_seed(0)
    for _ in range(args.repeats):  # alternating, so that machine noise hits both
        for name, engine in engines.items():
            out[name]["sync_s"].append(timed(lambda e=engine: sync_weights(policy, e, changed_only=True), 1))
            out[name]["generate_s"].append(timed(lambda r=rollouts[name]: r(prompts), 1))
    for row in out.values():
        row["sync_s"], row["generate_s"] = statistics.median(row["sync_s"]), statistics.median(row["generate_s"])
        row["per_step_s"] = row["sync_s"] + row["generate_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step (x 4 samples)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--gen-prompts", type=int, default=16, help="part 2: prompts generated (x 4 samples)")
    ap.add_argument("--repeats", type=int, default=3, help="part 2: timings per engine (median)")
    ap.add_argument("--rounds", type=int, default=3, help="part 1: runs per variant, alternating (median)")
    ap.add_argument("--worker", nargs=2, metavar=("VARIANT", "OUT"))
    ap.add_argument("--tmp", default=None)
    args = ap.parse_args()
    if args.worker:
        worker(args, *args.worker)
        return
    import tempfile

    args.tmp = tempfile.mkdtemp(prefix="lora_bench_")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("worker", "tmp", "rounds")]
    rounds: dict[str, list[dict]] = {"full": [], "lora": []}
    for i in range(args.rounds):  # alternating variants, so that machine noise hits both
        for variant in rounds:
            out = Path(args.tmp, f"{variant}{i}")
            out.mkdir()
            subprocess.run([sys.executable, __file__, *flags, "--worker", variant, str(out)], check=True)
            rounds[variant].append(json.loads((out / "report.json").read_text()))
    full, lora = ({k: (statistics.median(r[k] for r in reports) if isinstance(v, float) else v)
                   for k, v in reports[0].items()} for reports in rounds.values())
    print(f"medians of {args.rounds} rounds; tiny Qwen2: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, {full['base_parameters']:,} "
          f"parameters; LoRA rank {args.rank} on {', '.join(LINEAR)}; {args.prompts} prompts x 4 samples x "
          f"{args.new_tokens} new tokens, PPOLoss with KL, {args.steps} steps")
    keys = ["trainable_parameters", "gradient_bytes", "optimizer_state_bytes", "reference_weight_bytes",
            "peak_rss_growth_mib", "step_s", "update_actor_s", "ref_s", "gen_s"]
    print(f"{'':<24}{'full':>14}{'lora':>14}{'lora/full':>11}")
    ratios = {}
    for key in keys:
        ratios[key] = lora[key] / full[key] if full[key] else None
        ratio = f"{ratios[key]:.3f}" if ratios[key] is not None else "-"
        print(f"{key:<24}{full[key]:>14,.3f}{lora[key]:>14,.3f}{ratio:>11}" if isinstance(full[key], float)
              else f"{key:<24}{full[key]:>14,}{lora[key]:>14,}{ratio:>11}")
    sync = sync_choices(args)
    print(f"\nLoRA weights into an engine ({args.gen_prompts} prompts x 4 samples, greedy, median of {args.repeats})")
    print(f"{'':<10}{'sync bytes':>14}{'sync s':>10}{'generate s':>12}{'sync+gen s':>12}")
    for name, row in sync.items():
        print(f"{name:<10}{row['sync_bytes']:>14,.0f}{row['sync_s']:>10.4f}{row['generate_s']:>12.3f}"
              f"{row['per_step_s']:>12.3f}")
    out = Path(__file__).with_suffix(".json")
    out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k not in ("worker", "tmp")},
                               "full": full, "lora": lora, "ratios": ratios, "sync": sync, "rounds": rounds}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
