"""Rejection sampling (verl rollout_rs): masks and metrics by hand from verl's formulas, threshold parsing,
and the module in a chain."""

import math

import pytest
import torch
from tensordict import TensorDict

from rlflow.algorithms import GRPO, RejectionSampling, TruncatedIS
from rlflow.algorithms.rejection import parse_rs, rejection_mask
from rlflow.data import keys as K
from rlflow.module import Chain


def test_parse_thresholds():
    assert parse_rs("token_k1", "0.6_1.6") == {"token_k1": (0.6, 1.6)}
    assert parse_rs("token_k1", 2.0) == {"token_k1": (0.5, 2.0)}  # one number u: lower = 1/u
    assert parse_rs("token_k1,seq_max_k2", "0.6_1.6,2.5") == {"token_k1": (0.6, 1.6), "seq_max_k2": (None, 2.5)}
    assert parse_rs("seq_mean_k3, token_k2,seq_mean_k3", "0.1") == {"seq_mean_k3": (None, 0.1),
                                                                    "token_k2": (None, 0.1)}
    for options, threshold, match in [("token_k4", "1", "unknown"), ("seq_max_k1", "1", "unknown"),
                                      ("token_k1", None, "must be set"), ("token_k2", "0.1_0.2", "one upper bound"),
                                      ("token_k1,token_k2", "1,2,3", "3 entries"), ("token_k1", "2_1", "lower <= upper"),
                                      ("token_k3", "-1", "positive"), ("token_k3", "abc", "bad threshold")]:
        with pytest.raises(ValueError, match=match):
            parse_rs(options, threshold)


def test_token_k1_by_hand():
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    rollout = torch.tensor([[-1.0, -1.7, -0.4, -9.0]])  # r = old - rollout: 0, 0.7, -0.6, (padding)
    mask = torch.tensor([[1, 1, 1, 0]])
    out, s = rejection_mask(old, rollout, mask, parse_rs("token_k1", "0.6_1.6"))
    # k1 = -r = 0, -0.7, 0.6; kept where log 0.6 = -0.511 <= k1 <= log 1.6 = 0.470: only the first
    assert out.tolist() == [[1, 0, 0, 0]] and out.dtype == mask.dtype
    p = "rollout_rs_token_k1"
    torch.testing.assert_close(s[f"{p}_mean"].item(), (0 - 0.7 + 0.6) / 3)
    torch.testing.assert_close(s[f"{p}_max"].item(), 0.6)
    torch.testing.assert_close(s[f"{p}_min"].item(), -0.7)
    torch.testing.assert_close(s[f"{p}_fraction_high"].item(), 1 / 3)
    torch.testing.assert_close(s[f"{p}_fraction_low"].item(), 1 / 3)
    c = [0.0, math.log(0.6), math.log(1.6)]  # the std is of the statistic clamped to [log lower, log upper]
    m = sum(c) / 3
    torch.testing.assert_close(s[f"{p}_std"].item(), math.sqrt(sum(x * x for x in c) / 3 - m * m), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s[f"{p}_masked_fraction"].item(), 2 / 3)
    assert s[f"{p}_seq_masked_fraction"].item() == 1.0 and s["rollout_rs_seq_masked_fraction"].item() == 1.0
    torch.testing.assert_close(s["rollout_rs_masked_fraction"].item(), 2 / 3)


def test_sequence_forms_by_hand():
    old = torch.zeros(3, 3)
    rollout = torch.tensor([[-0.1, 0.1, 5.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    r = [[0.1, -0.1], [1.0, 0.0, 0.0]]  # valid log-ratios per row; row 2 has none
    k2 = [[x * x / 2 for x in row] for row in r]
    k3 = [[math.exp(x) - 1 - x for x in row] for row in r]
    # seq_max_k2: row 0 max 0.005, row 1 max 0.5; upper 0.1 rejects row 1
    out, s = rejection_mask(old, rollout, mask, parse_rs("seq_max_k2", "0.1"))
    assert out.tolist() == [[1, 1, 0], [0, 0, 0], [0, 0, 0]]
    torch.testing.assert_close(s["rollout_rs_seq_max_k2_max"].item(), 0.5)
    torch.testing.assert_close(s["rollout_rs_seq_max_k2_mean"].item(), (2 * 0.005 + 3 * 0.5) / 5)  # token-weighted
    torch.testing.assert_close(s["rollout_rs_seq_max_k2_fraction_high"].item(), 0.5)  # of the 2 valid sequences
    torch.testing.assert_close(s["rollout_rs_seq_masked_fraction"].item(), 1 / 3)  # of all 3 sequences (verl)
    torch.testing.assert_close(s["rollout_rs_seq_max_k2_seq_masked_fraction"].item(), 0.5)
    # seq_sum_k3 vs seq_mean_k3 with the same upper bound: the sum of row 1 fails 0.3, its mean passes
    total, mean = sum(k3[1]), sum(k3[1]) / 3
    assert total > 0.3 > mean
    out, _ = rejection_mask(old, rollout, mask, parse_rs("seq_sum_k3", "0.3"))
    assert out.tolist() == [[1, 1, 0], [0, 0, 0], [0, 0, 0]]
    out, s = rejection_mask(old, rollout, mask, parse_rs("seq_mean_k3", "0.3"))
    assert out.tolist() == [[1, 1, 0], [1, 1, 1], [0, 0, 0]]
    torch.testing.assert_close(s["rollout_rs_seq_mean_k3_seq_max"].item(), mean)
    # seq_sum_k1 (k1 = -r): row 0 sums to 0, row 1 to -1 < log(0.5); one number u gives lower 1/u
    out, s = rejection_mask(old, rollout, mask, parse_rs("seq_sum_k1", 2))
    assert out.tolist() == [[1, 1, 0], [0, 0, 0], [0, 0, 0]]
    torch.testing.assert_close(s["rollout_rs_seq_sum_k1_seq_fraction_low"].item(), 0.5)
    # token_k2 and two options at once: all must pass
    out, _ = rejection_mask(old, rollout, mask, parse_rs("token_k2", "0.4"))
    assert out.tolist() == [[1, 1, 0], [0, 1, 1], [0, 0, 0]] and max(k2[1]) > 0.4
    out, s = rejection_mask(old, rollout, mask, parse_rs("token_k2,seq_max_k3", "0.4,0.001"))
    assert out.tolist() == [[0, 0, 0], [0, 0, 0], [0, 0, 0]] and max(k3[0]) > 0.001
    assert {"rollout_rs_token_k2_mean", "rollout_rs_seq_max_k3_mean"} <= set(s)


def test_log_ratio_clamped_and_empty_mask():
    old, mask = torch.zeros(1, 2), torch.ones(1, 2)
    _, s = rejection_mask(old, torch.tensor([[-30.0, 0.0]]), mask, parse_rs("token_k2", "1e9"))
    torch.testing.assert_close(s["rollout_rs_token_k2_max"].item(), 200.0)  # r clamped to 20: 20^2 / 2
    out, s = rejection_mask(old, old, torch.zeros(1, 2), parse_rs("token_k2", "1"))
    assert out.tolist() == [[0, 0]] and s == {}


def test_module_in_chain_zeroes_the_mask_after_is_weights():
    b = TensorDict({K.OLD_LOG_PROBS: torch.zeros(2, 2), K.ROLLOUT_LOG_PROBS: torch.tensor([[0.0, 0.0], [-2.0, 0.0]]),
                    K.RESPONSE_MASK: torch.ones(2, 2, dtype=torch.long), K.TOKEN_REWARDS: torch.tensor([[0.0, 1.0], [0.0, 0.0]]),
                    K.GROUP: torch.tensor([0, 0])}, batch_size=[2])
    rs = RejectionSampling("token_k1", "0.5_2.0")
    out = Chain(GRPO(), TruncatedIS("token", 4.0), rs)(b)
    assert out[K.RESPONSE_MASK].tolist() == [[1, 1], [0, 1]]  # k1 = -2 < log 0.5
    torch.testing.assert_close(out[K.IS_WEIGHTS][1, 0], torch.tensor(4.0))  # IS saw the mask before rejection
    assert rs.stats["rollout_corr/rollout_rs_masked_fraction"] == 0.25
    assert repr(rs) == "RejectionSampling(options='token_k1', threshold='0.5_2.0')"
