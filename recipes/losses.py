"""Policy-loss variants on the built-in task, chosen by name, assembled by hand.

    python recipes/losses.py gspo                 # or: ppo cispo sapo clip_cov kl_cov gmpo reinforce
    python recipes/losses.py cispo --steps 100 --mini-batch-size 8

GRPO advantages with the chosen policy loss. Two mini-batches per step by default, so from the
second one on the ratio differs from 1 and each variant's clip / gate / penalty acts (with one
update per step they all reduce to the plain policy gradient). Prints held-out greedy accuracy
before and after.
"""

import argparse

from rlflow import GRPO, FunctionReward, HFRollout, Policy, PPOLoss, Trainer
from rlflow.algorithms import CISPOLoss, ClipCovLoss, GMPOLoss, GSPOLoss, KLCovLoss, ReinforceLoss, SAPOLoss
from rlflow.module import Chain
from rlflow.tasks.addition import AdditionTask, exact_match, warm_started_model
from rlflow.tasks.default_job import ACCURACY_KEY
from rlflow.trainer.options import with_groups

# name -> the loss, with the paper / verl defaults (see docs/algorithms/)
LOSSES = {
    "ppo": lambda: PPOLoss(clip_ratio=0.2),
    "gspo": lambda: GSPOLoss(clip_ratio_low=3e-4, clip_ratio_high=4e-4),  # seq-mean-token-mean
    "cispo": lambda: CISPOLoss(clip_ratio_low=0.2, clip_ratio_high=0.28),
    "sapo": lambda: SAPOLoss(tau_pos=1.0, tau_neg=1.05),
    "clip_cov": lambda: ClipCovLoss(clip_cov_ratio=2e-4, clip_cov_lb=1.0, clip_cov_ub=5.0),
    "kl_cov": lambda: KLCovLoss(kl_cov_ratio=2e-4, ppo_kl_coef=1.0),
    "gmpo": lambda: GMPOLoss(clip_ratio_low=0.4, clip_ratio_high=0.4),
    "reinforce": lambda: ReinforceLoss(),
}


def build(name: str, seed: int = 0, steps: int = 40, batch_size: int = 16, n: int = 8, mini_batch_size: int | None = 8,
          lr: float = 1e-4, run_dir: str = "runs/losses", **trainer_kwargs):
    """The Trainer for loss ``name`` on the addition task; returns ``(trainer, data)``."""
    task = AdditionTask()
    model, tokenizer = warm_started_model(task, seed)
    loss = LOSSES[name]()
    estimator = GRPO()
    if hasattr(loss, "selection"):  # Clip-Cov / KL-Cov choose their tokens once per step, over the whole batch
        estimator = Chain(GRPO(), loss.selection())
    trainer = Trainer(
        policy=Policy(model, tokenizer),
        rollout=HFRollout(n=n, temperature=1.0, max_new_tokens=task.max_new_tokens),
        reward=FunctionReward(exact_match),
        estimator=estimator,
        loss=loss,
        **with_groups(batch_size=batch_size, mini_batch_size=mini_batch_size, lr=lr, weight_decay=0.0, max_steps=steps,
                      run_dir=f"{run_dir}/{name}", seed=seed, **trainer_kwargs),  # -> optim=Optim(...), ...
    )
    return trainer, task.data(seed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("loss", choices=sorted(LOSSES))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16, help="prompts per step")
    p.add_argument("--mini-batch-size", type=int, default=8, help="prompts per optimizer step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default="runs/losses")
    args = p.parse_args()
    trainer, data = build(args.loss, args.seed, args.steps, args.batch_size, args.n, args.mini_batch_size, args.lr,
                          args.run_dir)
    before = trainer.validate(data)[ACCURACY_KEY]
    trainer.fit(data)
    print(f"{args.loss}: held-out accuracy {before:.3f} -> {trainer.validate(data)[ACCURACY_KEY]:.3f}")


if __name__ == "__main__":
    main()
