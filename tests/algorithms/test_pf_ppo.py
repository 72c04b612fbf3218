"""PF-PPO (verl's algorithm.use_pf_ppo): the batch is resampled by weights of its scores (the entry point:
tests/config/test_pf_ppo_keys.py)."""

import pytest
import torch
from tensordict import TensorDict

from rlflow.algorithms import GAE, PFPPO
from rlflow.algorithms.pf_ppo import pf_ppo_weights
from rlflow.data.nontensor import stack


def scored(scores):
    n = len(scores)
    return TensorDict({"scores": torch.tensor(scores), "advantages": torch.arange(n, dtype=torch.float)[:, None],
                       "data_source": stack([f"row{i}" for i in range(n)])}, batch_size=[n])


def test_weights_are_verls():
    s = torch.tensor([-2.0, 0.0, 0.5, 1.0])
    assert torch.allclose(pf_ppo_weights(s, "pow", 2.0), torch.tensor([4.0, 0.0, 0.25, 1.0]) + 1e-8)
    assert torch.allclose(pf_ppo_weights(s, "max_min"), torch.tensor([1.0, 0.0, 0.0, 1.0]) + 1e-8)
    assert torch.allclose(pf_ppo_weights(s, "max_random"), torch.tensor([0.1, 0.1, 0.1, 0.4]) + 1e-8)
    with pytest.raises(ValueError, match="unknown PF-PPO reweight_method 'median'"):
        PFPPO("median")


def test_resampling_keeps_rows_whole_and_follows_the_weights():
    torch.manual_seed(0)
    out = PFPPO("pow", 2.0)(scored([0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]))
    assert out.batch_size == torch.Size([8]) and set(out["scores"].tolist()) == {1.0}  # zero weight: never drawn
    rows = out["advantages"][:, 0].long().tolist()  # each row keeps its own advantage and text
    assert set(rows) <= {2, 5} and list(out["data_source"]) == [f"row{i}" for i in rows]
