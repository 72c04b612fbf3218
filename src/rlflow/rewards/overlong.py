"""DAPO's overlong reward shaping (Yu et al. 2025, arXiv 2503.14476, "soft overlong punishment").

verl: ``verl/workers/reward_manager/dapo.py`` with ``reward_model.reward_kwargs.overlong_buffer``
``{enable, len, penalty_factor}`` and ``data.max_response_length``.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rlflow import roles
from rlflow.data.keys import RESPONSE_MASK, SCORES
from rlflow.rewards.base import Reward


def overlong_penalty(lengths: torch.Tensor, max_response_length: int, buffer_len: int,
                     penalty_factor: float = 1.0) -> torch.Tensor:
    """``clamp(-(L - (max_len - buffer)) / buffer * factor, -factor, 0)`` per sample: [B] -> [B] float.

    No penalty up to ``max_len - buffer`` tokens, then linear, reaching ``-factor`` at ``max_len``
    (verl: ``min(-(L - (max_len - buffer)) / buffer * factor, 0)``; rlflow also floors it at
    ``-factor``, the paper's value beyond ``max_len``, which only matters if responses can be longer).
    """
    expected = max_response_length - buffer_len
    penalty = -(lengths.to(torch.float32) - expected) / buffer_len * penalty_factor
    return penalty.clamp(min=-penalty_factor, max=0.0)


def response_lengths(mask: torch.Tensor) -> torch.Tensor:
    """Generated length per row: one past the last position with ``mask == 1`` (0 if none); [B, R] -> [B].

    Equals ``mask.sum(-1)`` for right-padded single-turn responses; with tool/observation tokens
    (mask 0 inside the response) they still count, like verl's attention-mask length.
    """
    positions = torch.arange(1, mask.shape[-1] + 1, device=mask.device)
    return (positions * mask.bool()).amax(-1) if mask.shape[-1] else mask.sum(-1)


class OverlongPenalty(Reward):
    """Adds :func:`overlong_penalty` of each response's length to ``reward``'s score.

    Args:
        reward: the reward to shape (e.g. ``FunctionReward(compute_score)``).
        max_response_length: the rollout's ``max_new_tokens`` (verl ``data.max_response_length``).
        buffer_len: the penalty ramps up over the last ``buffer_len`` tokens (verl ``overlong_buffer.len``).
        penalty_factor: the penalty at ``max_response_length`` (verl ``overlong_buffer.penalty_factor``).

    ``extras`` are the inner reward's, plus ``overlong_reward`` (the penalty per row) and, as verl's DAPO
    reward manager, ``acc`` = the unshaped score when the inner reward gives no ``acc`` of its own (so
    validation reports accuracy without the penalty and ``DynamicSampling(metric="acc")`` filters on it).
    """

    def __init__(self, reward: Reward, max_response_length: int, buffer_len: int, penalty_factor: float = 1.0):
        if not 0 < buffer_len <= max_response_length:
            raise ValueError(f"buffer_len must be in (0, max_response_length={max_response_length}], got {buffer_len}")
        if penalty_factor < 0:
            raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor}")
        super().__init__()
        self.reward, self.max_response_length = reward, max_response_length
        self.buffer_len, self.penalty_factor = buffer_len, penalty_factor
        self.in_keys = tuple(dict.fromkeys(tuple(reward.in_keys) + (RESPONSE_MASK,)))

    def score(self, batch: TensorDict) -> torch.Tensor:
        raw = self.reward(batch)[SCORES].clone()
        self.stats.update(self.reward.stats)
        self.extras.update(roles.optional(self.reward, roles.Reward, "extras"))
        lengths = response_lengths(batch[RESPONSE_MASK])
        penalty = overlong_penalty(lengths, self.max_response_length, self.buffer_len, self.penalty_factor)
        penalty = penalty.to(raw.device)
        self.extras.setdefault("acc", raw.tolist())
        self.extras["overlong_reward"] = penalty.tolist()
        self.stats["reward/overlong_frac"] = float((penalty < 0).float().mean()) if penalty.numel() else 0.0
        return raw + penalty

    def __repr__(self) -> str:
        return (f"OverlongPenalty({self.reward!r}, max_response_length={self.max_response_length}, "
                f"buffer_len={self.buffer_len}, penalty_factor={self.penalty_factor})")
