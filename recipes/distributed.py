"""GRPO on several processes: FSDP2, token balancing and, optionally, Ulysses sequence parallelism.

    torchrun --nproc_per_node 2 recipes/distributed.py            # 2 CPU processes (gloo), data parallel
    torchrun --nproc_per_node 2 recipes/distributed.py --sp 2     # one group of 2 splitting every sequence
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HEAD:29500 \\
        recipes/distributed.py --accelerator cuda --bf16          # the same code on 16 GPUs

The built-in addition task (the default job's), so it runs anywhere. Every process draws the
same prompt batch and rolls out its share; the Trainer balances tokens across the data-parallel
ranks before the updates; rank 0 logs. See docs/distributed.md.
"""

import argparse
import os

import torch

from rlflow import GRPO, FunctionReward, HFRollout, Policy, PPOLoss, Trainer, Batching, Hardware, Loop, Optim, RunDir
from rlflow.strategies import FSDP2
from rlflow.tasks.addition import AdditionTask, exact_match, warm_started_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--sp", type=int, default=1, help="sequence-parallel group size (Ulysses)")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--bf16", action="store_true", help="bf16 parameters in compute, fp32 gradient reduction")
    p.add_argument("--run-dir", default="runs/distributed")
    args = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", 1))
    task = AdditionTask()
    model, tokenizer = warm_started_model(task, seed=0)
    trainer = Trainer(
        policy=Policy(model, tokenizer, remove_padding=True),  # packed sequences (needed for --sp)
        rollout=HFRollout(n=8, temperature=1.0, max_new_tokens=task.max_new_tokens),
        reward=FunctionReward(exact_match),
        estimator=GRPO(),
        loss=PPOLoss(clip_ratio=0.2),
        optim=Optim(lr=2e-4, weight_decay=0.0),
        batching=Batching(batch_size=32),
        loop=Loop(max_steps=args.steps, val_every=50),
        run=RunDir(path=args.run_dir, loggers=("jsonl",)),
        hardware=Hardware(accelerator=args.accelerator, devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                          num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", 1)),
                          strategy=FSDP2(world, param_dtype=torch.bfloat16 if args.bf16 else None),
                          sequence_parallel_size=args.sp),
    )
    history = trainer.fit(task.data(seed=0))
    key = next(k for k in history[-1] if k.startswith("val-core/"))
    trainer.fabric.print(f"held-out accuracy after {args.steps} steps: {history[-1][key]:.2f}")


if __name__ == "__main__":
    main()
