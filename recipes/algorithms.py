"""Every critic-free advantage estimator on the built-in addition task, chosen by name.

    python recipes/algorithms.py --estimator rloo
    python recipes/algorithms.py --estimator rloo+kl_in_reward --steps 100
    python recipes/algorithms.py --list

Each entry below is the plain-Python assembly of one algorithm (estimator, and the loss it
is meant to run with); the rest of the job is the same for all. The name -> modules table is
the only string dispatch, here at the edge. Prints the mean batch reward of the first and the
last 10 steps and held-out greedy accuracy before and after.
"""

import argparse

from rlflow import Batching, FunctionReward, HFRollout, Loop, Optim, Policy, RunDir, Trainer
from rlflow.algorithms import (
    GPG,
    GRPO,
    OPO,
    RLOO,
    AdaptiveKLController,
    DrGRPO,
    GreedyBaseline,
    GRPOPassK,
    KLInReward,
    PPOLoss,
    ReinforcePlusPlus,
    ReinforcePlusPlusBaseline,
    ReMax,
    TruncatedIS,
)
from rlflow.module import Chain
from rlflow.tasks.addition import AdditionTask, exact_match, warm_started_model
from rlflow.tasks.default_job import ACCURACY_KEY

# name -> (rollout -> (estimator, loss)). The rollout is passed for ReMax, whose greedy baseline
# re-generates with the same engine the batch was sampled from.
ALGORITHMS = {
    "grpo": lambda rollout: (GRPO(), PPOLoss(clip_ratio=0.2)),
    # Dr.GRPO: no std normalisation, a constant length normaliser, no KL term.
    "drgrpo": lambda rollout: (DrGRPO(), PPOLoss(clip_ratio=0.2, agg="seq-mean-token-sum-norm")),
    "rloo": lambda rollout: (RLOO(), PPOLoss(clip_ratio=0.2)),
    "reinforce_pp": lambda rollout: (ReinforcePlusPlus(gamma=1.0), PPOLoss(clip_ratio=0.2)),
    "reinforce_pp_baseline": lambda rollout: (ReinforcePlusPlusBaseline(), PPOLoss(clip_ratio=0.2)),
    # ReMax: a greedy sample per prompt, scored by a reward instance of its own, is the baseline.
    "remax": lambda rollout: (
        Chain(GreedyBaseline(rollout, FunctionReward(exact_match)), ReMax()), PPOLoss(clip_ratio=0.2)),
    "opo": lambda rollout: (OPO(), PPOLoss(clip_ratio=0.2)),
    "gpg": lambda rollout: (GPG(), PPOLoss(clip_ratio=0.2)),
    "grpo_passk": lambda rollout: (GRPOPassK(), PPOLoss(clip_ratio=0.2)),
    # KL to the reference subtracted from the token rewards, with verl's adaptive coefficient. RLOO, not
    # GRPO: GRPO divides by the group std, which turns the KL term of an all-equal group into full-size
    # advantages (see docs/algorithms/kl.md).
    "rloo+kl_in_reward": lambda rollout: (
        Chain(KLInReward(AdaptiveKLController(init_coef=0.01, target_kl=0.01, horizon=1000)), RLOO()),
        PPOLoss(clip_ratio=0.2)),
    # Truncated importance weights between the sampler's and the trainer's log-probs.
    "grpo+truncated_is": lambda rollout: (
        Chain(TruncatedIS(level="token", threshold=2.0), GRPO()), PPOLoss(clip_ratio=0.2, is_weights=True)),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--estimator", default="grpo", choices=sorted(ALGORITHMS), metavar="NAME",
                   help=f"one of: {', '.join(ALGORITHMS)}")
    p.add_argument("--list", action="store_true", help="print the names and exit")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=16, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default=None, help="default: runs/<estimator>")
    args = p.parse_args()
    if args.list:
        print("\n".join(ALGORITHMS))
        return

    task = AdditionTask()
    model, tokenizer = warm_started_model(task, args.seed)
    rollout = HFRollout(n=args.n, temperature=1.0, max_new_tokens=task.max_new_tokens)
    estimator, loss = ALGORITHMS[args.estimator](rollout)
    trainer = Trainer(
        policy=Policy(model, tokenizer, temperature=1.0),
        rollout=rollout,
        reward=FunctionReward(exact_match),
        estimator=estimator,
        loss=loss,
        optim=Optim(lr=args.lr, weight_decay=0.0),
        batching=Batching(batch_size=args.batch_size),
        loop=Loop(max_steps=args.steps, seed=args.seed),
        run=RunDir(path=args.run_dir or f"runs/{args.estimator}"),
    )
    data = task.data(args.seed)
    before = trainer.validate(data)[ACCURACY_KEY]
    history = trainer.fit(data)
    after = trainer.validate(data)[ACCURACY_KEY]
    scores = [m["critic/score/mean"] for m in history]
    k = min(10, len(scores))
    print(f"{args.estimator}: {estimator!r} + {loss!r}")
    print(f"mean batch reward, first {k} steps -> last {k}: {sum(scores[:k]) / k:.3f} -> {sum(scores[-k:]) / k:.3f}")
    print(f"held-out accuracy: {before:.2f} -> {after:.2f}")


if __name__ == "__main__":
    main()
