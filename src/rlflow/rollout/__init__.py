"""Rollouts: turn prompts into samples."""

from rlflow.rollout.hf import HFRollout
from rlflow.rollout.single_turn import SingleTurnRollout

from rlflow.rollout.dynamic_sampling import DynamicSampling
from rlflow.rollout.reference_responses import WithReferenceResponses

__all__ = ["HFRollout", "SingleTurnRollout", "DynamicSampling", "WithReferenceResponses"]
