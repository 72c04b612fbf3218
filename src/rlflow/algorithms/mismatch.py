"""How far the sampler's log-probs are from the trainer's: verl's mismatch metrics, logged whenever the rollout
records its log-probs.

The sampler (vLLM, a bf16 engine, weights a step stale) and the training forward pass give the same tokens
slightly different probabilities. verl logs the gap on every step that has ``rollout_log_probs``: its debug
metrics (``utils/debug/metrics.calculate_debug_metrics``) over ``|p_old - p_rollout|`` per token, and the
off-policy diagnostics (``rollout_corr_helper.compute_offpolicy_metrics``). With ``r = old - rollout`` per token
and, per sequence, ``m_old`` / ``m_rollout`` the mean log-prob over its valid tokens:

==============================================  ================================================================
``training/rollout_probs_diff_max|mean|std``     of ``|exp(old) - exp(rollout)|`` over valid tokens (std: unbiased)
``training/rollout_actor_probs_pearson_corr``    Pearson correlation of ``exp(old)`` and ``exp(rollout)``
``training/rollout_probs_diff_valid``            1 (0 when the step had no valid token; then nothing else is logged)
``rollout_corr/kl``                              token mean of ``-r`` (KL(rollout || trainer), the k1 estimate)
``rollout_corr/k3_kl``                           token mean of ``e^r - r - 1`` (the k3 estimate)
``rollout_corr/training_ppl``, ``rollout_ppl``   sequence mean of ``exp(-m_old)``, ``exp(-m_rollout)``
``rollout_corr/training_log_ppl``, ...           sequence mean of ``-m_old``, ``-m_rollout`` (``rollout_log_ppl``)
``rollout_corr/log_ppl_diff``                    sequence mean of ``d = m_rollout - m_old``; ``log_ppl_abs_diff``
                                                 (of ``|d|``), ``log_ppl_diff_max``, ``log_ppl_diff_min``
``rollout_corr/ppl_ratio``                       sequence mean of ``exp(d)``
``rollout_corr/chi2_token``, ``chi2_seq``        ``mean(exp(2 clamp(r))) - 1`` over tokens; over sequences with
                                                 ``r`` summed per sequence (clamped to +-20, as verl)
==============================================  ================================================================

rlflow: sequences without a valid token are left out of the sequence means (verl counts them with
``m = 0``). The Trainer feeds :class:`MismatchMetrics` the old log-probs where it has them: its pass before
the updates, or, with one update per batch (no such pass), the update's own forward, which is the same policy.
"""

from __future__ import annotations

import math

import torch
from tensordict import TensorDict
from torch import Tensor

from rlflow.algorithms.correction import SAFETY_BOUND
from rlflow.data.keys import OLD_LOG_PROBS, RESPONSE_MASK, ROLLOUT_LOG_PROBS


def _rows(old: Tensor, rollout: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """What the metrics need of a [B, R] batch, flat: valid tokens' log-probs, per-sequence means and sums."""
    dtype = torch.promote_types(old.dtype, torch.float32)  # bf16 log-probs: the metrics in float32 at least
    valid, m = mask.bool(), mask.to(dtype)
    zero = torch.zeros((), dtype=dtype, device=old.device)  # padding may hold anything (-inf): never multiplied
    old = torch.where(valid, old.detach().to(dtype), zero)
    rollout = torch.where(valid, rollout.detach().to(dtype), zero)
    count = m.sum(-1)
    seq = count > 0
    return {"old": old[valid], "rollout": rollout[valid], "seq_old": ((old * m).sum(-1) / count.clamp_min(1))[seq],
            "seq_rollout": ((rollout * m).sum(-1) / count.clamp_min(1))[seq],
            "seq_log_ratio": ((old - rollout) * m).sum(-1)[seq]}


def _debug(rows: dict[str, Tensor]) -> dict[str, Tensor | float]:
    """verl's ``calculate_debug_metrics`` (``training/*``)."""
    old, rollout = rows["old"], rows["rollout"]
    if old.numel() == 0:
        return {"training/rollout_probs_diff_valid": 0.0}
    p_old, p_rollout = old.exp(), rollout.exp()
    diff = (p_old - p_rollout).abs()
    nan = old.new_tensor(math.nan)  # undefined for one token (verl: NaN too)
    return {
        "training/rollout_probs_diff_valid": 1.0,
        "training/rollout_probs_diff_max": diff.max(),
        "training/rollout_probs_diff_mean": diff.mean(),
        "training/rollout_probs_diff_std": diff.std() if diff.numel() > 1 else nan,
        "training/rollout_actor_probs_pearson_corr":
            torch.corrcoef(torch.stack([p_old, p_rollout]))[0, 1] if old.numel() > 1 else nan,
    }


def _offpolicy(rows: dict[str, Tensor]) -> dict[str, Tensor]:
    """verl's ``compute_offpolicy_metrics`` (``rollout_corr/*``)."""
    if rows["old"].numel() == 0:
        return {}
    r = rows["old"] - rows["rollout"]
    d = rows["seq_rollout"] - rows["seq_old"]
    return {
        "rollout_corr/training_ppl": (-rows["seq_old"]).exp().mean(),
        "rollout_corr/training_log_ppl": (-rows["seq_old"]).mean(),
        "rollout_corr/kl": (-r).mean(),
        "rollout_corr/k3_kl": (r.exp() - r - 1).mean(),
        "rollout_corr/rollout_ppl": (-rows["seq_rollout"]).exp().mean(),
        "rollout_corr/rollout_log_ppl": (-rows["seq_rollout"]).mean(),
        "rollout_corr/log_ppl_diff": d.mean(),
        "rollout_corr/log_ppl_abs_diff": d.abs().mean(),
        "rollout_corr/log_ppl_diff_max": d.max(),
        "rollout_corr/log_ppl_diff_min": d.min(),
        "rollout_corr/ppl_ratio": d.exp().mean(),
        "rollout_corr/chi2_token": (2 * r.clamp(-SAFETY_BOUND, SAFETY_BOUND)).exp().mean() - 1,
        "rollout_corr/chi2_seq": (2 * rows["seq_log_ratio"].clamp(-SAFETY_BOUND, SAFETY_BOUND)).exp().mean() - 1,
    }


def to_floats(metrics: dict[str, Tensor | float]) -> dict[str, float]:
    names = [k for k, v in metrics.items() if isinstance(v, Tensor)]
    values = torch.stack([metrics[k].double() for k in names]).tolist() if names else []  # one device sync
    return {k: float(v) for k, v in metrics.items() if not isinstance(v, Tensor)} | dict(zip(names, values))


def mismatch_metrics(old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor) -> dict[str, float]:
    """verl's mismatch metrics (module docstring) of one batch; all tensors [B, R]."""
    rows = _rows(old_log_probs, rollout_log_probs, response_mask)
    return to_floats(_debug(rows) | _offpolicy(rows))


def offpolicy_metrics(log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor) -> dict[str, Tensor]:
    """The ``rollout_corr/*`` half only (detached scalar tensors), as verl's bypass loss logs it per micro-batch."""
    return _offpolicy(_rows(log_probs, rollout_log_probs, response_mask))


class MismatchMetrics:
    """Collects one step's (old, rollout) log-probs and gives verl's mismatch metrics over all of them.

    ``observe(batch)`` takes a whole batch (replacing what was collected), ``add(batch)`` a part of one
    (micro-batches of the update); ``pop()`` returns the metrics ({} when nothing was seen, or the batches had no
    ``rollout_log_probs``) and forgets. Micro-batches may differ in width: they are kept as flat tokens.
    """

    def __init__(self):
        self._parts: list[dict[str, Tensor]] = []

    def observe(self, batch: TensorDict) -> TensorDict:
        self._parts = []
        self.add(batch)
        return batch

    def add(self, batch: TensorDict) -> TensorDict:
        if ROLLOUT_LOG_PROBS in batch.keys() and OLD_LOG_PROBS in batch.keys():
            self._parts.append(_rows(batch[OLD_LOG_PROBS], batch[ROLLOUT_LOG_PROBS], batch[RESPONSE_MASK]))
        return batch

    def pop(self) -> dict[str, float]:
        parts, self._parts = self._parts, []
        if not parts:
            return {}
        rows = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        return to_floats(_debug(rows) | _offpolicy(rows))
