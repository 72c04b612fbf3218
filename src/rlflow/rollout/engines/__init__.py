"""Engines: how tokens are sampled (transformers, an in-process vLLM, an OpenAI-compatible server).

``VLLMEngine``, ``ServerEngine`` and ``FleetEngine`` (several servers) import vLLM and the HTTP clients inside
their methods, so ``import rlflow`` never imports vLLM.
"""

from rlflow.rollout.engines.base import Completion, Engine, MultiModalPrompt, SamplingParams
from rlflow.rollout.engines.fleet import FleetEngine
from rlflow.rollout.engines.hf import HFEngine
from rlflow.rollout.engines.server import ServerEngine
from rlflow.rollout.engines.vllm import VLLMEngine

__all__ = ["Completion", "Engine", "MultiModalPrompt", "SamplingParams", "HFEngine", "VLLMEngine", "ServerEngine", "FleetEngine"]
