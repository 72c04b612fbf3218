"""Off-policy correction: rejection sampling of tokens or sequences the sampler and the trainer disagree on.

verl ``algorithm.rollout_correction.rollout_rs`` (``rollout_corr_helper.compute_rollout_rejection_mask``): where
an estimate of the divergence between the training policy (``old_log_probs``) and the sampler
(``rollout_log_probs``) leaves the threshold, the response mask is zeroed, so the loss skips those tokens::

    Chain(GRPO(), TruncatedIS(level="sequence"), RejectionSampling("token_k1,seq_max_k2", "0.6_1.6,2.5"))

With ``r = clamp(old - rollout, -20, 20)`` per token, the estimators are ``k1 = -r``, ``k2 = r^2 / 2`` and
``k3 = e^r - 1 - r``. An option is ``token_kN`` (each token on its own), ``seq_sum_kN`` / ``seq_mean_kN`` (the
sum / mean over the sequence's valid tokens decides for the whole sequence) or ``seq_max_k2`` / ``seq_max_k3``
(its largest token). ``k1`` options keep ``log(lower) <= k1 <= log(upper)``: the threshold is ``"lower_upper"``
(``"0.6_1.6"``) or one number ``u`` (then ``lower = 1/u``); ``k2`` / ``k3`` options keep ``stat <= upper``.
Several options, comma-separated, must all pass; the threshold is one entry shared by all or one per option.
"""

from __future__ import annotations

import math

import torch
from tensordict import TensorDict
from torch import Tensor

from rlflow.algorithms.correction import SAFETY_BOUND
from rlflow.algorithms.functional import masked_mean, masked_sum
from rlflow.data.keys import OLD_LOG_PROBS, RESPONSE_MASK, ROLLOUT_LOG_PROBS
from rlflow.module import BatchModule

OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
           "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")  # verl SUPPORTED_ROLLOUT_RS_OPTIONS


def parse_rs(options: str, threshold: float | str | None) -> dict[str, tuple[float | None, float]]:
    """verl's ``rollout_rs`` / ``rollout_rs_threshold`` (``_parse_rollout_rs_thresholds``): ``{option: (lower or
    None, upper)}`` in the given order, duplicates dropped. Raises ValueError on an unknown option, a missing or
    malformed threshold, a count of thresholds that is neither 1 nor the number of options."""
    if not isinstance(options, str) or not [o for o in options.split(",") if o.strip()]:
        raise ValueError(f"rollout_rs must be a comma-separated string of options, got {options!r}")
    names = list(dict.fromkeys(o.strip() for o in options.split(",") if o.strip()))
    for name in names:
        if name not in OPTIONS:
            raise ValueError(f"unknown rejection-sampling option {name!r}; valid: {', '.join(OPTIONS)}")
    if threshold is None:
        raise ValueError("rollout_rs_threshold must be set when rollout_rs is (e.g. '0.6_1.6' for token_k1)")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float, str)):
        raise ValueError(f"rollout_rs_threshold must be a number or a string, got {threshold!r}")
    specs = [str(threshold)] if not isinstance(threshold, str) else [s.strip() for s in threshold.split(",") if s.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(f"rollout_rs_threshold has {len(specs)} entries: give one shared by all options or "
                         f"one per option ({len(names)}: {', '.join(names)})")
    specs = specs * len(names) if len(specs) == 1 else specs
    out = {}
    for name, spec in zip(names, specs):
        try:
            if name.endswith("k1"):
                low, high = spec.split("_", 1) if "_" in spec else (None, spec)
                upper = float(high)
                lower = float(low) if low is not None else 1.0 / upper
            elif "_" in spec:
                raise ValueError(f"option {name!r} takes one upper bound, not 'lower_upper' ({spec!r})")
            else:
                lower, upper = None, float(spec)
        except (ValueError, ZeroDivisionError) as e:
            raise ValueError(f"bad threshold {spec!r} for option {name!r}: {e}") from None
        if upper <= 0 or (lower is not None and lower <= 0):
            raise ValueError(f"the threshold {spec!r} for option {name!r} must be positive")
        if lower is not None and lower > upper:
            raise ValueError(f"the threshold {spec!r} for option {name!r} needs lower <= upper")
        out[name] = (lower, upper)
    return out


def _seq_max(values: Tensor, mask: Tensor) -> Tensor:
    top = values.masked_fill(~mask.bool(), float("-inf")).amax(-1)
    return torch.where(torch.isinf(top), torch.zeros_like(top), top)


def rejection_mask(old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor,
                   thresholds: dict[str, tuple[float | None, float]]) -> tuple[Tensor, dict[str, Tensor]]:
    """The response mask with rejected tokens zeroed, and verl's metrics (``rollout_rs_<option>_mean`` / ``_max`` /
    ``_min`` / ``_std`` / ``_fraction_high`` / ``_fraction_low`` / ``_seq_mean`` / ``_seq_std`` / ``_seq_max`` /
    ``_seq_min`` / ``_seq_max_deviation`` / ``_seq_fraction_high`` (``_seq_fraction_low`` for k1) /
    ``_masked_fraction`` (of valid tokens) / ``_seq_masked_fraction`` (of sequences with a valid token), and for
    all options together ``rollout_rs_masked_fraction`` / ``rollout_rs_seq_masked_fraction`` (of all sequences)).
    ``thresholds`` comes from :func:`parse_rs`. rlflow: an empty mask is returned as is with no metrics (verl
    raises). All tensors [B, R]."""
    mask = response_mask.to(old_log_probs.dtype)
    if not mask.any():
        return response_mask, {}
    r = (old_log_probs - rollout_log_probs).detach().clamp(-SAFETY_BOUND, SAFETY_BOUND)
    k = {"k1": -r, "k2": 0.5 * r ** 2, "k3": torch.exp(r) - 1.0 - r}
    valid, seq_valid = mask.bool(), mask.sum(-1) > 0
    keep_all = torch.ones_like(mask)
    stats: dict[str, Tensor] = {}
    for name, (lower, upper) in thresholds.items():
        level, est = name.rsplit("_", 1)
        if name.endswith("k1"):  # k1 bounds are on the log scale
            lower, upper = math.log(lower), math.log(upper)
        if level == "token":
            token_stat, seq_stat = k[est], masked_mean(k[est], mask, -1)
        else:
            seq_stat = {"seq_sum": lambda x: masked_sum(x, mask, -1), "seq_mean": lambda x: masked_mean(x, mask, -1),
                        "seq_max": lambda x: _seq_max(x, mask)}[level](k[est])
            token_stat = seq_stat[:, None].expand_as(mask)
        keep = (token_stat <= upper) & (token_stat >= lower if lower is not None else True)
        keep_all = keep_all * keep.to(mask.dtype)
        p, sv = f"rollout_rs_{name}", seq_stat[seq_valid]
        low = lower if lower is not None else 0.0
        units, unit_mask = (sv, None) if level != "token" else (token_stat, mask)
        frac = (lambda b: b.to(mask.dtype).mean()) if unit_mask is None else (lambda b: masked_mean(b.to(mask.dtype), mask))
        stats[f"{p}_mean"] = masked_mean(token_stat, mask)
        stats[f"{p}_max"] = sv.max() if level != "token" else token_stat.masked_fill(~valid, float("-inf")).max()
        stats[f"{p}_min"] = sv.min() if level != "token" else token_stat.masked_fill(~valid, float("inf")).min()
        stats[f"{p}_fraction_high"] = frac(units > upper)
        stats[f"{p}_fraction_low"] = frac(units < low) if lower is not None else mask.new_zeros(())
        clamped = token_stat.clamp(min=low, max=upper)
        var = masked_mean(clamped ** 2, mask) - masked_mean(clamped, mask) ** 2
        stats[f"{p}_std"] = var.clamp_min(0).sqrt() if mask.sum() > 1 else mask.new_zeros(())
        stats[f"{p}_seq_mean"], stats[f"{p}_seq_max"], stats[f"{p}_seq_min"] = sv.mean(), sv.max(), sv.min()
        stats[f"{p}_seq_std"] = sv.std() if sv.numel() > 1 else mask.new_zeros(())
        stats[f"{p}_seq_max_deviation"] = sv.abs().max()
        stats[f"{p}_seq_fraction_high"] = (sv > upper).to(mask.dtype).mean()
        if lower is not None:
            stats[f"{p}_seq_fraction_low"] = (sv < lower).to(mask.dtype).mean()
        stats[f"{p}_masked_fraction"] = masked_mean((~keep).to(mask.dtype), mask)
        stats[f"{p}_seq_masked_fraction"] = (~keep & valid).any(-1)[seq_valid].to(mask.dtype).mean()
    stats["rollout_rs_masked_fraction"] = masked_mean(1 - keep_all, mask)
    stats["rollout_rs_seq_masked_fraction"] = ((keep_all < 0.5) & valid).any(-1).to(mask.dtype).mean()
    return (response_mask * keep_all).to(response_mask.dtype), stats


class RejectionSampling(BatchModule):
    """Zeroes ``response_mask`` where the training policy and the sampler disagree beyond a threshold (verl
    ``rollout_rs`` / ``rollout_rs_threshold``; see the module docstring and :func:`rejection_mask`).

    Reads ``old_log_probs`` (one extra forward pass) and ``rollout_log_probs``; ``stats`` holds verl's metrics
    under ``rollout_corr/`` (e.g. ``rollout_corr/rollout_rs_masked_fraction``). Chain it after the estimator and
    after :class:`TruncatedIS` (whose weights and stats use the mask before rejection, as verl).

    Args:
        options: comma-separated options, e.g. ``"token_k1"``, ``"token_k1,seq_max_k2"``.
        threshold: one entry shared by all options or one per option, comma-separated (``"0.6_1.6,2.5"``).
    """

    in_keys = (OLD_LOG_PROBS, ROLLOUT_LOG_PROBS, RESPONSE_MASK)
    out_keys = (RESPONSE_MASK,)

    def __init__(self, options: str = "token_k1", threshold: float | str | None = None):
        self.thresholds = parse_rs(options, threshold)
        self.options, self.threshold = ",".join(self.thresholds), threshold
        self.stats: dict[str, float] = {}

    @torch.no_grad()
    def forward(self, batch: TensorDict) -> TensorDict:
        mask, stats = rejection_mask(batch[OLD_LOG_PROBS], batch[ROLLOUT_LOG_PROBS], batch[RESPONSE_MASK],
                                     self.thresholds)
        batch.set(RESPONSE_MASK, mask)
        values = torch.stack([v.float() for v in stats.values()]).tolist() if stats else []  # one device sync
        self.stats = {f"rollout_corr/{k}": v for k, v in zip(stats, values)}
        return batch

    def __repr__(self) -> str:
        return f"RejectionSampling(options={self.options!r}, threshold={self.threshold!r})"
