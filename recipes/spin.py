"""SPIN, self-play fine-tuning (Chen et al. 2024, arXiv 2401.01335), on the built-in task, assembled by hand.

    python recipes/spin.py
    python recipes/spin.py --steps 100 --beta 0.1 --update-reference-every 20

Each prompt's group holds ``n`` samples of the policy and the prompt's real answer
(``WithReferenceResponses``); ``SPINLoss`` raises the real answer's log-ratio against the frozen
reference above each sample's: ``-log sigmoid(beta [(log pi/pi_ref)(real) - (log pi/pi_ref)(sample)])``.
The reward only reports accuracy (SPIN uses none); the advantages are zero (``NoAdvantage``).
``UpdateReference`` makes the policy the new reference every few steps (SPIN's iterations).
"""

import argparse

from rlflow import FunctionReward, HFRollout, Policy, Trainer
from rlflow.algorithms import NoAdvantage, SPINLoss, UpdateReference
from rlflow.rollout import WithReferenceResponses
from rlflow.tasks.addition import AdditionTask, exact_match, warm_started_model
from rlflow.tasks.default_job import ACCURACY_KEY
from rlflow.trainer.options import with_groups


def build(seed: int = 0, steps: int = 40, batch_size: int = 16, n: int = 8, beta: float = 0.1, lr: float = 2e-4,
          update_reference_every: int = 0, run_dir: str = "runs/spin", **trainer_kwargs):
    """The SPIN Trainer on the addition task; returns ``(trainer, data)``."""
    task = AdditionTask()
    model, tokenizer = warm_started_model(task, seed)
    callbacks = [UpdateReference(update_reference_every)] if update_reference_every else []
    trainer = Trainer(
        policy=Policy(model, tokenizer),
        rollout=WithReferenceResponses(HFRollout(n=n, temperature=1.0, max_new_tokens=task.max_new_tokens)),
        reward=FunctionReward(exact_match),  # for the logs only (reference rows score 1)
        estimator=NoAdvantage(),
        loss=SPINLoss(beta=beta),  # reads ref_log_probs: the Trainer builds the frozen reference
        callbacks=callbacks,
        **with_groups(batch_size=batch_size, lr=lr, weight_decay=0.0, max_steps=steps, run_dir=run_dir, seed=seed,
                      **trainer_kwargs),  # -> optim=Optim(...), batching=Batching(...), loop=Loop(...), run=RunDir(...)
    )
    return trainer, task.data(seed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (plus the real answer)")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--update-reference-every", type=int, default=0, help="steps per SPIN iteration (0: never)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default="runs/spin")
    args = p.parse_args()
    trainer, data = build(args.seed, args.steps, args.batch_size, args.n, args.beta, args.lr,
                          args.update_reference_every, args.run_dir)
    before = trainer.validate(data)[ACCURACY_KEY]
    trainer.fit(data)
    print(f"SPIN: held-out accuracy {before:.3f} -> {trainer.validate(data)[ACCURACY_KEY]:.3f}")


if __name__ == "__main__":
    main()
