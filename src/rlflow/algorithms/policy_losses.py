"""Policy-loss variants: each a :class:`PPOLoss` that overrides ``objective`` only, the per-token loss (math in
``policy_functional``).

The IS weights, the aggregation, the KL and entropy terms, key checks and statistics are PPOLoss's, applied
once for all of them. The other constructor arguments (``kl_coef``, ``entropy_coef``, ``agg``, ``is_weights``,
``loss_scale_factor``, ``clip_ratio*``) are PPOLoss's, passed through ``**ppo_kwargs``. verl's ``actor.policy_loss.loss_mode`` names map to classes in
:data:`LOSS_MODES` (resolved once, at the edge).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import Tensor

from rlflow.algorithms import policy_functional as PF
from rlflow.algorithms.aggregate import WholeBatch
from rlflow.algorithms.losses import PPOLoss
from rlflow.data.keys import ADVANTAGES, COV_SELECTED, LOG_PROBS, OLD_LOG_PROBS, RESPONSE_MASK
from rlflow.module import BatchModule


class _Variant(PPOLoss):
    def _inputs(self, batch: TensorDict) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return batch[LOG_PROBS], batch[OLD_LOG_PROBS], batch[ADVANTAGES], batch[RESPONSE_MASK]


class GSPOLoss(_Variant):
    """GSPO (arXiv 2507.18071; verl ``gspo``): PPO's clip on the sequence-level ratio
    ``s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|)`` (``policy_functional.gspo_objective``).

    Defaults are the paper's (and verl's GSPO example's) clip range 3e-4 / 4e-4 and verl's forced
    ``seq-mean-token-mean``; unlike verl, ``agg`` may be changed.
    """

    def __init__(self, clip_ratio_low: float = 3e-4, clip_ratio_high: float = 4e-4,
                 agg: str = "seq-mean-token-mean", **ppo_kwargs):
        super().__init__(clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, agg=agg, **ppo_kwargs)

    def objective(self, batch: TensorDict) -> tuple[Tensor, dict[str, Tensor]]:
        return PF.gspo_objective(*self._inputs(batch), self.clip_low, self.clip_high)


class CISPOLoss(_Variant):
    """CISPO (MiniMax-M1, arXiv 2506.13585; verl ``cispo``): ``-sg(clip(r)) * A * logp``
    (``policy_functional.cispo_objective``). The clip range is PPOLoss's (verl's ``clip_ratio_low/high``,
    0.2 / 0.2); the paper drops the lower bound: ``CISPOLoss(clip_ratio_low=1.0, clip_ratio_high=...)``.
    """

    def objective(self, batch: TensorDict) -> tuple[Tensor, dict[str, Tensor]]:
        return PF.cispo_objective(*self._inputs(batch), self.clip_low, self.clip_high)


class SAPOLoss(_Variant):
    """SAPO (arXiv 2511.20347; verl ``sapo``): the hard clip replaced by the gate
    ``sigmoid(tau (r - 1)) * 4 / tau`` (``policy_functional.sapo_objective``); ``tau_pos`` for ``A > 0``,
    ``tau_neg`` otherwise. Default ``agg`` is verl's forced ``seq-mean-token-mean``.
    """

    def __init__(self, tau_pos: float = 1.0, tau_neg: float = 1.05, agg: str = "seq-mean-token-mean", **ppo_kwargs):
        if tau_pos <= 0 or tau_neg <= 0:
            raise ValueError(f"SAPO temperatures must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")
        super().__init__(agg=agg, **ppo_kwargs)
        self.tau_pos, self.tau_neg = tau_pos, tau_neg

    def objective(self, batch: TensorDict) -> tuple[Tensor, dict[str, Tensor]]:
        return PF.sapo_objective(*self._inputs(batch), self.tau_pos, self.tau_neg)


class ReinforceLoss(_Variant):
    """Plain REINFORCE, ``-A * logp`` (verl ``gpg``; ``policy_functional.reinforce_objective``). No ratio, no clip."""

    def objective(self, batch: TensorDict) -> tuple[Tensor, dict[str, Tensor]]:
        return PF.reinforce_objective(batch[LOG_PROBS], batch[ADVANTAGES])


class GMPOLoss(_Variant):
    """GMPO (arXiv 2507.20673; verl ``geo_mean``): the geometric mean of token ratios, clipped per token in
    log space to ``[-clip_ratio_low, clip_ratio_high]`` (``policy_functional.gmpo_objective``).

    Defaults: the paper's clip range ``(e^-0.4, e^0.4)`` and ``seq-mean-token-mean``, which is verl's mean
    over sequences (verl ignores ``loss_agg_mode``; here ``agg`` applies to the per-sequence loss).
    """

    def __init__(self, clip_ratio_low: float = 0.4, clip_ratio_high: float = 0.4,
                 agg: str = "seq-mean-token-mean", **ppo_kwargs):
        super().__init__(clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, agg=agg, **ppo_kwargs)

    def objective(self, batch: TensorDict) -> tuple[Tensor, dict[str, Tensor]]:
        return PF.gmpo_objective(*self._inputs(batch), self.clip_low, self.clip_high)

    def weigh(self, per_token: Tensor, weights: Tensor, mask: Tensor) -> Tensor:
        """A sequence-level loss takes each row's geometric mean of its token weights (verl ``geo_mean``)."""
        return per_token * PF.row_geometric_mean(weights, mask)


class DPPOTVLoss(_Variant):
    """DPPO-Binary-TV (arXiv 2602.04879; verl ``dppo_tv``): PPO's ratio clip replaced by a clip on the
    probability change ``p - p_old`` (``policy_functional.dppo_objective``). ``clip_ratio`` / ``_low`` / ``_high``
    are the divergence thresholds (verl reuses the keys; its DPPO example: 0.15), ``clip_ratio_c`` truncates
    the detached IS ratio (verl's default 3.0; the example 10000). Other options are PPOLoss's.
    """

    divergence = "tv"

    def objective(self, batch: TensorDict) -> tuple[Tensor, dict[str, Tensor]]:
        return PF.dppo_objective(*self._inputs(batch), self.divergence, self.clip_low, self.clip_high,
                                 self.clip_ratio_c)


class DPPOKLLoss(DPPOTVLoss):
    """DPPO-Binary-KL (verl ``dppo_kl``): as :class:`DPPOTVLoss` with the binary KL of ``p_old`` and ``p`` as
    the divergence (verl's example threshold 0.05)."""

    divergence = "kl"


class CovSelection(WholeBatch, BatchModule):
    """Runs a covariance loss's ``select`` over the whole batch, before it is split into mini- and
    micro-batches, and writes ``cov_selected``: put ``loss.selection()`` after the advantage estimator,
    e.g. ``estimator=Chain(GRPO(), loss.selection())``.

    Reads ``old_log_probs`` (the policy at the start of the step, which is the current one when the
    selection runs), so the Trainer computes them. The covariance's means are over the whole batch on every
    process (``sum_fn``, set by the Trainer; see ``rlflow.algorithms.aggregate.WholeBatch``).
    """

    in_keys = (ADVANTAGES, OLD_LOG_PROBS, RESPONSE_MASK)
    out_keys = (COV_SELECTED,)

    def __init__(self, loss: "ClipCovLoss | KLCovLoss"):
        self.loss = loss

    @torch.no_grad()
    def forward(self, batch: TensorDict) -> TensorDict:
        batch.set(COV_SELECTED, self.loss.select(batch, self.sum_fn))
        return batch

    def state_dict(self) -> dict:
        gen = getattr(self.loss, "generator", None)
        return {"generator": gen.get_state()} if gen is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if "generator" in state and getattr(self.loss, "generator", None) is not None:
            self.loss.generator.set_state(state["generator"])

    def __repr__(self) -> str:
        return f"CovSelection({type(self.loss).__name__})"


class _CovVariant(_Variant):
    @property
    def in_keys(self) -> tuple[str, ...]:
        return super().in_keys + (COV_SELECTED,)

    def select(self, batch: TensorDict, sum_fn=None) -> Tensor:  # pragma: no cover - interface
        """The bool [B, R] tokens to treat; called on the whole batch by :class:`CovSelection` (``sum_fn``: its
        whole-batch sum over processes)."""
        raise NotImplementedError

    def selection(self) -> CovSelection:
        """The module that writes this loss's ``cov_selected`` (place it after the advantage estimator)."""
        return CovSelection(self)


class ClipCovLoss(_CovVariant):
    """Clip-Cov (Cui et al. 2025, arXiv 2505.22617; verl ``clip_cov``): PPO's clipped loss with a random
    ``clip_cov_ratio`` share of the tokens whose covariance ``(A - mean A)(logp - mean logp)`` lies in
    ``(clip_cov_lb, clip_cov_ub)`` cut out (loss and gradient 0); no dual clip.

    The choice is made once per RL step over the whole batch by ``loss.selection()`` (in the estimator
    slot), so gradient accumulation cannot change it. verl chooses per micro-batch, at least one token
    in each: with micro-batches of one sample it cuts a token from every sample. The random draw uses
    ``generator`` (``None``: the global CPU RNG, seeded and checkpointed by the Trainer).
    """

    def __init__(self, clip_cov_ratio: float = 2e-4, clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0, *,
                 generator: torch.Generator | None = None, **ppo_kwargs):
        if clip_cov_ratio <= 0:
            raise ValueError(f"clip_cov_ratio must be > 0, got {clip_cov_ratio}")
        super().__init__(**ppo_kwargs)
        self.clip_cov_ratio, self.clip_cov_lb, self.clip_cov_ub = clip_cov_ratio, clip_cov_lb, clip_cov_ub
        self.generator = generator

    def select(self, batch: TensorDict, sum_fn=None) -> Tensor:
        return PF.clip_cov_select(batch[ADVANTAGES], batch[OLD_LOG_PROBS], batch[RESPONSE_MASK], self.clip_cov_ratio,
                                  self.clip_cov_lb, self.clip_cov_ub, generator=self.generator, sum_fn=sum_fn)

    def objective(self, batch: TensorDict) -> tuple[Tensor, dict[str, Tensor]]:
        return PF.clip_cov_objective(*self._inputs(batch), batch[COV_SELECTED], self.clip_low, self.clip_high)


class KLCovLoss(_CovVariant):
    """KL-Cov (Cui et al. 2025; verl ``kl_cov``): the unclipped surrogate ``-A r`` plus
    ``ppo_kl_coef * |logp - old|`` on the ``kl_cov_ratio`` share of tokens with the largest covariance.

    ``ppo_kl_coef`` defaults to 1.0: verl's code fallback, the authors' code and their run scripts;
    verl's yaml says 0.1. The choice is made once per step over the whole batch (see ``ClipCovLoss``).
    The clip ratios of PPOLoss are unused (verl: unclipped).
    """

    def __init__(self, kl_cov_ratio: float = 2e-4, ppo_kl_coef: float = 1.0, **ppo_kwargs):
        if kl_cov_ratio <= 0:
            raise ValueError(f"kl_cov_ratio must be > 0, got {kl_cov_ratio}")
        super().__init__(**ppo_kwargs)
        self.kl_cov_ratio, self.ppo_kl_coef = kl_cov_ratio, ppo_kl_coef

    def select(self, batch: TensorDict, sum_fn=None) -> Tensor:
        return PF.kl_cov_select(batch[ADVANTAGES], batch[OLD_LOG_PROBS], batch[RESPONSE_MASK], self.kl_cov_ratio,
                                sum_fn)

    def objective(self, batch: TensorDict) -> tuple[Tensor, dict[str, Tensor]]:
        return PF.kl_cov_objective(*self._inputs(batch), batch[COV_SELECTED], self.ppo_kl_coef)


# verl's actor.policy_loss.loss_mode -> class ("vanilla" is PPOLoss itself)
LOSS_MODES: dict[str, type[PPOLoss]] = {
    "vanilla": PPOLoss, "gspo": GSPOLoss, "cispo": CISPOLoss, "sapo": SAPOLoss, "gpg": ReinforceLoss,
    "clip_cov": ClipCovLoss, "kl_cov": KLCovLoss, "geo_mean": GMPOLoss, "dppo_tv": DPPOTVLoss, "dppo_kl": DPPOKLLoss,
}
