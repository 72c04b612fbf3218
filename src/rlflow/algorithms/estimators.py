"""Advantage estimators: module shells that map batch keys onto ``functional``.

A new algorithm subclasses :class:`AdvantageEstimator` and overrides ``compute``
(and ``in_keys`` if it reads more keys); the Trainer never changes.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import Tensor

from rlflow.algorithms import functional as F
from rlflow.data.keys import ADVANTAGES, GROUP, RESPONSE_MASK, RETURNS, TOKEN_REWARDS, VALUES
from rlflow.module import BatchModule


class AdvantageEstimator(BatchModule):
    """Base estimator: reads rewards, writes ``advantages`` and ``returns`` ([B, R] each).

    ``needs_critic`` tells the Trainer whether to compute ``values`` before this runs.
    """

    in_keys = (TOKEN_REWARDS, RESPONSE_MASK, GROUP)
    out_keys = (ADVANTAGES, RETURNS)
    needs_critic = False

    def compute(self, batch: TensorDict) -> tuple[Tensor, Tensor]:
        """Return ``(advantages, returns)``, each [B, R]. Subclasses override only this."""
        raise NotImplementedError

    def forward(self, batch: TensorDict) -> TensorDict:
        # Advantages are targets, never differentiated through.
        with torch.no_grad():
            advantages, returns = self.compute(batch)
        batch.set(ADVANTAGES, advantages)
        batch.set(RETURNS, returns)
        return batch

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class GRPO(AdvantageEstimator):
    """Group-relative outcome advantage (DeepSeekMath, arXiv 2402.03300; verl ``grpo``).

    ``s_i = sum_t r_{i,t}``; ``A_i = (s_i - mean_g) / (std_g + eps)`` over the samples of one
    prompt (``group``), or ``s_i - mean_g`` with ``norm_by_std=False`` (Dr.GRPO, arXiv 2503.20783).
    A singleton group uses mean 0 and std 1, as verl. Advantages = returns = ``A_i * mask``.
    """

    def __init__(self, norm_by_std: bool = True, eps: float = 1e-6):
        self.norm_by_std = norm_by_std
        self.eps = eps

    def compute(self, batch: TensorDict) -> tuple[Tensor, Tensor]:
        return F.grpo_advantages(
            batch[TOKEN_REWARDS], batch[RESPONSE_MASK], batch[GROUP], norm_by_std=self.norm_by_std, eps=self.eps
        )


class GAE(AdvantageEstimator):
    """Generalized advantage estimation with a critic (arXiv 1506.02438; verl ``gae``).

    ``delta_t = r_t + gamma V_{t+1} - V_t``; ``A_t = delta_t + gamma lam A_{t+1}``, skipping masked
    (tool/observation) tokens; ``returns = A + V``; advantages are then whitened over the batch.
    """

    in_keys = AdvantageEstimator.in_keys + (VALUES,)
    needs_critic = True

    def __init__(self, gamma: float = 1.0, lam: float = 1.0):
        self.gamma = gamma
        self.lam = lam

    def compute(self, batch: TensorDict) -> tuple[Tensor, Tensor]:
        return F.gae_advantages(
            batch[TOKEN_REWARDS], batch[VALUES], batch[RESPONSE_MASK], gamma=self.gamma, lam=self.lam
        )
