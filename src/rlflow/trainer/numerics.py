"""Numerical hazards of an RL step, counted in the metrics and survived.

- Non-finite rewards that reach the estimator (a custom ``Reward``, a reward model or a module that writes
  ``scores``/``token_rewards`` itself; ``FunctionReward`` already scores such calls 0.0 and counts them
  under ``reward/non_finite``): one NaN would turn every whole-batch statistic (whitening, group means)
  into NaN. They are scored 0.0 like ``FunctionReward`` does, with a warning naming the rows, and counted
  in ``numerics/non_finite_reward_frac``.
- Empty responses (no valid token) and all-masked mini-batches: the losses give 0 for them (no NaN); a
  mini-batch without any valid token on any process skips its optimizer step (AdamW would still decay the
  weights), counted in ``actor/skipped_frac``. ``numerics/empty_response_frac`` counts the samples.
- Zero-variance groups (every sample of a prompt scored the same): no learning signal under GRPO-style
  estimators (advantage 0, no division by a zero std); ``numerics/zero_variance_group_frac`` counts them.
- Non-finite advantages (an estimator's bug or overflow) make the loss non-finite and the step is skipped
  (``actor/skipped_frac``); ``numerics/non_finite_advantage_frac`` says where it came from.

All values are fractions of this process's share of the batch; the Trainer averages them over processes.
"""

from __future__ import annotations

import warnings

import torch
from tensordict import TensorDict

from rlflow.data import keys as K
from rlflow.trainer.metrics import host_floats


class NumericsWarning(UserWarning):
    """Non-finite rewards reached the Trainer and were scored 0.0."""


def guard_rewards(batch: TensorDict) -> dict[str, float]:
    """Score non-finite ``scores``/``token_rewards`` 0.0 in place (whole rows), warn, and count them."""
    if K.SCORES not in batch.keys():
        return {}
    bad = ~torch.isfinite(batch[K.SCORES])
    if K.TOKEN_REWARDS in batch.keys():
        bad |= ~torch.isfinite(batch[K.TOKEN_REWARDS]).all(-1)
    frac = bad.float().mean().item() if bad.numel() else 0.0
    if frac:
        rows = bad.nonzero().flatten().tolist()
        warnings.warn(f"non-finite reward(s) reached the estimator at row(s) {rows[:10]}{' ...' if len(rows) > 10 else ''}"
                      "; scored 0.0 (counted in numerics/non_finite_reward_frac)", NumericsWarning, stacklevel=3)
        batch[K.SCORES] = torch.where(bad, torch.zeros_like(batch[K.SCORES]), batch[K.SCORES])
        if K.TOKEN_REWARDS in batch.keys():
            rewards = batch[K.TOKEN_REWARDS]
            batch[K.TOKEN_REWARDS] = torch.where(bad[:, None], torch.zeros_like(rewards), rewards)
    return {"numerics/non_finite_reward_frac": frac}


def zero_variance_group_frac(scores: torch.Tensor, group: torch.Tensor) -> float:
    """Fraction of the groups with at least 2 samples whose scores are all equal. scores, group: [B]."""
    return float(_zero_variance_group_frac(scores, group))


def _zero_variance_group_frac(scores: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    ids, index, counts = torch.unique(group, return_inverse=True, return_counts=True)
    lo = torch.full((len(ids),), float("inf"), dtype=torch.float64, device=scores.device)
    hi = torch.full((len(ids),), float("-inf"), dtype=torch.float64, device=scores.device)
    lo = lo.scatter_reduce(0, index, scores.double(), "amin")
    hi = hi.scatter_reduce(0, index, scores.double(), "amax")
    several = counts > 1
    return ((lo == hi) & several).sum().double() / several.sum().clamp_min(1).double()


def batch_health(batch: TensorDict) -> dict[str, float]:
    """The counts above, after the estimator has run (one device-to-host copy for all of them)."""
    mask = batch[K.RESPONSE_MASK]
    out = {"numerics/empty_response_frac": (mask.sum(-1) == 0).float().mean()}
    keys = batch.keys()
    if K.GROUP in keys and K.SCORES in keys:
        out["numerics/zero_variance_group_frac"] = _zero_variance_group_frac(batch[K.SCORES], batch[K.GROUP])
    if K.ADVANTAGES in keys:
        valid = mask.bool()
        out["numerics/non_finite_advantage_frac"] = (
            (~torch.isfinite(batch[K.ADVANTAGES]) & valid).sum() / valid.sum().clamp_min(1))
    return host_floats(out)
