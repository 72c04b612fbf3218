"""PF-PPO (policy filtration, verl's ``algorithm.use_pf_ppo``): after the advantages, the batch is resampled
with replacement, each sample drawn with a weight computed from its score, so that training leans on the
samples whose reward is most reliable (verl's ``compute_pf_ppo_reweight_data``).

Weights of the scores ``s`` (one per sample): ``pow``: ``|s| ** weight_pow``; ``max_min``: 1 for the batch's
highest and lowest scores, else 0; ``max_random``: 0.4 for the highest, 0.1 for the others; each plus ``1e-8``
(every sample keeps a chance). ``B`` rows are drawn by ``torch.multinomial`` from the global RNG (the Trainer
seeds it), as verl does; on several processes each resamples its own share.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rlflow.data.keys import ADVANTAGES, SCORES
from rlflow.module import BatchModule

REWEIGHT_METHODS = ("pow", "max_min", "max_random")


def pf_ppo_weights(scores: torch.Tensor, method: str = "pow", weight_pow: float = 2.0) -> torch.Tensor:
    """The sampling weight of each score (module docstring), clamped to at least ``1e-8``."""
    if method == "pow":
        weights = scores.abs().pow(weight_pow)
    elif method == "max_min":
        weights = ((scores == scores.max()) | (scores == scores.min())).to(scores.dtype)
    elif method == "max_random":
        weights = torch.where(scores == scores.max(), 0.4, 0.1).to(scores.dtype)
    else:
        raise ValueError(f"unknown PF-PPO reweight_method {method!r}; valid: {', '.join(REWEIGHT_METHODS)}")
    return torch.clamp(weights + 1e-8, min=1e-8)


class PFPPO(BatchModule):
    """Resamples the rows of a batch (with advantages) by the weights of their ``scores``.

    Args:
        reweight_method: ``"pow"``, ``"max_min"`` or ``"max_random"`` (verl ``algorithm.pf_ppo.reweight_method``).
        weight_pow: the power of ``pow`` (verl ``algorithm.pf_ppo.weight_pow``).
    """

    in_keys = (SCORES, ADVANTAGES)
    out_keys = ()

    def __init__(self, reweight_method: str = "pow", weight_pow: float = 2.0):
        if reweight_method not in REWEIGHT_METHODS:
            raise ValueError(f"unknown PF-PPO reweight_method {reweight_method!r}; valid: {', '.join(REWEIGHT_METHODS)}")
        self.reweight_method, self.weight_pow = reweight_method, float(weight_pow)
        self.stats: dict[str, float] = {}

    @torch.no_grad()
    def forward(self, batch: TensorDict) -> TensorDict:
        scores = batch[SCORES].float()
        weights = pf_ppo_weights(scores, self.reweight_method, self.weight_pow)
        rows = torch.multinomial(weights.cpu(), scores.shape[0], replacement=True).to(scores.device)
        self.stats = {"pf_ppo/unique_fraction": rows.unique().numel() / max(scores.shape[0], 1)}
        return batch[rows]
