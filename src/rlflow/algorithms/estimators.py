"""Advantage estimators: module shells that map batch keys onto ``functional`` and ``advantages``.

A new algorithm subclasses :class:`AdvantageEstimator` and overrides ``compute``
(and ``in_keys`` if it reads more keys); the Trainer never changes.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import Tensor

from rlflow.algorithms import advantages as A
from rlflow.algorithms import functional as F
from rlflow.data.keys import (
    ADVANTAGES,
    DATA_SOURCE,
    EXTRA_INFO,
    GROUND_TRUTH,
    GROUP,
    MULTI_MODAL_DATA,
    MULTI_MODAL_INPUTS,
    PROMPT_IDS,
    PROMPT_MASK,
    PROMPT_TEXT,
    RAW_PROMPT,
    RESPONSE_MASK,
    RETURNS,
    REWARD_COLUMN,
    REWARD_BASELINE,
    SCORES,
    TOKEN_REWARDS,
    VALUES,
)
from rlflow.algorithms.aggregate import WholeBatch
from rlflow.module import BatchModule

# The prompt-side columns a greedy re-generation carries along (the reward may read them; a
# vision-language prompt's images go with it).
_PROMPT_KEYS = (PROMPT_IDS, PROMPT_MASK, PROMPT_TEXT, RAW_PROMPT, GROUND_TRUTH, DATA_SOURCE, EXTRA_INFO,
                MULTI_MODAL_INPUTS, MULTI_MODAL_DATA)


class AdvantageEstimator(WholeBatch, BatchModule):
    """Base estimator: reads rewards, writes ``advantages`` and ``returns`` ([B, R] each).

    ``needs_critic`` tells the Trainer whether to compute ``values`` before this runs. Statistics of the whole
    batch (whitening, GPG's ``alpha``) pass ``sum_fn=self.sum_fn`` (``aggregate.WholeBatch``, set by the Trainer).
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
            batch[TOKEN_REWARDS], batch[VALUES], batch[RESPONSE_MASK], gamma=self.gamma, lam=self.lam,
            sum_fn=self.sum_fn,
        )


class DrGRPO(GRPO):
    """Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783).

    GRPO without the std normalisation: ``A_i = s_i - mean_g`` (verl
    ``norm_adv_by_std_in_grpo=False``). The paper's other two changes live in the loss, not
    here: pair it with ``PPOLoss(agg="seq-mean-token-sum-norm")`` (a constant length normaliser
    instead of per-sequence means) and no KL term (``kl_coef=0``, the default).
    """

    def __init__(self):
        super().__init__(norm_by_std=False)


class RLOO(AdvantageEstimator):
    """REINFORCE leave-one-out (arXiv 2402.14740; verl ``rloo``): ``A_i = s_i - mean of the others``.

    A singleton group gets 0 (no baseline information; verl's loop ``rloo`` gives it the raw
    score, its ``rloo_vectorized`` gives 0). See ``advantages.rloo_advantages``.
    """

    def compute(self, batch: TensorDict) -> tuple[Tensor, Tensor]:
        return A.rloo_advantages(batch[TOKEN_REWARDS], batch[RESPONSE_MASK], batch[GROUP])


class ReinforcePlusPlus(AdvantageEstimator):
    """REINFORCE++ (arXiv 2501.03262; verl ``reinforce_plus_plus``): discounted returns, whitened over the batch.

    No grouping: reads no ``group``. See ``advantages.reinforce_pp_advantages``.
    """

    in_keys = (TOKEN_REWARDS, RESPONSE_MASK)

    def __init__(self, gamma: float = 1.0):
        self.gamma = gamma

    def compute(self, batch: TensorDict) -> tuple[Tensor, Tensor]:
        return A.reinforce_pp_advantages(batch[TOKEN_REWARDS], batch[RESPONSE_MASK], gamma=self.gamma,
                                         sum_fn=self.sum_fn)


class ReinforcePlusPlusBaseline(AdvantageEstimator):
    """REINFORCE++-baseline (verl ``reinforce_plus_plus_baseline``): ``s_i - mean_g``, then whitened over the batch."""

    def compute(self, batch: TensorDict) -> tuple[Tensor, Tensor]:
        return A.reinforce_pp_baseline_advantages(batch[TOKEN_REWARDS], batch[RESPONSE_MASK], batch[GROUP],
                                                  sum_fn=self.sum_fn)


class ReMax(AdvantageEstimator):
    """ReMax (arXiv 2310.10505; verl ``remax``): reward-to-go minus the greedy response's score.

    Reads ``reward_baseline`` ([B]), written by :class:`GreedyBaseline` placed before it:
    ``Chain(GreedyBaseline(rollout, reward), ReMax())``. See ``advantages.remax_advantages``.
    """

    in_keys = (TOKEN_REWARDS, RESPONSE_MASK, REWARD_BASELINE)

    def compute(self, batch: TensorDict) -> tuple[Tensor, Tensor]:
        return A.remax_advantages(batch[TOKEN_REWARDS], batch[RESPONSE_MASK], batch[REWARD_BASELINE])


class GreedyBaseline(BatchModule):
    """Writes ``reward_baseline`` ([B]): the score of one greedy response per prompt, for :class:`ReMax`.

    For each distinct ``group`` it takes the group's first row's prompt, generates once with
    ``rollout.with_options(n=1, do_sample=False)`` (the same model the batch was sampled from:
    pass the Trainer's rollout), scores it with ``reward`` and gives that score to every sample
    of the group. This is verl's extra ``gen_max`` rollout for ReMax.

    Pass a reward instance of its own (e.g. a second ``FunctionReward`` of the same function):
    a Reward keeps per-call ``stats``/``extras``, and the Trainer logs the training reward's.
    ``stats["remax/greedy_score/mean"]`` is the mean greedy score over the prompts.

    Best as a stage of the experience stream, ``Trainer(..., stages=[GreedyBaseline(reward=...)],
    estimator=ReMax())``: it then runs on the scored batches, is timed as ``timing_s/greedy_baseline``
    (in the estimator slot, ``Chain(GreedyBaseline(rollout, reward), ReMax())``, it is timed as ``adv``), and
    a ``rollout`` or ``reward`` left ``None`` is the run's own.
    """

    out_keys = (REWARD_BASELINE,)
    stage_name = "greedy_baseline"  # its timer as a stage: timing_s/greedy_baseline

    def __init__(self, rollout=None, reward=None):
        self.rollout = rollout
        self.reward = reward
        self.stats: dict[str, float] = {}

    @property
    def in_keys(self) -> tuple[str, ...]:
        # rollout and reward are None until the experience stream fills them in
        produced = set(self.rollout.out_keys if self.rollout is not None else ())
        extra = tuple(k for k in (self.reward.in_keys if self.reward is not None else ()) if k not in produced)
        return tuple(dict.fromkeys((PROMPT_IDS, PROMPT_MASK, GROUP) + extra))

    @torch.no_grad()
    def forward(self, batch: TensorDict) -> TensorDict:
        group = batch[GROUP]
        ids, inverse = torch.unique(group, return_inverse=True)
        rows = torch.arange(group.shape[0], device=group.device)
        first = torch.full_like(ids, group.shape[0]).scatter_reduce(0, inverse, rows, "amin")
        prompt_keys = [k for k in self.in_keys if k != GROUP] + [k for k in _PROMPT_KEYS if k in batch.keys()]
        prompts = batch.select(*dict.fromkeys(prompt_keys))[first]
        scored = self.reward(self.rollout.with_options(n=1, do_sample=False)(prompts))
        scores = scored[SCORES].to(device=group.device, dtype=torch.float32)
        batch.set(REWARD_BASELINE, scores[inverse])
        self.stats = {"remax/greedy_score/mean": float(scores.mean())}
        return batch

    def __repr__(self) -> str:
        return f"GreedyBaseline(rollout={self.rollout!r}, reward={self.reward!r})"


class GDPO(AdvantageEstimator):
    """Group reward-decoupled normalization (arXiv 2601.05242; verl ``gdpo``).

    Each reward key ``k`` (a column the reward function returns beside ``score``, e.g. ``format_reward``)
    is normalised within its group as GRPO does, ``A_k = (r_k - mean_g) / (std_g + eps)``; then
    ``A = whiten(sum_k w_k A_k)`` over the batch's valid tokens (weights default 1), times the mask.
    Reads ``reward_column/<k>`` ([B]), which a reward writes when its ``columns`` name ``k`` (the config
    entry point sets them from ``algorithm.gdpo_reward_keys``). ``stats``: ``gdpo/<k>/{mean,std,max,min}``.
    """

    def __init__(self, reward_keys, reward_weights=None, norm_by_std: bool = True, eps: float = 1e-6):
        keys = [reward_keys] if isinstance(reward_keys, str) else list(reward_keys or ())
        if not keys:
            raise ValueError("GDPO needs reward_keys (algorithm.gdpo_reward_keys): the per-key reward columns "
                             "the reward function returns beside 'score', e.g. ['format_reward', 'accuracy_reward']")
        if reward_weights is not None and len(list(reward_weights)) != len(keys):
            raise ValueError(f"GDPO reward_weights (algorithm.gdpo_reward_weights) has {len(list(reward_weights))} "
                             f"entries for {len(keys)} reward_keys {keys}")
        self.reward_keys = tuple(keys)
        self.reward_weights = None if reward_weights is None else tuple(float(w) for w in reward_weights)
        self.norm_by_std, self.eps = norm_by_std, eps
        self.in_keys = (RESPONSE_MASK, GROUP) + tuple(REWARD_COLUMN + k for k in keys)
        self.stats: dict[str, float] = {}

    def compute(self, batch: TensorDict) -> tuple[Tensor, Tensor]:
        mask, group = batch[RESPONSE_MASK], batch[GROUP]
        weights = self.reward_weights or (1.0,) * len(self.reward_keys)
        total, self.stats = None, {}
        for key, weight in zip(self.reward_keys, weights):
            scores = batch[REWARD_COLUMN + key].to(mask.device, torch.float32)
            self.stats |= {f"gdpo/{key}/mean": float(scores.mean()), f"gdpo/{key}/std": float(scores.std(correction=0)),
                           f"gdpo/{key}/max": float(scores.max()), f"gdpo/{key}/min": float(scores.min())}
            part, _ = F.grpo_advantages(scores[:, None], mask, group, norm_by_std=self.norm_by_std, eps=self.eps)
            total = weight * part if total is None else total + weight * part
        advantages = F.masked_whiten(total, mask, sum_fn=self.sum_fn) * mask
        return advantages, advantages.clone()


class OPO(AdvantageEstimator):
    """On-policy RL with optimal baseline (arXiv 2505.23585; verl ``opo``): length-weighted group baseline."""

    def compute(self, batch: TensorDict) -> tuple[Tensor, Tensor]:
        return A.opo_advantages(batch[TOKEN_REWARDS], batch[RESPONSE_MASK], batch[GROUP])


class GPG(AdvantageEstimator):
    """Group Policy Gradient (arXiv 2504.02546; verl ``gpg``): ``alpha (s_i - mean_g) / f_norm``."""

    def __init__(self, f_norm: float = 1.0):
        self.f_norm = f_norm

    def compute(self, batch: TensorDict) -> tuple[Tensor, Tensor]:
        return A.gpg_advantages(batch[TOKEN_REWARDS], batch[RESPONSE_MASK], batch[GROUP], f_norm=self.f_norm,
                                sum_fn=self.sum_fn)


class GRPOPassK(AdvantageEstimator):
    """GRPO for pass@k (arXiv 2503.19595; verl ``grpo_passk``): only each group's best sample is credited.

    ``k`` is the group size (``rollout.n``), as in verl; ``k=None`` takes whatever size each group
    has, an integer also checks that every group has exactly ``k`` samples. Groups of fewer than
    2 samples raise ``ValueError``. See ``advantages.grpo_passk_advantages``.
    """

    def __init__(self, k: int | None = None, norm_by_std: bool = True, eps: float = 1e-6):
        if k is not None and k < 2:
            raise ValueError(f"pass@k needs k >= 2 samples per prompt, got k={k}")
        self.k = k
        self.norm_by_std = norm_by_std
        self.eps = eps

    def compute(self, batch: TensorDict) -> tuple[Tensor, Tensor]:
        group = batch[GROUP]
        if self.k is not None:
            _, count = torch.unique(group, return_counts=True)
            if (count != self.k).any():
                raise ValueError(
                    f"GRPOPassK(k={self.k}) needs groups of exactly k samples (rollout n = k); "
                    f"got group sizes {sorted(set(count.tolist()))}"
                )
        return A.grpo_passk_advantages(
            batch[TOKEN_REWARDS], batch[RESPONSE_MASK], group, norm_by_std=self.norm_by_std, eps=self.eps
        )
