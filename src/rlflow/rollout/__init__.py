"""Rollouts: turn prompts into samples.

``VLLMRollout`` and ``ServerRollout`` import vLLM and the HTTP clients only when an engine starts, so
``import rlflow`` never imports vLLM.
"""

from rlflow.rollout.hf import HFRollout
from rlflow.rollout.server import ServerRollout, SGLangRollout
from rlflow.rollout.single_turn import SingleTurnRollout
from rlflow.rollout.vllm import VLLMRollout

from rlflow.rollout.async_rollout import AsyncRollout
from rlflow.rollout.fully_async import FullyAsyncRollout
from rlflow.rollout.stream import DynamicSampling
from rlflow.rollout.reference_responses import WithReferenceResponses
from rlflow.rollout.agent import AgentLoop
from rlflow.rollout.replay import ReplayRollout
from rlflow.rollout.tracing import TracedRollout

__all__ = ["AgentLoop", "AsyncRollout", "FullyAsyncRollout", "HFRollout", "SingleTurnRollout", "VLLMRollout", "ServerRollout", "SGLangRollout",
           "DynamicSampling", "WithReferenceResponses", "ReplayRollout", "TracedRollout"]
