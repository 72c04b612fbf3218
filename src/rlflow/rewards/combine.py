"""Several rewards as one: a weighted sum, each part logged under its own name (TRL's ``reward_funcs`` +
``reward_weights``).

``score = sum_k w_k * score_k`` per sample ([B]); the total goes to ``scores`` / ``token_rewards`` and from
there to verl's ``critic/score/*`` and ``critic/rewards/*`` metrics. Per part ``k`` (its ``name``):

- ``reward/<name>/mean``, ``/min``, ``/max``: its unweighted scores;
- ``reward/<name>/<stat>``: its own counters (``reward/errors`` -> ``reward/<name>/errors``, its
  ``reward/extra/acc`` -> ``reward/<name>/extra/acc``), while ``reward/errors``, ``reward/timeouts``,
  ``reward/non_finite`` also hold the sums over the parts;
- ``extras["<name>/<key>"]`` per row (and ``extras["<key>"]`` when only one part has that key, so
  ``acc`` still drives validation and dynamic sampling), plus ``extras["<name>"]`` = its scores.

Parts that are thread-safe (function, code and sandbox rewards: ``thread_safe = True``) run on threads
while the others (reward models, judges: collectives, shared engines) run one after the other on the
calling thread, so CPU scoring hides behind model scoring.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from tensordict import TensorDict

from rlflow import roles
from rlflow.data.keys import RM_SCORES, SCORES
from rlflow.rewards.base import Reward
from rlflow.rewards.function import FunctionReward

COUNTERS = ("reward/errors", "reward/timeouts", "reward/non_finite")


def as_reward(part: Reward | Callable[..., Any], **function_kwargs: Any) -> Reward:
    """A Reward as it is; any callable wrapped in :class:`~rlflow.rewards.FunctionReward`."""
    if isinstance(part, Reward):
        return part
    if callable(part):
        return FunctionReward(part, **function_kwargs)
    raise TypeError(f"a reward must be a Reward or a callable, got {type(part).__name__}")


class CombinedReward(Reward):
    """A weighted sum of rewards (module docs above).

    Args:
        rewards: a list of rewards or functions (any form ``FunctionReward`` accepts), or a dict
            ``{name: reward}`` to name them.
        weights: one per reward (a list, or a dict by name); default 1.0 each. Any finite number.
        concurrent: run thread-safe parts on threads beside the others (default True).
    """

    def __init__(self, rewards: Sequence[Reward | Callable] | Mapping[str, Reward | Callable],
                 weights: Sequence[float] | Mapping[str, float] | None = None, *, concurrent: bool = True):
        super().__init__()
        named = list(rewards.items()) if isinstance(rewards, Mapping) else [(None, r) for r in rewards]
        if not named:
            raise ValueError("CombinedReward needs at least one reward")
        self.parts = [as_reward(r) for _, r in named]
        self.names = _unique([name or getattr(r, "name", None) or type(r).__name__ for (name, _), r in
                              zip(named, self.parts)])
        if weights is None:
            weights = [1.0] * len(self.parts)
        elif isinstance(weights, Mapping):
            unknown = set(weights) - set(self.names)
            if unknown:
                raise ValueError(f"weights for unknown reward(s) {sorted(unknown)}; rewards: {self.names}")
            weights = [weights.get(n, 1.0) for n in self.names]
        weights = [float(w) for w in weights]
        if len(weights) != len(self.parts):
            raise ValueError(f"{len(weights)} weights for {len(self.parts)} rewards ({self.names})")
        if any(w != w or abs(w) == float("inf") for w in weights):
            raise ValueError(f"weights must be finite numbers, got {weights}")
        self.weights, self.concurrent = weights, concurrent
        self.in_keys = tuple(dict.fromkeys(k for r in self.parts for k in r.in_keys))
        self.name = "+".join(self.names)

    def __repr__(self) -> str:
        parts = ", ".join(f"{w:g} * {r!r}" for r, w in zip(self.parts, self.weights))
        return f"CombinedReward({parts})"

    def close(self) -> None:
        for part in self.parts:
            if hasattr(part, "close"):
                part.close()

    def score(self, batch: TensorDict) -> torch.Tensor:
        threaded = [i for i, r in enumerate(self.parts) if self.concurrent and getattr(r, "thread_safe", False)]
        scores: dict[int, torch.Tensor] = {}
        pool = ThreadPoolExecutor(len(threaded), thread_name_prefix="rlflow-reward") if len(threaded) > 1 or (
            threaded and len(threaded) < len(self.parts)) else None
        try:
            futures = {i: pool.submit(self._part_scores, i, batch) for i in threaded} if pool else {}
            for i in range(len(self.parts)):
                if i not in futures:
                    scores[i] = self._part_scores(i, batch)
            for i, future in futures.items():
                scores[i] = future.result()
        finally:
            if pool is not None:
                pool.shutdown(wait=True)
        total = torch.zeros_like(scores[0])
        key_owners: dict[str, list[str]] = collections.defaultdict(list)
        for i, (part, name, weight) in enumerate(zip(self.parts, self.names, self.weights)):
            total = total + weight * scores[i]
            self._log_part(name, part, scores[i])
            self.extras[name] = scores[i].tolist()
            for key, values in roles.optional(part, roles.Reward, "extras").items():
                self.extras[f"{name}/{key}"] = values
                key_owners[key].append(name)
        for key, owners in key_owners.items():
            if len(owners) == 1 and key not in self.extras:
                self.extras[key] = self.extras[f"{owners[0]}/{key}"]
        return total

    def _part_scores(self, i: int, batch: TensorDict) -> torch.Tensor:
        out = self.parts[i](batch.clone(False))  # a shallow copy: parts write their own scores
        return out[SCORES].to(torch.float32)

    def _log_part(self, name: str, part: Reward, scores: torch.Tensor) -> None:
        if scores.numel():
            self.stats |= {f"reward/{name}/mean": scores.mean().item(), f"reward/{name}/min": scores.min().item(),
                           f"reward/{name}/max": scores.max().item()}
        for key, value in roles.optional(part, roles.Reward, "stats").items():
            self.stats[f"reward/{name}/{key.removeprefix('reward/')}"] = value
            if key in COUNTERS:
                self.stats[key] = self.stats.get(key, 0.0) + value


def _unique(names: list[str]) -> list[str]:
    """Names made distinct by suffixes: ``[f, f, g]`` -> ``[f, f_2, g]``."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return out


class WithRMScore(Reward):
    """Runs a reward model, then ``reward`` with each sample's reward-model score at hand.

    The model's scores go into the batch as ``rm_scores``; a function reward whose function names
    ``rm_score`` (``rm_scores`` in the batch forms) receives them. This is verl's default when the reward
    model is on and a custom reward function is set (the function alone gives the score, asking the
    reward model itself). The result is ``reward``'s score; the model's scores are logged as
    ``reward/<model name>/mean`` and kept in ``extras["rm_score"]``.
    """

    def __init__(self, model: Reward, reward: Reward | Callable):
        super().__init__()
        self.model, self.reward = model, as_reward(reward)
        if getattr(self.reward, "rm_argument", "") is None:
            raise ValueError(f"{self.reward!r} does not take rm_score (or rm_scores): give its function that parameter")
        self.in_keys = tuple(dict.fromkeys((*model.in_keys, *(k for k in self.reward.in_keys if k != RM_SCORES))))
        self.name = getattr(self.reward, "name", "reward")

    def __repr__(self) -> str:
        return f"WithRMScore({self.model!r}, {self.reward!r})"

    def score(self, batch: TensorDict) -> torch.Tensor:
        rm = self.model(batch.clone(False))[SCORES].to(torch.float32)
        inner = batch.clone(False)
        inner.set(RM_SCORES, rm)
        scores = self.reward(inner)[SCORES]
        name = getattr(self.model, "name", "reward_model")
        if rm.numel():
            self.stats |= {f"reward/{name}/mean": rm.mean().item(), f"reward/{name}/min": rm.min().item(),
                           f"reward/{name}/max": rm.max().item()}
        for part in (self.model, self.reward):
            for key, value in roles.optional(part, roles.Reward, "stats").items():
                self.stats[key] = self.stats.get(key, 0.0) + value if key in COUNTERS else value
        self.extras |= roles.optional(self.reward, roles.Reward, "extras")
        self.extras["rm_score"] = rm.tolist()
        return scores
