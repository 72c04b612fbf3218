"""Interactions: a simulated user that answers the model between turns (verl's ``interaction_config_path``).

When the model's turn calls no tool, the agent loop asks the interaction for the next user message::

    class Judge(Interaction):
        async def generate_response(self, instance_id, messages, **kwargs):
            answer = messages[-1]["content"]
            if answer.strip() == kwargs["ground_truth"]:
                return True, "Correct!", 1.0, {}
            return False, "Your answer is wrong, try again.", 0.0, {}

``generate_response(instance_id, messages, **interaction_kwargs) -> (stop, text, reward, metrics)``: the
conversation so far (chat messages, the model's last turn included) and the row's ``interaction_kwargs``
(``extra_info.interaction_kwargs``). ``stop=True`` ends the trajectory after ``text`` is appended; a
``reward`` (verl's turn score) is summed into the trajectory's ``step_rewards``. The method names and
arguments are verl's (``start_interaction``, ``generate_response``, ``finalize_interaction``), so a verl
interaction class ports by changing its base class. The loop's ``max_user_turns`` bounds the turns.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from rlflow.rewards.gsm8k import compute_score


class Interaction:
    """Base of user simulators; ``config`` is the entry's ``config:`` block in the interaction YAML."""

    def __init__(self, config: dict | None = None):
        self.config = dict(config or {})

    async def start_interaction(self, instance_id: str | None = None, **interaction_kwargs) -> str:
        """Start one trajectory's conversation; returns its id (state may be kept under it)."""
        return instance_id or uuid4().hex

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **interaction_kwargs) -> tuple[bool, str, float | None, dict]:
        """The user's reply to the conversation so far: ``(stop, text, reward, metrics)``."""
        raise NotImplementedError(f"{type(self).__name__}.generate_response")

    async def finalize_interaction(self, instance_id: str, **interaction_kwargs) -> None:
        """Release what :meth:`start_interaction` kept."""


def last_assistant(messages: list[dict]) -> str:
    return next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")


class Gsm8kInteraction(Interaction):
    """verl's GSM8K interaction: "correct" ends the conversation (turn score 1.0), otherwise the model is
    asked to reflect and try again (0.0). Reads ``ground_truth`` from the row's ``interaction_kwargs``."""

    async def generate_response(self, instance_id, messages, *, ground_truth=None, **_):
        if ground_truth is None:
            raise ValueError("Gsm8kInteraction needs extra_info.interaction_kwargs.ground_truth")
        reward = float(compute_score(last_assistant(messages), str(ground_truth), method="flexible"))
        if reward == 1.0:
            return True, "Your response is correct!", reward, {}
        return False, "Your response is incorrect! You need to reflect on your answer and try again.", reward, {}


class RetryUntilCorrect(Interaction):
    """Tell the model whether its last answer is right, comparing it with a scorer.

    Args:
        score: ``score(answer_text, ground_truth) -> float``; 1.0 (or more) counts as correct.
        wrong: the message sent when it is not.
    """

    def __init__(self, score, wrong: str = "That is wrong, try again.", right: str = "Correct."):
        super().__init__()
        self.score, self.wrong, self.right = score, wrong, right

    async def generate_response(self, instance_id, messages, *, ground_truth=None, **_):
        reward = float(self.score(last_assistant(messages), ground_truth))
        return (True, self.right, reward, {}) if reward >= 1.0 else (False, self.wrong, reward, {})
