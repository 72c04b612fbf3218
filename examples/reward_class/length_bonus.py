"""A reward-manager class for ``reward.reward_manager.source=importlib`` (verl's custom reward managers).

verl's reward-manager classes take a ``DataProto``; rlflow's take the batch (a TensorDict with text columns)::

    python -m rlflow.trainer.main_ppo ... \
        reward.reward_manager.source=importlib \
        reward.reward_manager.module.path=examples/reward_class/length_bonus.py \
        reward.reward_manager.name=LengthBonus +reward.reward_kwargs.per_char=0.01

``compute_score`` is the ``custom_reward_function`` (or the built-in scorer by ``data_source``), as verl passes it;
``reward.reward_kwargs`` become keyword arguments of ``__init__``. See docs/rewards.md, "Reward-manager classes".
"""

import torch

from rlflow import Reward
from rlflow.data.keys import DATA_SOURCE, GROUND_TRUTH, RESPONSE_TEXT
from rlflow.rewards.base import column


class LengthBonus(Reward):
    """The scorer's score plus ``per_char`` for each character of the response (a small shaping term)."""

    def __init__(self, compute_score, per_char: float = 0.0):
        super().__init__()
        self.compute_score, self.per_char = compute_score, per_char

    def score(self, batch) -> torch.Tensor:
        sources, texts, truths = (column(batch, key) for key in (DATA_SOURCE, RESPONSE_TEXT, GROUND_TRUTH))
        scores = [float(self.compute_score(source, text, truth)) + self.per_char * len(text)
                  for source, text, truth in zip(sources, texts, truths)]
        self.extras["length"] = [len(text) for text in texts]  # logged as reward/extra/length
        return torch.tensor(scores)
