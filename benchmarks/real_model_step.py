"""One GRPO step of the Workflow 1 recipe on SmolLM2-135M-Instruct: per-phase times, HF vs vLLM generation.

    python benchmarks/real_model_step.py [--rounds 3] [--steps 2] [--threads 1] [--engines hf vllm vllm-packed]

The recipe's setup (docs/workflow1.md): the seed's ``config/grpo_math.yaml`` with the recipe's CPU overrides
(8 prompts x 4 samples, <= 32 new tokens, KL loss against a frozen reference, AdamW lr 1e-5, no gradient
checkpointing, the padded layout in which a prompt's samples share one pass over it), its data
(recipes/workflow1/prepare_data.py) and reward (recipes/workflow1/reward_function.py), built through the verl
entry point's own path (``load_config`` -> ``make_plan`` -> ``build_trainer``). Variants: ``hf``
(``rollout.name=hf``), ``vllm`` (the YAML's ``rollout.name: vllm``; float32, eager) and ``vllm-packed`` (vLLM
with verl's default ``use_remove_padding=true``: every sample runs its own copy of the prompt).

Each variant lives in a worker process of its own, built once and warmed up by one step that is not counted;
then ``--rounds`` rounds run ``--steps`` steps on each variant in turn (the order rotates), so that machine
load falls on all alike. Reported per variant: the median of each ``timing_s/*`` phase over all measured
steps, the update's achieved FLOP/s and the process's peak RSS.

Achieved FLOP/s of the update = 6 x N x T / t_update: N the policy's parameters (134.5M, the tied embedding
counted once), T the tokens the update's forward and backward run on (packed: every sample's prompt and
response tokens; shared prompts: each distinct prompt once at its padded length plus every row's fed response
tokens; see ``TokenCount``), t_update ``timing_s/update_actor`` (forward + backward + AdamW step). 6 N T is the
usual forward (2 N T) + backward (4 N T) estimate: it leaves out attention scores (small at ~100 tokens per
sequence) and counts the embedding lookup as a matmul. The peak it is compared with is this CPU's float32
``torch.mm`` (2048 x 2048 x 2048, best of 10, at the same thread count), measured by this script at the start
and at the end. Writes benchmarks/real_model_step.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "workflow1"
PHASES = ("gen", "reward", "ref", "adv", "update_actor", "update_weights", "step")


VLLM_KEYS = ["actor_rollout_ref.rollout.dtype=float32", "actor_rollout_ref.rollout.enforce_eager=true"]
VARIANTS = {  # the recipe's engine keys, and one layout variant
    "hf": ["actor_rollout_ref.rollout.name=hf"],
    "vllm": VLLM_KEYS,
    "vllm-packed": VLLM_KEYS + ["actor_rollout_ref.model.use_remove_padding=true"],  # verl's default layout
}


def overrides(variant: str, data: Path, model: Path, run_dir: Path) -> list[str]:
    """The recipe's command-line overrides (recipes/workflow1/run.sh), for one variant."""
    return [
        f"data.train_files={data}/train.parquet", f"data.val_files={data}/val.parquet",
        f"actor_rollout_ref.model.path={model}", f"custom_reward_function.path={RECIPE}/reward_function.py",
        "custom_reward_function.name=compute_reward", "trainer.device=cpu", "trainer.n_gpus_per_node=1",
        "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=4",
        "data.max_prompt_length=96", "data.max_response_length=32", "actor_rollout_ref.actor.optim.lr=1e-5",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false", "actor_rollout_ref.model.use_remove_padding=false",
        "trainer.logger=[console]", f"trainer.default_local_dir={run_dir}", "trainer.save_freq=-1", *VARIANTS[variant],
    ]


def mm_peak(threads: int, size: int = 2048, repeats: int = 10) -> float:
    """Best float32 ``torch.mm`` FLOP/s of ``size``^3 at ``threads`` threads."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class TokenCount:
    """Tokens the update's forward/backward runs on, from the rollout's batch: packed, every sample's prompt +
    response tokens; padded with shared prompts (``rlflow.models.shared_prompt``), each distinct prompt once
    (its padded length) + every row's fed response tokens (the last one is not fed)."""

    def __init__(self):
        self.executed = 0

    def on_rollout_end(self, trainer, batch):
        from rlflow.data import keys as K
        from rlflow.models.shared_prompt import can_share

        prompt_mask, response = batch[K.PROMPT_MASK], batch[K.RESPONSE_IDS]
        if trainer.policy.remove_padding:
            self.executed = int(prompt_mask.sum() + batch[K.RESPONSE_MASK].sum())
        elif trainer.policy.share_prompts and can_share(trainer.policy.model):
            groups = len(batch[K.GROUP].unique())
            self.executed = groups * prompt_mask.shape[1] + response.shape[0] * (response.shape[1] - 1)
        else:
            self.executed = prompt_mask.numel() + response.shape[0] * (response.shape[1] - 1)


def worker(engine: str, data: str, model: str, run_dir: str, conn) -> None:
    """Build the recipe's Trainer with ``engine``; on ("steps", k) run k steps and send their metrics."""
    from rlflow.config import load_config, make_plan
    from rlflow.config.verl.build import build_trainer
    from rlflow.data.nontensor import to_device

    t0 = time.perf_counter()
    cfg = load_config(overrides(engine, Path(data), Path(model), Path(run_dir)),
                      config_file=ROOT / "examples" / "config" / "grpo_math.yaml")
    trainer, prompts = build_trainer(make_plan(cfg))
    tokens = TokenCount()
    trainer.fabric._callbacks.append(tokens)  # Fabric.call reads this list
    trainer.fabric.seed_everything(1, verbose=False)
    loader = prompts.loader(trainer.batch_size, trainer.policy.tokenizer)
    setup = {"setup_s": time.perf_counter() - t0, "rss_after_setup_gib": peak_rss_gib(),
             "parameters": sum(p.numel() for p in trainer.policy.model.parameters()),
             "remove_padding": bool(getattr(trainer.policy, "remove_padding", False))}
    conn.send(setup)
    while True:
        command, k = conn.recv()
        if command == "stop":
            conn.send({"peak_rss_gib": peak_rss_gib()})
            return
        steps = []
        for _ in range(k):
            metrics = trainer.step(to_device(next(loader), trainer.fabric.device))
            steps.append({key: v for key, v in metrics.items() if key.startswith(("timing_s/", "perf/"))}
                         | {"executed_tokens": tokens.executed, "load_1min": os.getloadavg()[0],
                            "peak_rss_gib": peak_rss_gib()})
        conn.send(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="measured steps per engine per round")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads in every process (pinned; 1 is what rlflow picks on 2 cores other jobs keep busy)")
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=list(VARIANTS),
                        help="vllm-packed: vLLM with verl's packed layout (use_remove_padding=true)")
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = parser.parse_args()
    os.environ["RLFLOW_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the workers inherit it
    sys.path.insert(0, str(RECIPE))
    import prepare_data

    from rlflow.models.gguf import smollm2_folder

    tmp = Path(tempfile.mkdtemp(prefix="rlflow-real-step-"))
    data = prepare_data.main(["--out", str(tmp / "data")])
    model = smollm2_folder()
    report = {"cpus": os.cpu_count(), "threads": args.threads, "rounds": args.rounds, "steps": args.steps,
              "load_average_at_start": os.getloadavg(), "mm_fp32_flops": [mm_peak(args.threads)], "engines": {}}
    ctx = mp.get_context("spawn")
    workers = {}
    for engine in args.engines:  # all built (and warmed up) before any step is timed
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(engine, str(data), str(model), str(tmp / engine), theirs))
        proc.start()
        workers[engine] = (proc, ours)
        report["engines"][engine] = ours.recv() | {"steps": []}
        ours.send(("steps", 1))
        report["engines"][engine]["warmup"] = ours.recv()[0]
        print(f"{engine}: set up in {report['engines'][engine]['setup_s']:.0f} s, warm-up step "
              f"{report['engines'][engine]['warmup']['timing_s/step']:.0f} s", flush=True)
    for r in range(args.rounds):
        order = args.engines[r % len(args.engines):] + args.engines[: r % len(args.engines)]
        for engine in order:
            _, conn = workers[engine]
            conn.send(("steps", args.steps))
            steps = conn.recv()
            report["engines"][engine]["steps"] += [m | {"round": r + 1} for m in steps]
            print(f"round {r + 1} {engine:11s} " + "  ".join(f"{m['timing_s/step']:.1f} s" for m in steps)
                  + f"  (load {steps[-1]['load_1min']:.1f})", flush=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")  # a run stopped early keeps its rounds
    for engine, (proc, conn) in workers.items():
        conn.send(("stop", 0))
        report["engines"][engine] |= conn.recv()
        proc.join()
    report["mm_fp32_flops"].append(mm_peak(args.threads))
    report["load_average_at_end"] = os.getloadavg()
    summarize(report)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


def summarize(report: dict) -> None:
    """Medians per variant and phase, FLOP/s, memory, and vLLM / HF per round; printed and added to ``report``."""
    peak = max(report["mm_fp32_flops"])
    print(f"\nmedian s per step over {report['rounds']} rounds x {report['steps']} steps ({report['threads']} threads; "
          f"load average {report['load_average_at_start'][0]:.1f} at start, {report['load_average_at_end'][0]:.1f} at end)")
    print(f"{'variant':11s} " + " ".join(f"{p:>14s}" for p in PHASES) + f" {'update GFLOP/s':>15s} {'of mm peak':>10s}"
          f" {'peak RSS GiB':>12s}")
    for engine, res in report["engines"].items():
        steps = res["steps"]
        med = {p: statistics.median(m.get(f"timing_s/{p}", 0.0) for m in steps) for p in PHASES}
        flops = [6 * res["parameters"] * m["executed_tokens"] / m["timing_s/update_actor"] for m in steps]
        res["median_s"], res["update_flops"] = med, statistics.median(flops)
        res["executed_tokens"] = statistics.median(m["executed_tokens"] for m in steps)
        res["sample_tokens"] = statistics.median(m["perf/total_num_tokens"] for m in steps)
        res["round_step_s"] = [statistics.median(m["timing_s/step"] for m in steps if m["round"] == r)
                               for r in sorted({m["round"] for m in steps})]
        print(f"{engine:11s} " + " ".join(f"{med[p]:14.2f}" for p in PHASES)
              + f" {res['update_flops'] / 1e9:15.1f} {res['update_flops'] / peak:10.0%} {res['peak_rss_gib']:12.2f}")
    print(f"torch.mm float32 peak: {', '.join(f'{f / 1e9:.1f}' for f in report['mm_fp32_flops'])} GFLOP/s "
          "(start, end); tokens per step the update runs on / in the samples (medians): "
          + ", ".join(f"{e} {r['executed_tokens']:.0f} / {r['sample_tokens']:.0f}" for e, r in report["engines"].items()))
    engines = report["engines"]
    for other in ("vllm", "vllm-packed"):
        base = "hf" if other == "vllm" else "vllm"
        if {base, other} <= set(engines):  # ratios within a round share its load
            ratios = [b / a for a, b in zip(engines[base]["round_step_s"], engines[other]["round_step_s"])]
            report[f"{other} / {base} step, median of rounds"] = statistics.median(ratios)
            print(f"{other} / {base}: step {statistics.median(ratios):.2f} (median of the rounds' ratios), generation "
                  f"{engines[other]['median_s']['gen'] / engines[base]['median_s']['gen']:.2f} (medians)")


if __name__ == "__main__":
    main()
