"""Every estimator raises the batch reward on the built-in task (the default job, shortened).

Each case runs the default job's modules with its own estimator (and loss) from the same
warm start, 80 steps of 16 prompts x 8 samples (about 10 s each on two idle cores), and
asserts that the mean batch reward of the last 10 steps exceeds that of the first 10 by
``MARGIN``. Measured from the shipped seed-0 warm start and three 1e-4 jitters of it
(``python scripts/learning_spread.py -- tests/algorithms/test_learning.py``, 2-core AMD EPYC): the rise
was 0.025-0.074 over the ten cases and four runs (smallest: RLOO 0.025, GRPO pass@k 0.028, RLOO with KL in
the reward 0.031); ``MARGIN`` is half the smallest. Held-out greedy accuracy is not asserted here: at
16 prompts a step it rose by as little as 0.008 (RLOO) in one of those runs.

Why 80 steps: the learning rate is constant, so the first S steps of a run are the S-step run (checked equal for
GRPO at 20). Re-measured with the same four runs (same figures at 80 steps), the smallest rise over the cases
truncated to 70 steps was 0.013 (GRPO pass@k), to 60 steps 0.002 (GRPO pass@k, OPO), to 50 steps 0.008 (GRPO
pass@k), to 40 steps -0.008 (OPO): all under twice ``MARGIN``, so a shorter test would not hold.

ReMax runs under the partial-credit reward ``digit_match`` (``test_remax_raises_partial_credit_reward``):
with 0/1 exact match no CPU-cheap setting gains on all three warm-start seeds. Its advantage
``s - greedy score`` is not centred: the greedy answer is right 2-3x as often as a sample at
temperature 1, so most samples are pushed down at once and with 0/1 rewards the reward first dips
(docs/algorithms/remax.md). With ``digit_match`` (its greedy baseline scored with it too) the batch
reward rises, but slowly: over 10-step windows by 0.010-0.032 in the four runs above, over 20-step windows
(the test's, less noisy) by 0.031-0.046 (``REMAX_MARGIN`` is half the smallest); ReMax raises the reward
it is trained on, it does not reliably raise exact-match accuracy here. Its pieces are tested in test_advantages.py.
"""

import pytest

from rlflow.algorithms import (
    GPG,
    GRPO,
    OPO,
    RLOO,
    AdaptiveKLController,
    DrGRPO,
    GRPOPassK,
    KLInReward,
    PPOLoss,
    ReinforcePlusPlus,
    ReinforcePlusPlusBaseline,
    TruncatedIS,
)
from rlflow.algorithms import GreedyBaseline, ReMax
from rlflow.module import Chain
from rlflow.rewards import FunctionReward
from rlflow.rollout.hf import HFRollout
from rlflow.tasks.addition import AdditionTask, digit_match
from rlflow.tasks.default_job import build_trainer

STEPS, BATCH, N, LR = 80, 16, 8, 2e-4
MARGIN = 0.012
REMAX_WINDOW, REMAX_MARGIN = 20, 0.015

CASES = {  # name -> (estimator, loss or None for the default job's PPOLoss(clip_ratio=0.2))
    "grpo": lambda: (GRPO(), None),
    "drgrpo": lambda: (DrGRPO(), PPOLoss(agg="seq-mean-token-sum-norm")),
    "rloo": lambda: (RLOO(), None),
    "reinforce_pp": lambda: (ReinforcePlusPlus(), None),
    "reinforce_pp_baseline": lambda: (ReinforcePlusPlusBaseline(), None),
    "opo": lambda: (OPO(), None),
    "gpg": lambda: (GPG(), None),
    "grpo_passk": lambda: (GRPOPassK(k=N), None),
    # KL in the reward pairs with RLOO (as in the RLOO paper), not GRPO: GRPO's division by the group
    # std blows the KL term of an all-equal group up to unit-size advantages (docs/algorithms/kl.md).
    "rloo+kl_in_reward": lambda: (
        Chain(KLInReward(AdaptiveKLController(init_coef=0.01, target_kl=0.01, horizon=1000)), RLOO()), None),
    "grpo+truncated_is": lambda: (Chain(TruncatedIS(level="token"), GRPO()), PPOLoss(is_weights=True)),
}


def run_case(name, run_dir, seed=0, steps=STEPS, batch_size=BATCH, n=N, lr=LR):
    """Train ``name`` on the built-in task; returns (history, estimator)."""
    estimator, loss = CASES[name]()
    trainer, data = build_trainer(seed=seed, steps=steps, run_dir=run_dir, batch_size=batch_size, n=n, lr=lr,
                                  progress=False, loggers=(), estimator=estimator, loss=loss)
    return trainer.fit(data), estimator


def mean_reward(history, k=10):
    scores = [m["critic/score/mean"] for m in history]
    return sum(scores[:k]) / k, sum(scores[-k:]) / k


@pytest.mark.learning
@pytest.mark.parametrize("name", list(CASES))
def test_estimator_raises_reward(name, tmp_path, record_property):
    history, estimator = run_case(name, tmp_path)
    first, last = mean_reward(history)
    record_property("reward_rise", last - first)
    assert last > first + MARGIN, (name, first, last)
    if name == "rloo+kl_in_reward":  # the penalty was applied and the adaptive coefficient moved
        assert history[-1]["actor/reward_kl_penalty"] > 0
        assert history[-1]["actor/reward_kl_penalty_coeff"] != history[0]["actor/reward_kl_penalty_coeff"] == 0.01
    if name == "grpo+truncated_is":  # sampler and trainer agree here: nothing is truncated
        assert all(m["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0 for m in history)


@pytest.mark.learning
def test_remax_raises_partial_credit_reward(tmp_path, record_property):
    """ReMax with a greedy baseline on the same model, trained and scored with ``digit_match`` (see above)."""
    engine = HFRollout(n=1, temperature=1.0, max_new_tokens=AdditionTask().max_new_tokens)
    estimator = Chain(GreedyBaseline(engine, FunctionReward(digit_match)), ReMax())
    trainer, data = build_trainer(seed=0, steps=STEPS, run_dir=tmp_path, batch_size=BATCH, n=N, lr=LR, progress=False,
                                  loggers=(), estimator=estimator, reward=FunctionReward(digit_match))
    engine.bind(trainer.rollout.model, trainer.policy.tokenizer)  # the greedy answer of the model being trained
    history = trainer.fit(data)
    first, last = mean_reward(history, REMAX_WINDOW)
    record_property("reward_rise", last - first)
    assert last > first + REMAX_MARGIN, (first, last)
    assert all("remax/greedy_score/mean" in m for m in history)
