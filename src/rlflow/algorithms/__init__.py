"""Advantage estimators and losses: pure tensor math in ``functional``, key-mapping shells around it."""

from rlflow.algorithms import functional
from rlflow.algorithms.estimators import GAE, GRPO, AdvantageEstimator
from rlflow.algorithms.losses import LossOutput, PPOLoss, ValueLoss

__all__ = ["functional", "AdvantageEstimator", "GRPO", "GAE", "PPOLoss", "ValueLoss", "LossOutput"]
