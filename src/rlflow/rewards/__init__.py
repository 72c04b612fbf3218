"""Rewards: any Python callable, verl's rule scorers, reward models, LLM judges, code execution, and
weighted combinations of them."""

from rlflow.rewards import geo3k, gsm8k, math, math_dapo
from rlflow.rewards.base import Reward, RewardError, RewardWarning, with_columns
from rlflow.rewards.code import CodeReward
from rlflow.rewards.combine import CombinedReward, WithRMScore
from rlflow.rewards.dispatch import default_compute_score
from rlflow.rewards.function import FunctionReward
from rlflow.rewards.judge import JudgeReward
from rlflow.rewards.model import ModelReward
from rlflow.rewards.overlong import OverlongPenalty
from rlflow.rewards.sandbox_fusion import SandboxFusion, SandboxFusionError

__all__ = [
    "CodeReward",
    "CombinedReward",
    "FunctionReward",
    "JudgeReward",
    "ModelReward",
    "WithRMScore",
    "OverlongPenalty",
    "Reward",
    "RewardError",
    "RewardWarning",
    "SandboxFusion",
    "SandboxFusionError",
    "default_compute_score",
    "geo3k",
    "gsm8k",
    "math",
    "math_dapo",
    "with_columns",
]
