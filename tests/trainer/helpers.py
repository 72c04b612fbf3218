"""Small builders shared by the trainer tests: a tiny model on the addition task."""

import copy

from rlflow import GAE, GRPO, Critic, FunctionReward, HFRollout, Policy, PPOLoss, PromptData, Trainer, ValueLoss
from rlflow.trainer.options import FLAT, groups


def starts_with_digit(solution_str: str, ground_truth: str) -> float:
    """A reward a random tiny model earns often enough to give every step a learning signal."""
    return float(solution_str[:1].isdigit())


def make_trainer(model, tokenizer, rows, run_dir, *, ppo=False, loss=None, estimator=None, **kwargs):
    """A GRPO (or, with ``ppo``, GAE + critic) Trainer on the tiny model; ``kwargs``: the Trainer's arguments, with
    the groups' fields also accepted one by one (``lr=...``), sorted into their group here
    (``rlflow.trainer.options.groups``); a group passed whole (``batching=Batching(...)``) replaces the helper's."""
    train, val = rows
    settings = dict(batch_size=8, lr=1e-3, max_steps=2, run_dir=run_dir, progress=False, seed=0)
    settings |= {k: kwargs.pop(k) for k in list(kwargs) if k in FLAT}
    extra = {}
    if ppo:
        extra = dict(critic=Critic(copy.deepcopy(model)), value_loss=ValueLoss())
        settings = {"critic_lr": 1e-3} | settings
    trainer = Trainer(
        policy=Policy(copy.deepcopy(model), tokenizer),
        rollout=HFRollout(n=4, max_new_tokens=4),
        reward=FunctionReward(starts_with_digit),
        estimator=estimator or (GAE(gamma=1.0, lam=0.95) if ppo else GRPO()),
        loss=loss or PPOLoss(),
        **extra | groups(**settings) | kwargs,
    )
    return trainer, PromptData(train, val=val, seed=0)


def params(module):
    return [p.detach().clone() for p in module.parameters()]


def comparable(metrics):
    """Metrics that must repeat exactly between identical runs (not wall-clock ones)."""
    return {k: v for k, v in metrics.items() if not k.startswith(("timing_s/", "perf/throughput", "perf/time_per_step"))}
