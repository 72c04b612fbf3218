"""Every estimator raises the batch reward on the built-in task (the default job, shortened).

Each case runs the default job's modules with its own estimator (and loss) from the same
warm start and asserts that the mean batch reward of the last 10 steps exceeds that of the
first 10 by ``MARGIN``. Margins measured over seeds 0-3 are in the report of the change that
added this file; ``MARGIN`` sits well below the smallest.
"""

import pytest

from rlflow import FunctionReward, HFRollout
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
from rlflow.tasks.addition import AdditionTask, exact_match
from rlflow.tasks.default_job import build_trainer

STEPS, BATCH, N, LR = 40, 16, 8, 2e-4
MARGIN = 0.03


def greedy_rollout():
    # GreedyBaseline needs the engine the batch is sampled from; build_trainer makes its own
    # rollout, so this one is bound to the same policy model once the trainer exists.
    return HFRollout(max_new_tokens=AdditionTask().max_new_tokens)


CASES = {
    "grpo": lambda g: (GRPO(), None),
    "drgrpo": lambda g: (DrGRPO(), PPOLoss(agg="seq-mean-token-sum-norm")),
    "rloo": lambda g: (RLOO(), None),
    "reinforce_pp": lambda g: (ReinforcePlusPlus(), None),
    "reinforce_pp_baseline": lambda g: (ReinforcePlusPlusBaseline(), None),
    "remax": lambda g: (Chain(GreedyBaseline(g, FunctionReward(exact_match)), ReMax()), None),
    "opo": lambda g: (OPO(), None),
    "gpg": lambda g: (GPG(), None),
    "grpo_passk": lambda g: (GRPOPassK(k=N), None),
    "grpo+kl_in_reward": lambda g: (
        Chain(KLInReward(AdaptiveKLController(init_coef=0.01, target_kl=0.01, horizon=1000)), GRPO()), None),
    "grpo+truncated_is": lambda g: (Chain(TruncatedIS(level="token"), GRPO()), PPOLoss(is_weights=True)),
}


def run_case(name, run_dir, seed=0, steps=STEPS, batch_size=BATCH, n=N, lr=LR):
    """Train ``name`` on the built-in task; returns (history, estimator)."""
    greedy = greedy_rollout()
    estimator, loss = CASES[name](greedy)
    trainer, data = build_trainer(seed=seed, steps=steps, run_dir=run_dir, batch_size=batch_size, n=n, lr=lr,
                                  progress=False, loggers=(), estimator=estimator, loss=loss)
    greedy.bind(trainer.rollout.model, trainer.policy.tokenizer)
    return trainer.fit(data), estimator


def mean_reward(history):
    scores = [m["critic/score/mean"] for m in history]
    return sum(scores[:10]) / 10, sum(scores[-10:]) / 10


@pytest.mark.parametrize("name", list(CASES))
def test_estimator_raises_reward(name, tmp_path):
    history, estimator = run_case(name, tmp_path)
    first, last = mean_reward(history)
    assert last > first + MARGIN, (name, first, last)
    if name == "grpo+kl_in_reward":
        controller = estimator.modules[0].controller
        assert controller.value != 0.01 and estimator.modules[0].stats["actor/reward_kl_penalty"] != 0
    if name == "grpo+truncated_is":
        assert estimator.modules[0].stats["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0  # on-policy
    if name == "remax":
        assert 0 <= estimator.modules[0].stats["remax/greedy_score/mean"] <= 1
