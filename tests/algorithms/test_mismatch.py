"""verl's sampler-vs-trainer mismatch metrics: by hand from verl's formulas (calculate_debug_metrics,
compute_offpolicy_metrics), collected over micro-batches, and logged by the Trainer: ~0 when the sampler is the
float32 policy itself, visibly not when it samples in bf16."""

import copy
import math
import statistics

import pytest
import torch
from tensordict import TensorDict

from rlflow import GRPO, FunctionReward, HFRollout, Policy, PPOLoss, PromptData, Trainer
from rlflow.algorithms.mismatch import MismatchMetrics, mismatch_metrics
from rlflow.data import keys as K
from rlflow.trainer.options import with_groups
from tests.trainer.helpers import starts_with_digit

OLD = [[-0.5, -1.0, -2.0, -7.0], [-0.1, -3.0, -9.0, -9.0], [-4.0, -4.0, -4.0, -4.0]]
ROLLOUT = [[-0.7, -0.9, -2.5, -1.0], [-0.3, -2.0, -1.0, -1.0], [-1.0, -1.0, -1.0, -1.0]]
MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]]  # padding, and a row without a valid token (left out)
ROLLOUT[1][3] = -math.inf  # what padding holds must not matter


def by_hand():
    """Plain Python over the valid tokens, each formula as verl writes it."""
    toks = [(o, r) for ro, rr, rm in zip(OLD, ROLLOUT, MASK) for o, r, m in zip(ro, rr, rm) if m]
    seqs = [([o for o, m in zip(ro, rm) if m], [r for r, m in zip(rr, rm) if m])
            for ro, rr, rm in zip(OLD, ROLLOUT, MASK) if any(rm)]
    diff = [abs(math.exp(o) - math.exp(r)) for o, r in toks]
    mean = statistics.fmean
    m_old = [mean(o) for o, _ in seqs]
    m_roll = [mean(r) for _, r in seqs]
    d = [b - a for a, b in zip(m_old, m_roll)]
    return {
        "training/rollout_probs_diff_valid": 1.0,
        "training/rollout_probs_diff_max": max(diff),
        "training/rollout_probs_diff_mean": mean(diff),
        "training/rollout_probs_diff_std": statistics.stdev(diff),
        "training/rollout_actor_probs_pearson_corr": statistics.correlation(
            [math.exp(o) for o, _ in toks], [math.exp(r) for _, r in toks]),
        "rollout_corr/training_ppl": mean(math.exp(-m) for m in m_old),
        "rollout_corr/training_log_ppl": mean(-m for m in m_old),
        "rollout_corr/kl": mean(r - o for o, r in toks),
        "rollout_corr/k3_kl": mean(math.exp(o - r) - (o - r) - 1 for o, r in toks),
        "rollout_corr/rollout_ppl": mean(math.exp(-m) for m in m_roll),
        "rollout_corr/rollout_log_ppl": mean(-m for m in m_roll),
        "rollout_corr/log_ppl_diff": mean(d),
        "rollout_corr/log_ppl_abs_diff": mean(abs(x) for x in d),
        "rollout_corr/log_ppl_diff_max": max(d),
        "rollout_corr/log_ppl_diff_min": min(d),
        "rollout_corr/ppl_ratio": mean(math.exp(x) for x in d),
        "rollout_corr/chi2_token": mean(math.exp(2 * (o - r)) for o, r in toks) - 1,
        "rollout_corr/chi2_seq": mean(math.exp(2 * sum(a - b for a, b in zip(o, r))) for o, r in seqs) - 1,
    }


def test_metrics_by_hand_from_verls_formulas():
    got = mismatch_metrics(torch.tensor(OLD), torch.tensor(ROLLOUT), torch.tensor(MASK))
    want = by_hand()
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def test_micro_batches_of_any_width_add_up_to_the_batch():
    whole = TensorDict({K.OLD_LOG_PROBS: torch.tensor(OLD), K.ROLLOUT_LOG_PROBS: torch.tensor(ROLLOUT),
                        K.RESPONSE_MASK: torch.tensor(MASK)}, batch_size=[3])
    tracker = MismatchMetrics()
    tracker.add(whole[:1])
    tracker.add(whole[1:].apply(lambda t: t[:, :2], batch_size=[2]))  # a micro-batch trimmed of its padding columns
    assert tracker.pop() == pytest.approx(by_hand())
    assert tracker.pop() == {}  # popped: forgotten
    tracker.observe(whole.exclude(K.ROLLOUT_LOG_PROBS))
    assert tracker.pop() == {}  # no sampler log-probs: nothing to log
    empty = whole.clone().set(K.RESPONSE_MASK, torch.zeros(3, 4, dtype=torch.long))
    assert tracker.observe(empty) is empty and tracker.pop() == {"training/rollout_probs_diff_valid": 0.0}


def test_clamped_chi2_and_one_token():
    got = mismatch_metrics(torch.tensor([[0.0]]), torch.tensor([[-30.0]]), torch.tensor([[1]]))
    assert got["rollout_corr/chi2_token"] == pytest.approx(math.exp(40) - 1)  # 2 * clamp(30, 20)
    assert math.isnan(got["training/rollout_probs_diff_std"])  # undefined for one token (verl: NaN)


class BF16Rollout(HFRollout):
    """The HF engine sampling under bf16 autocast (what precision="bf16-mixed" does to generation), while the
    Trainer and its policy stay float32: verl's vLLM-bf16 sampler beside an FSDP-fp32 trainer, in small."""

    def forward(self, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return super().forward(batch)


def run(model, tokenizer, rows, run_dir, rollout_cls, **kwargs):
    trainer = Trainer(
        Policy(copy.deepcopy(model), tokenizer), rollout_cls(n=4, max_new_tokens=4), FunctionReward(starts_with_digit),
        GRPO(), PPOLoss(),
        **with_groups(batch_size=8, lr=1e-3, max_steps=1, run_dir=run_dir, progress=False, seed=0, loggers=(),
                      **kwargs),
    )
    [metrics] = trainer.fit(PromptData(rows[0], seed=0))
    return trainer, metrics


@pytest.mark.parametrize("ppo_epochs", [1, 2])  # 1: no old-log-prob pass (the update's forward); 2: the pass
def test_trainer_logs_mismatch_bf16_sampler_visible_fp32_sampler_zero(model, tokenizer, addition_rows, tmp_path,
                                                                       ppo_epochs):
    trainer, same = run(model, tokenizer, addition_rows, tmp_path / "fp32", HFRollout, ppo_epochs=ppo_epochs)
    assert trainer.needs_old_log_probs == (ppo_epochs > 1)
    _, bf16 = run(model, tokenizer, addition_rows, tmp_path / "bf16", BF16Rollout, ppo_epochs=ppo_epochs)
    # measured (tiny random model, near-uniform over its 47 tokens, so the gaps are small): fp32 sampler
    # diff_max 9e-9, log_ppl_abs_diff 1e-7, k3 0; bf16 sampler 5e-5, 1.7e-4, 7e-8. Bounds 5-10x inside.
    for name, zero, visible in (("training/rollout_probs_diff_max", 1e-7, 1e-5),
                                ("training/rollout_probs_diff_mean", 2e-8, 1e-6),
                                ("rollout_corr/log_ppl_abs_diff", 1e-6, 3e-5), ("rollout_corr/k3_kl", 1e-9, 1e-8)):
        assert same[name] < zero, (name, same[name])  # the sampler is the float32 policy itself
        assert bf16[name] > visible, (name, bf16[name])
    assert same["training/rollout_probs_diff_valid"] == bf16["training/rollout_probs_diff_valid"] == 1.0
    assert same["rollout_corr/training_ppl"] == pytest.approx(same["rollout_corr/rollout_ppl"], rel=1e-6)
