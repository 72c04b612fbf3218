"""rlflow: reinforcement-learning post-training of language models, in composable PyTorch modules."""

from rlflow.algorithms import GAE, GRPO, AdvantageEstimator, LossOutput, PPOLoss, ValueLoss
from rlflow.data import keys
from rlflow.data.prompts import PromptData
from rlflow.models.critic import Critic
from rlflow.models.policy import Policy
from rlflow.module import BatchModule
from rlflow.rewards import FunctionReward, Reward
from rlflow.rollout.hf import HFRollout
from rlflow.trainer.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "Trainer", "Policy", "Critic", "HFRollout", "Reward", "FunctionReward", "AdvantageEstimator", "GRPO", "GAE",
    "PPOLoss", "ValueLoss", "LossOutput", "PromptData", "BatchModule", "keys",
]
