"""Self-play objectives: SPIN and SPPO as PPOLoss variants, with the estimators and callback they use.

Both compare the policy with a reference ``pi_ref`` through sequence log-ratios
``log pi(y) / pi_ref(y)``; the losses read ``ref_log_probs``, so the Trainer builds the frozen
reference itself (``reference="auto"``). In the papers ``pi_ref`` is the previous iteration's
policy ``pi_t``: :class:`UpdateReference` copies the policy into the reference every ``every`` steps.

- SPIN: ``rollout=WithReferenceResponses(HFRollout(n=...))`` adds each prompt's real response as
  one more row of its group; ``estimator=NoAdvantage()``; ``loss=SPINLoss(beta)``.
- SPPO: ``estimator=GroupWinRate()`` turns rewards into ``P_hat(y > pi) - 1/2`` per sample;
  ``loss=SPPOLoss(eta)``.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import Tensor

from rlflow.algorithms import policy_functional as PF
from rlflow.algorithms.estimators import AdvantageEstimator
from rlflow.algorithms.functional import masked_sum
from rlflow.algorithms.losses import PPOLoss
from rlflow.data.keys import (
    ADVANTAGES,
    GROUP,
    IS_REFERENCE,
    LOG_PROBS,
    OLD_LOG_PROBS,
    REF_LOG_PROBS,
    RESPONSE_MASK,
    TOKEN_REWARDS,
)


def _no_is_weights(name: str, ppo_kwargs: dict) -> None:
    """Refuse ``is_weights=True``: truncated IS weights (``TruncatedIS``) reweight a per-token policy
    gradient of sampled tokens, but SPIN's and SPPO's per-token loss is one sequence-level (SPIN:
    group-level) value copied onto every token, a regression on ``log pi / pi_ref`` rather than a
    policy gradient, and SPIN's real response was not sampled by the rollout at all. Multiplying by
    per-token weights would not correct anything, so rather than ignore the flag the loss raises.
    """
    if ppo_kwargs.get("is_weights"):
        raise ValueError(f"{name} does not support is_weights=True: its loss is a sequence-level term spread over "
                         "the tokens, not a per-token policy gradient that truncated importance weights (TruncatedIS) "
                         "could correct; drop is_weights (and TruncatedIS) for this loss")


class NoAdvantage(AdvantageEstimator):
    """Zero advantages and returns ([B, R]), for losses that need none (SPIN). Reads only the mask."""

    in_keys = (RESPONSE_MASK,)

    def compute(self, batch: TensorDict) -> tuple[Tensor, Tensor]:
        zeros = torch.zeros_like(batch[RESPONSE_MASK], dtype=torch.float32)
        return zeros, zeros.clone()


class GroupWinRate(AdvantageEstimator):
    """SPPO's target: ``A_i = P_hat(y_i > pi | x) - 1/2`` on every valid token of row i.

    ``P_hat`` is estimated within each group from the scores ``s_i = sum_t token_rewards`` by
    :meth:`win_rate` (default ``policy_functional.group_win_rate``: the paper's
    ``1/K sum_k P(y_i > y_k)`` with ``P = 1`` for a higher score, ``1/2`` for a tie). Override
    ``win_rate`` for a soft preference, e.g. ``sigmoid((s_i - s_k) / T)``. Computed on the whole
    batch before it is split, so SPPO's loss stays per row.
    """

    def win_rate(self, scores: Tensor, group: Tensor) -> Tensor:
        """[B] scores and group ids -> [B] win probabilities against the group."""
        return PF.group_win_rate(scores, group)

    def compute(self, batch: TensorDict) -> tuple[Tensor, Tensor]:
        mask = batch[RESPONSE_MASK]
        centered = self.win_rate(batch[TOKEN_REWARDS].sum(-1), batch[GROUP]) - 0.5
        adv = centered[:, None] * mask
        return adv, adv.clone()


class SPINLoss(PPOLoss):
    """SPIN (arXiv 2401.01335): ``-log sigmoid(beta [(log pi - log pi_ref)(y_real) - (log pi - log pi_ref)(y_gen)])``
    per (real, generated) pair of a group, averaged (``policy_functional.spin_objective``).

    Needs the real response as a row of each group (``is_reference``; ``WithReferenceResponses``) and
    whole groups in every micro-batch: split by rows (no ``max_tokens_per_micro_batch``, whose packing
    regroups rows) with a ``micro_batch_size`` that is a multiple of ``n + 1``; the loss raises otherwise. PPOLoss's clip arguments are unused; ``kl_coef`` / ``entropy_coef`` still apply.
    ``loss_scale_factor`` is the ``seq-mean-token-sum-norm`` divisor, as in PPOLoss. ``is_weights=True``
    raises ``ValueError``: the loss is a group-level term copied onto every token, not a per-token
    policy gradient that truncated IS weights could correct.
    """

    def __init__(self, beta: float = 0.1, agg: str = "seq-mean-token-mean", **ppo_kwargs):
        if beta <= 0:
            raise ValueError(f"beta must be > 0, got {beta}")
        _no_is_weights(type(self).__name__, ppo_kwargs)
        super().__init__(agg=agg, **ppo_kwargs)
        self.beta = beta

    @property
    def in_keys(self) -> tuple[str, ...]:
        keys = dict.fromkeys(super().in_keys + (REF_LOG_PROBS, GROUP, IS_REFERENCE))
        return tuple(k for k in keys if k not in (ADVANTAGES, OLD_LOG_PROBS))  # SPIN reads neither

    def objective(self, batch: TensorDict) -> tuple[Tensor, dict[str, Tensor]]:
        return PF.spin_objective(batch[LOG_PROBS], batch[REF_LOG_PROBS], batch[RESPONSE_MASK], batch[GROUP],
                                 batch[IS_REFERENCE], self.beta)


class SPPOLoss(PPOLoss):
    """SPPO (arXiv 2405.00675): ``(log pi(y)/pi_ref(y) - eta (P_hat(y > pi) - 1/2))^2`` per sample
    (``policy_functional.sppo_objective``), with ``P_hat - 1/2`` read from the advantages that
    :class:`GroupWinRate` writes. Per row, so any micro-batch split is exact.

    ``pi_ref`` should be the policy that sampled the batch (SPPO's ``pi_t``):
    ``Trainer(callbacks=[UpdateReference(1)])``. Then ``D`` starts at 0 and the first gradient is
    ``-2 eta (P_hat - 1/2) grad D``; with a reference frozen for many steps, fresh samples have
    ``D > 0`` on average and the loss mostly pulls them back to it. ``eta`` scales the target
    log-ratio (nats per sequence; the paper's large values suit long responses) - with one update
    per step it only scales the gradient. PPOLoss's clip arguments are unused; ``loss_scale_factor``
    is the ``seq-mean-token-sum-norm`` divisor, as in PPOLoss. ``is_weights=True`` raises
    ``ValueError``: the loss is a sequence-level term copied onto every token, not a per-token
    policy gradient that truncated IS weights could correct.
    """

    def __init__(self, eta: float = 1.0, agg: str = "seq-mean-token-mean", **ppo_kwargs):
        if eta <= 0:
            raise ValueError(f"eta must be > 0, got {eta}")
        _no_is_weights(type(self).__name__, ppo_kwargs)
        super().__init__(agg=agg, **ppo_kwargs)
        self.eta = eta

    @property
    def in_keys(self) -> tuple[str, ...]:
        return tuple(k for k in dict.fromkeys(super().in_keys + (REF_LOG_PROBS,)) if k != OLD_LOG_PROBS)

    def objective(self, batch: TensorDict) -> tuple[Tensor, dict[str, Tensor]]:
        mask = batch[RESPONSE_MASK]
        target = masked_sum(batch[ADVANTAGES], mask, -1) / mask.sum(-1).clamp(min=1)  # the row's constant value
        return PF.sppo_objective(batch[LOG_PROBS], batch[REF_LOG_PROBS], mask, target, self.eta)


class UpdateReference:
    """Trainer callback: every ``every`` steps the reference becomes a copy of the policy
    (self-play iteration ``t -> t + 1``: ``pi_ref = pi_t``). ``Trainer(callbacks=[UpdateReference(20)])``.

    Parameters are copied in place, so a reference set up by the strategy (sharded) stays so.
    """

    def __init__(self, every: int):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every = every

    @torch.no_grad()
    def on_step_end(self, trainer, step: int, metrics: dict) -> None:
        if trainer.reference is None or step % self.every:
            return
        for ref, cur in zip(trainer.reference.model.parameters(), trainer.policy.model.parameters(), strict=True):
            ref.copy_(cur)
