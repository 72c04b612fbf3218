"""Engines: how tokens are sampled, apart from what a rollout does with prompts (``rlflow.rollout.engines.base``)."""

from rlflow.rollout.engines.base import Completion, Engine, SamplingParams
from rlflow.rollout.engines.hf import HFEngine

__all__ = ["Completion", "Engine", "SamplingParams", "HFEngine"]
