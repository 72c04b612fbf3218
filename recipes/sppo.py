"""SPPO, self-play preference optimization (Wu et al. 2024, arXiv 2405.00675), on the built-in task.

    python recipes/sppo.py
    python recipes/sppo.py --eta 4 --update-reference-every 5 --mini-batch-size 8

Each sample's win rate against its group, ``P_hat(y > pi)``, is read off the rewards
(``GroupWinRate``); ``SPPOLoss`` regresses the sample's log-ratio to the reference onto
``eta (P_hat - 1/2)``. ``UpdateReference(1)`` makes the policy that sampled the batch the reference,
so every step is one SPPO iteration ``pi_t -> pi_t+1``; with a reference frozen for many steps the
squared loss mostly pulls the drifted samples back to it and the task is not learned.
"""

import argparse

from rlflow import FunctionReward, HFRollout, Policy, Trainer
from rlflow.algorithms import GroupWinRate, SPPOLoss, UpdateReference
from rlflow.tasks.addition import AdditionTask, exact_match, warm_started_model
from rlflow.tasks.default_job import ACCURACY_KEY
from rlflow.trainer.options import with_groups


def build(seed: int = 0, steps: int = 40, batch_size: int = 16, n: int = 8, eta: float = 4.0, lr: float = 2e-4,
          update_reference_every: int = 1, run_dir: str = "runs/sppo", **trainer_kwargs):
    """The SPPO Trainer on the addition task; returns ``(trainer, data)``."""
    task = AdditionTask()
    model, tokenizer = warm_started_model(task, seed)
    callbacks = [UpdateReference(update_reference_every)] if update_reference_every else []
    trainer = Trainer(
        policy=Policy(model, tokenizer),
        rollout=HFRollout(n=n, temperature=1.0, max_new_tokens=task.max_new_tokens),
        reward=FunctionReward(exact_match),
        estimator=GroupWinRate(),
        loss=SPPOLoss(eta=eta),  # reads ref_log_probs: the Trainer builds the frozen reference
        callbacks=callbacks,
        **with_groups(batch_size=batch_size, lr=lr, weight_decay=0.0, max_steps=steps, run_dir=run_dir, seed=seed,
                      **trainer_kwargs),  # -> optim=Optim(...), batching=Batching(...), loop=Loop(...), run=RunDir(...)
    )
    return trainer, task.data(seed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--eta", type=float, default=4.0)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--update-reference-every", type=int, default=1, help="steps per SPPO iteration (0: never)")
    p.add_argument("--mini-batch-size", type=int, default=None, help="prompts per optimizer step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default="runs/sppo")
    args = p.parse_args()
    trainer, data = build(args.seed, args.steps, args.batch_size, args.n, args.eta, args.lr,
                          args.update_reference_every, args.run_dir, mini_batch_size=args.mini_batch_size)
    before = trainer.validate(data)[ACCURACY_KEY]
    trainer.fit(data)
    print(f"SPPO: held-out accuracy {before:.3f} -> {trainer.validate(data)[ACCURACY_KEY]:.3f}")


if __name__ == "__main__":
    main()
