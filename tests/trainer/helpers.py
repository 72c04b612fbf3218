"""Small builders shared by the trainer tests: a tiny model on the addition task."""

import copy

from rlflow import GAE, GRPO, Critic, FunctionReward, HFRollout, Policy, PPOLoss, PromptData, Trainer, ValueLoss


def starts_with_digit(solution_str: str, ground_truth: str) -> float:
    """A reward a random tiny model earns often enough to give every step a learning signal."""
    return float(solution_str[:1].isdigit())


def make_trainer(model, tokenizer, rows, run_dir, *, ppo=False, loss=None, estimator=None, **kwargs):
    train, val = rows
    defaults = dict(batch_size=8, lr=1e-3, max_steps=2, run_dir=run_dir, progress=False, seed=0)
    extra = {}
    if ppo:
        extra = dict(critic=Critic(copy.deepcopy(model)), value_loss=ValueLoss(), critic_lr=1e-3)
    trainer = Trainer(
        policy=Policy(copy.deepcopy(model), tokenizer),
        rollout=HFRollout(n=4, max_new_tokens=4),
        reward=FunctionReward(starts_with_digit),
        estimator=estimator or (GAE(gamma=1.0, lam=0.95) if ppo else GRPO()),
        loss=loss or PPOLoss(),
        **extra, **(defaults | kwargs),
    )
    return trainer, PromptData(train, val=val, seed=0)


def params(module):
    return [p.detach().clone() for p in module.parameters()]


def comparable(metrics):
    """Metrics that must repeat exactly between identical runs (not wall-clock ones)."""
    return {k: v for k, v in metrics.items() if not k.startswith(("timing_s/", "perf/throughput", "perf/time_per_step"))}
