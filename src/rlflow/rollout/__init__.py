"""Rollouts: turn prompts into samples.

``VLLMRollout`` and ``ServerRollout`` are imported on first use (``rlflow.rollout.VLLMRollout``), so
``import rlflow`` never imports vLLM.
"""

from rlflow.rollout.hf import HFRollout
from rlflow.rollout.single_turn import SingleTurnRollout

from rlflow.rollout.async_rollout import AsyncRollout
from rlflow.rollout.fully_async import FullyAsyncRollout
from rlflow.rollout.stream import DynamicSampling
from rlflow.rollout.reference_responses import WithReferenceResponses
from rlflow.rollout.agent import AgentLoop

__all__ = ["AgentLoop", "AsyncRollout", "FullyAsyncRollout", "HFRollout", "SingleTurnRollout", "VLLMRollout", "ServerRollout", "SGLangRollout",
           "DynamicSampling", "WithReferenceResponses"]

_LAZY = {"VLLMRollout": "rlflow.rollout.vllm", "ServerRollout": "rlflow.rollout.server",
         "SGLangRollout": "rlflow.rollout.server"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
