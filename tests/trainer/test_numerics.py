"""Numerical hazards are counted in the metrics and survived: non-finite rewards that reach the estimator,
empty responses, an all-masked batch, zero-variance groups, non-finite advantages."""

import math

import pytest
import torch

from rlflow import GRPO, FunctionReward, HFRollout, keys as K
from rlflow.module import BatchModule
from rlflow.trainer.numerics import NumericsWarning, zero_variance_group_frac

from .helpers import make_trainer, params


class RawScores(BatchModule):
    """A reward written as a plain module (not a ``Reward``): nothing upstream sanitises what it writes."""

    in_keys = (K.RESPONSE_MASK,)
    out_keys = (K.SCORES, K.TOKEN_REWARDS)

    def forward(self, batch):
        mask = batch[K.RESPONSE_MASK]
        scores = torch.arange(mask.shape[0], dtype=torch.float32) % 3
        scores[1], scores[6] = float("nan"), float("inf")
        last = mask.cumsum(-1).argmax(-1)
        batch[K.SCORES] = scores
        batch[K.TOKEN_REWARDS] = torch.zeros(mask.shape).scatter(1, last[:, None], scores[:, None])
        return batch


class Masking(HFRollout):
    """A rollout whose chosen samples come back with no valid token (as a tool turn masked whole would)."""

    def __init__(self, empty, **kw):
        super().__init__(**kw)
        self.empty = empty

    def forward(self, batch):
        batch = super().forward(batch)
        mask = batch[K.RESPONSE_MASK].clone()
        mask[self.empty(mask.shape[0])] = 0
        batch[K.RESPONSE_MASK] = mask
        return batch


def finite(metrics):
    return all(math.isfinite(v) for v in metrics.values() if isinstance(v, float))


def test_non_finite_rewards_reaching_the_estimator(model, tokenizer, addition_rows, tmp_path):
    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path, max_steps=1)
    trainer.reward = RawScores()
    before = params(trainer.policy.model)
    with pytest.warns(NumericsWarning, match=r"row\(s\) \[1, 6\]; scored 0\.0"):
        (m,) = trainer.fit(data)
    assert m["numerics/non_finite_reward_frac"] == 2 / 32 and m["actor/skipped_frac"] == 0.0 and finite(m)
    assert any(not torch.equal(a, b) for a, b in zip(before, params(trainer.policy.model)))


def test_function_reward_counts_its_own_non_finite_scores(model, tokenizer, addition_rows, tmp_path):
    def sometimes_nan(solution_str, ground_truth):
        return float("nan") if len(set(solution_str)) % 2 else float(solution_str[:1].isdigit())

    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path, max_steps=1)
    trainer.reward = FunctionReward(sometimes_nan)
    with pytest.warns(UserWarning):
        (m,) = trainer.fit(data)
    assert m["reward/non_finite"] > 0 and m["numerics/non_finite_reward_frac"] == 0.0 and finite(m)


def test_empty_responses(model, tokenizer, addition_rows, tmp_path):
    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path, max_steps=1)
    trainer.rollout = Masking(lambda b: slice(0, b, 2), n=4, max_new_tokens=4)
    trainer.rollout.bind(trainer.policy.model, tokenizer)
    (m,) = trainer.fit(data)
    assert m["numerics/empty_response_frac"] == 0.5 and m["actor/skipped_frac"] == 0.0 and finite(m)


def test_all_masked_batch_skips_the_update(model, tokenizer, addition_rows, tmp_path):
    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path, max_steps=2)
    trainer.rollout = Masking(lambda b: slice(None), n=4, max_new_tokens=4)
    trainer.rollout.bind(trainer.policy.model, tokenizer)
    before = params(trainer.policy.model)
    history = trainer.fit(data)
    assert [m["actor/skipped_frac"] for m in history] == [1.0, 1.0]
    assert all(m["numerics/empty_response_frac"] == 1.0 and finite(m) for m in history)
    assert all(torch.equal(a, b) for a, b in zip(before, params(trainer.policy.model)))  # no weight decay either


def test_zero_variance_groups(model, tokenizer, addition_rows, tmp_path):
    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path, max_steps=1)
    trainer.reward = FunctionReward(lambda solution_str, ground_truth: 1.0)
    (m,) = trainer.fit(data)
    assert m["numerics/zero_variance_group_frac"] == 1.0 and m["critic/advantages/max"] == 0.0
    assert m["actor/pg_loss"] == 0.0 and finite(m)


def test_zero_variance_group_frac_by_hand():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 5.0, 2.0, 2.0, 2.0])
    group = torch.tensor([0, 0, 1, 1, 2, 3, 3, 3])
    # group 0 and group 3 are constant, group 1 is not, group 2 is a singleton (no variance to speak of): 2 / 3
    assert zero_variance_group_frac(scores, group) == pytest.approx(2 / 3)


def test_non_finite_advantages_are_counted_and_the_step_skipped(model, tokenizer, addition_rows, tmp_path):
    class Broken(GRPO):
        def compute(self, batch):
            adv, ret = super().compute(batch)
            return adv + float("nan"), ret

    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path, estimator=Broken(), max_steps=1)
    (m,) = trainer.fit(data)
    assert m["numerics/non_finite_advantage_frac"] == 1.0 and m["actor/skipped_frac"] == 1.0
