"""DAPO (Yu et al. 2025, arXiv 2503.14476) on the built-in task, assembled by hand.

    python recipes/dapo.py
    python recipes/dapo.py --steps 100 --max-gen-batches 20

All four parts of DAPO:

1. clip-higher: ``PPOLoss(clip_ratio_low=0.2, clip_ratio_high=0.28)``;
2. dynamic sampling: the experience stream's ``FilterGroups`` stage drops prompts whose samples are all right
   or all wrong and pulls more prompt batches from the stream until the batch is full;
3. token-level loss: ``agg="token-mean"``;
4. overlong reward shaping: ``OverlongPenalty`` (here the answer needs at most 4 tokens; responses may run
   to 6, and the last 2 of them cost up to 1.0).

No KL term (``kl_coef=0``, so no reference model). Prints held-out greedy accuracy before and after.
"""

import argparse

from rlflow import GRPO, FunctionReward, HFRollout, Policy, PPOLoss, Trainer
from rlflow.rewards import OverlongPenalty
from rlflow.rollout.stream import FilterGroups
from rlflow.tasks.addition import AdditionTask, exact_match, greedy_accuracy, warm_started_model
from rlflow.trainer.options import with_groups

MAX_RESPONSE_LENGTH, OVERLONG_BUFFER = 6, 2


def build(seed: int = 0, steps: int = 40, batch_size: int = 16, n: int = 8, lr: float = 2e-4,
          max_gen_batches: int = 10, run_dir: str = "runs/dapo", **trainer_kwargs):
    """The DAPO Trainer on the addition task; returns ``(trainer, data)``."""
    task = AdditionTask()
    model, tokenizer = warm_started_model(task, seed)
    reward = OverlongPenalty(FunctionReward(exact_match), max_response_length=MAX_RESPONSE_LENGTH,
                             buffer_len=OVERLONG_BUFFER, penalty_factor=1.0)
    trainer = Trainer(
        policy=Policy(model, tokenizer),
        rollout=HFRollout(n=n, temperature=1.0, max_new_tokens=MAX_RESPONSE_LENGTH),
        reward=reward,
        # verl's usual filter_groups.metric: "acc", the unshaped score
        stages=[FilterGroups(metric="acc", max_gen_batches=max_gen_batches)],
        estimator=GRPO(),
        loss=PPOLoss(clip_ratio_low=0.2, clip_ratio_high=0.28, agg="token-mean", kl_coef=0.0),
        **with_groups(batch_size=batch_size, lr=lr, weight_decay=0.0, max_steps=steps, run_dir=run_dir, seed=seed,
                      **trainer_kwargs),  # -> optim=Optim(...), batching=Batching(...), loop=Loop(...), run=RunDir(...)
    )
    return trainer, task.data(seed)


def held_out_accuracy(trainer) -> float:
    """Greedy exact-match accuracy on the task's held-out prompts."""
    _, _, test = AdditionTask().splits()
    return greedy_accuracy(trainer.policy.model, trainer.policy.tokenizer, test, max_new_tokens=MAX_RESPONSE_LENGTH)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16, help="prompts per step, after filtering")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--max-gen-batches", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default="runs/dapo")
    args = p.parse_args()
    trainer, data = build(args.seed, args.steps, args.batch_size, args.n, args.lr, args.max_gen_batches, args.run_dir)
    before = held_out_accuracy(trainer)
    history = trainer.fit(data)
    rounds = sum(m["dapo/num_gen_batches"] for m in history) / len(history)
    print(f"DAPO: held-out accuracy {before:.3f} -> {held_out_accuracy(trainer):.3f}; "
          f"{rounds:.2f} generation batches per step on average")


if __name__ == "__main__":
    main()
