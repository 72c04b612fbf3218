"""Step rewards of agent rollouts (tools' rewards, interactions' turn scores) added to a reward's scores.

An :class:`~rlflow.rollout.agent.AgentLoop` writes ``step_rewards`` (B): the sum of the rewards its tools
returned and the turn scores its interaction gave along each trajectory. ``WithStepRewards(reward)`` scores
the batch with ``reward`` and adds them::

    score_i = reward_i + weight * step_rewards_i

(verl hands these to the reward function in ``extra_info["rollout_reward_scores"]`` instead; rlflow's agent
loop does that too, so a reward function can also combine them itself.) The per-token reward is the total
on the last model-written token, as every reward places it.
"""

from __future__ import annotations

from tensordict import TensorDict

from rlflow import roles
from rlflow.data import keys as K
from rlflow.module import BatchModule
from rlflow.rewards.base import place_on_last_token


class WithStepRewards(BatchModule):
    """``reward``'s scores plus ``weight`` x the rollout's ``step_rewards`` (``stats``/``extras`` are ``reward``'s,
    plus ``reward/step_rewards/mean``)."""

    def __init__(self, reward, weight: float = 1.0):
        self.reward, self.weight = reward, float(weight)
        self.in_keys = tuple(dict.fromkeys((*reward.in_keys, K.STEP_REWARDS)))
        self.out_keys = tuple(reward.out_keys)
        self.stats: dict[str, float] = {}

    @property
    def extras(self) -> dict:
        return roles.optional(self.reward, roles.Reward, "extras")

    def forward(self, batch: TensorDict) -> TensorDict:
        batch = self.reward(batch)
        steps = batch[K.STEP_REWARDS].to(batch[K.SCORES].device, batch[K.SCORES].dtype)
        total = batch[K.SCORES] + self.weight * steps
        batch[K.SCORES] = total
        batch[K.TOKEN_REWARDS] = place_on_last_token(total, batch[K.RESPONSE_MASK])
        self.stats = dict(roles.optional(self.reward, roles.Reward, "stats")) | {"reward/step_rewards/mean": steps.mean().item()}
        return batch
