"""Rewards: any Python callable as a reward, and verl's rule scorers (GSM8K, MATH, DAPO)."""

from rlflow.rewards import gsm8k, math, math_dapo
from rlflow.rewards.base import Reward, RewardError, RewardWarning
from rlflow.rewards.dispatch import default_compute_score
from rlflow.rewards.function import FunctionReward
from rlflow.rewards.overlong import OverlongPenalty

__all__ = [
    "FunctionReward",
    "OverlongPenalty",
    "Reward",
    "RewardError",
    "RewardWarning",
    "default_compute_score",
    "gsm8k",
    "math",
    "math_dapo",
]
