"""KL penalty in the reward (verl ``algorithm.use_kl_in_reward``) and its coefficient controllers.

``KLInReward`` goes in the estimator slot before the estimator that reads the rewards::

    Chain(KLInReward(AdaptiveKLController(init_coef=0.001, target_kl=0.1, horizon=10000)), GRPO())

It reads ``old_log_probs`` and ``ref_log_probs`` (so the Trainer computes both before the
estimator) and rewrites ``token_rewards``. The controllers keep the coefficient across steps
and are saved in checkpoints through ``state_dict`` (the Chain collects it), so a resumed run
continues with the same coefficient.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import Tensor

from rlflow.algorithms import functional as F
from rlflow.data.keys import OLD_LOG_PROBS, REF_LOG_PROBS, RESPONSE_MASK, TOKEN_REWARDS
from rlflow.algorithms.aggregate import WholeBatch
from rlflow.module import BatchModule


def kl_in_reward(
    token_rewards: Tensor, old_log_probs: Tensor, ref_log_probs: Tensor, response_mask: Tensor, beta: float,
    kind: str = "kl",
) -> tuple[Tensor, Tensor]:
    """verl ``apply_kl_penalty``: ``kld = kl_penalty(old, ref, kind) * mask``; ``rewards = token_rewards - beta * kld``.

    All tensors [B, R]; ``kind`` as ``functional.kl_penalty`` (verl ``algorithm.kl_penalty``,
    default ``"kl"``: ``old - ref``). Returns ``(rewards, kld)``, both [B, R].
    """
    kld = F.kl_penalty(old_log_probs, ref_log_probs, kind) * response_mask
    return token_rewards - beta * kld, kld


def mean_sequence_kl(kld: Tensor, response_mask: Tensor, sum_fn=None) -> Tensor:
    """Batch mean of each sequence's token-mean KL (scalar): what the controller sees (over every process's
    share with ``sum_fn``, ``functional.batch_sum``).

    rlflow: sequences without a valid token are left out of the mean (verl counts them as 0,
    which pulls the measured KL down); identical when every sequence has a token.
    """
    per_seq = F.masked_mean(kld, response_mask, -1)
    has_tokens = (response_mask.sum(-1) > 0).to(per_seq.dtype)
    return F.batch_sum(F.masked_sum(per_seq, has_tokens), sum_fn) / F.batch_sum(has_tokens.sum(), sum_fn).clamp(min=1)


class FixedKLController:
    """A constant coefficient (verl ``kl_ctrl.type=fixed``): ``value = coef`` forever."""

    def __init__(self, coef: float = 0.001):
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient never changes."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])

    def __repr__(self) -> str:
        return f"FixedKLController(coef={self.value!r})"


class AdaptiveKLController:
    """Adaptive coefficient (Ziegler et al. 2019, arXiv 1909.08593; verl ``kl_ctrl.type=adaptive``).

    After each step: ``err = clip(current_kl / target_kl - 1, -0.2, 0.2)``,
    ``value *= 1 + err * n_steps / horizon`` (``n_steps`` = samples in the batch). verl's
    defaults: ``kl_coef=0.001``, ``target_kl=0.1``, ``horizon=10000``.
    """

    def __init__(self, init_coef: float = 0.001, target_kl: float = 0.1, horizon: int = 10000):
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        self.value = float(init_coef)
        self.target_kl = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])

    def __repr__(self) -> str:
        return f"AdaptiveKLController(value={self.value!r}, target_kl={self.target_kl!r}, horizon={self.horizon!r})"


class KLInReward(WholeBatch, BatchModule):
    """Subtracts ``beta * KL(pi_old || pi_ref)`` from every token's reward (verl ``use_kl_in_reward``).

    ``beta`` is ``controller.value`` at the start of the step; afterwards the controller is
    updated with the batch's mean per-sequence KL and ``n_steps = B``. ``stats`` (verl's names):
    ``actor/reward_kl_penalty`` (that mean KL) and ``actor/reward_kl_penalty_coeff`` (the beta used).

    Args:
        controller: :class:`FixedKLController` or :class:`AdaptiveKLController` (anything with
            ``value``, ``update(kl, n_steps)``, ``state_dict``, ``load_state_dict``).
        kind: the per-token estimator, as ``functional.kl_penalty`` (verl ``algorithm.kl_penalty``).
    """

    in_keys = (TOKEN_REWARDS, OLD_LOG_PROBS, REF_LOG_PROBS, RESPONSE_MASK)
    out_keys = (TOKEN_REWARDS,)

    def __init__(self, controller, kind: str = "kl"):
        F.kl_penalty(torch.zeros(1), torch.zeros(1), kind)  # fail now on an unknown kind, not mid-run
        self.controller = controller
        self.kind = kind
        self.stats: dict[str, float] = {}

    @torch.no_grad()
    def forward(self, batch: TensorDict) -> TensorDict:
        mask = batch[RESPONSE_MASK]
        beta = self.controller.value
        rewards, kld = kl_in_reward(
            batch[TOKEN_REWARDS], batch[OLD_LOG_PROBS], batch[REF_LOG_PROBS], mask, beta, self.kind
        )
        current = float(mean_sequence_kl(kld, mask, self.sum_fn))
        rows = torch.tensor(float(batch.batch_size[0]), device=mask.device)
        rows = F.batch_sum(rows, self.sum_fn)  # the whole batch's, as verl
        self.controller.update(current, n_steps=int(rows))
        batch.set(TOKEN_REWARDS, rewards)
        self.stats = {"actor/reward_kl_penalty": current, "actor/reward_kl_penalty_coeff": beta}
        return batch

    def state_dict(self) -> dict:
        return {"controller": self.controller.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.controller.load_state_dict(state["controller"])

    def __repr__(self) -> str:
        return f"KLInReward({self.controller!r}, kind={self.kind!r})"
