"""Engines: how tokens are sampled (transformers, an in-process vLLM, an OpenAI-compatible server).

``VLLMEngine``, ``ServerEngine`` and ``FleetEngine`` (several servers) are imported on first use, so
``import rlflow`` never imports vLLM.
"""

from rlflow.rollout.engines.base import Completion, Engine, MultiModalPrompt, SamplingParams
from rlflow.rollout.engines.hf import HFEngine

__all__ = ["Completion", "Engine", "MultiModalPrompt", "SamplingParams", "HFEngine", "VLLMEngine", "ServerEngine", "FleetEngine"]


def __getattr__(name: str):
    if name == "VLLMEngine":
        from rlflow.rollout.engines.vllm import VLLMEngine

        return VLLMEngine
    if name == "ServerEngine":
        from rlflow.rollout.engines.server import ServerEngine

        return ServerEngine
    if name == "FleetEngine":
        from rlflow.rollout.engines.fleet import FleetEngine

        return FleetEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
