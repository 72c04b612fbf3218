"""Multi-turn rollouts: the agent loop, interactions (simulated users) and TorchRL environments."""

from rlflow.rollout.agent.chat import ChatFormat
from rlflow.rollout.agent.interaction import Gsm8kInteraction, Interaction, RetryUntilCorrect
from rlflow.rollout.agent.loop import AgentLoop

__all__ = ["AgentLoop", "ChatFormat", "Interaction", "Gsm8kInteraction", "RetryUntilCorrect"]
