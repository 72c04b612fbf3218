"""Per-step metrics under verl's names (``critic/score/mean``, ``response_length/mean``, ...)."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from tensordict import TensorDict

from rlflow.algorithms.mismatch import MismatchMetrics  # noqa: F401 - the Trainer's, beside its other metrics
from rlflow.data import keys as K
from rlflow.trainer.watchdog import phase  # the phase a fault report names


def _summary(prefix: str, values: torch.Tensor) -> dict[str, torch.Tensor]:
    if values.numel() == 0:
        return {}
    v = values.float()
    return {f"{prefix}/mean": v.mean(), f"{prefix}/max": v.max(), f"{prefix}/min": v.min()}


def host_floats(values: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """``{name: float}`` from 0-d tensors and numbers, with one device-to-host copy for all the tensors
    (one ``.item()`` each would wait for the device once per metric)."""
    names = [k for k, v in values.items() if isinstance(v, torch.Tensor)]
    if not names:
        return {k: float(v) for k, v in values.items()}
    tensors = [values[k].detach().reshape(()) for k in names]
    device = tensors[0].device
    copied = dict(zip(names, torch.stack([t.to(device, torch.float64) for t in tensors]).tolist()))
    return {k: copied[k] if k in copied else float(v) for k, v in values.items()}


def batch_metrics(batch: TensorDict, max_response_length: int | None = None) -> dict[str, float]:
    """Data metrics of one step: scores, rewards, advantages, returns, values, lengths."""
    mask = batch[K.RESPONSE_MASK].bool()
    out: dict[str, torch.Tensor] = {}
    out |= _summary("critic/score", batch[K.SCORES])
    keys = batch.keys()
    if K.TOKEN_REWARDS in keys:
        out |= _summary("critic/rewards", batch[K.TOKEN_REWARDS].sum(-1))
    for key, name in ((K.ADVANTAGES, "critic/advantages"), (K.RETURNS, "critic/returns"), (K.VALUES, "critic/values")):
        if key in keys:
            out |= _summary(name, batch[key][mask])
    if K.VALUES in keys and K.RETURNS in keys and mask.any():
        ret, val = batch[K.RETURNS][mask], batch[K.VALUES][mask]
        out["critic/vf_explained_var"] = 1 - (ret - val).var() / (ret.var() + 1e-5)
    resp_len = batch[K.RESPONSE_MASK].sum(-1)
    out |= _summary("response_length", resp_len)
    R = max_response_length or batch[K.RESPONSE_IDS].shape[1]
    out["response_length/clip_ratio"] = (resp_len >= R).float().mean()
    out |= _summary("prompt_length", batch[K.PROMPT_MASK].sum(-1))
    return host_floats(out)


class Timer:
    """Collects ``timing_s/<phase>`` wall times: ``with timer("gen"): ...``."""

    def __init__(self):
        self.times: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            with phase(name):
                yield
        finally:
            self.times[name] += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{k}": v for k, v in self.times.items()}


def sum_micro_batches(stats: list[dict[str, float]], additive: frozenset[str]) -> dict[str, float]:
    """One mini-batch's statistics from its micro-batches'.

    Loss terms (``additive``) are each micro-batch's share of the mini-batch loss,
    so they add up; fractions and means are averaged.
    """
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for s in stats for k in s):
        values = [s[key] for s in stats if key in s]
        out[key] = sum(values) if key in additive else sum(values) / len(values)
    return out


class MeanAccumulator:
    """Averages named statistics over mini-batches (and epochs)."""

    def __init__(self):
        self.sums: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def add(self, stats: dict[str, float]) -> None:
        for k, v in stats.items():
            self.sums[k] += float(v)
            self.counts[k] += 1

    def means(self) -> dict[str, float]:
        return {k: self.sums[k] / self.counts[k] for k in self.sums}
