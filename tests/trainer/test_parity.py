"""Trainer.fit equals a hand-written loop over the same modules: the Trainer adds no hidden math."""

import copy

import pytest
import torch

from rlflow import GRPO, FunctionReward, HFRollout, Policy, PPOLoss, keys as K
from rlflow.algorithms import Aggregation

from .helpers import make_trainer, params, starts_with_digit


def hand_written_loop(model, tokenizer, data, steps, batch_size, micro_batch_size, lr):
    policy = Policy(copy.deepcopy(model), tokenizer)
    rollout, reward, estimator, loss = HFRollout(n=4, max_new_tokens=4), FunctionReward(starts_with_digit), GRPO(), PPOLoss()
    rollout.bind(policy.model, tokenizer)
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=lr, weight_decay=0.01)
    torch.manual_seed(0)
    loader = data.loader(batch_size, tokenizer)
    for _ in range(steps):
        batch = estimator(reward(rollout(next(loader))))
        mask = batch[K.RESPONSE_MASK]
        agg = Aggregation(num_tokens=mask.sum(), num_seqs=(mask.sum(-1) > 0).sum())  # the mini-batch's counts
        for micro in batch.split(micro_batch_size):
            micro[K.LOG_PROBS], micro[K.ENTROPY] = policy.log_probs(micro)
            micro[K.OLD_LOG_PROBS] = micro[K.LOG_PROBS].detach()
            loss(micro, agg).loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return policy.model


def test_fit_equals_hand_written_loop(model, tokenizer, addition_rows, tmp_path):
    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path, max_steps=3, micro_batch_size=8)
    start = params(trainer.policy.model)
    trainer.fit(data)
    by_hand = hand_written_loop(model, tokenizer, data, steps=3, batch_size=8, micro_batch_size=8, lr=1e-3)
    assert any(not torch.equal(a, b) for a, b in zip(start, params(by_hand)))  # the loop did train
    for a, b in zip(params(trainer.policy.model), params(by_hand)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_fit_equals_the_grpo_loop_recipe(model, tokenizer, addition_rows, tmp_path):
    """recipes/grpo_loop.py (collect from the experience stream, learn with Fabric by hand) trains the same
    weights and logs the same scores as Trainer.fit, with micro-batches (gradient accumulation)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("grpo_loop", Path(__file__).parents[2] / "recipes" / "grpo_loop.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path, max_steps=3, micro_batch_size=4)
    history = trainer.fit(data)
    policy = Policy(copy.deepcopy(model), tokenizer)
    by_hand = recipe.grpo_loop(policy, data, FunctionReward(starts_with_digit), steps=3, batch_size=8,
                               micro_batch_size=4, lr=1e-3)
    assert any(not torch.equal(a, b) for a, b in zip(params(model), params(policy.model)))  # it did train
    for a, b in zip(params(trainer.policy.model), params(policy.model)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    for key in ("critic/score/mean", "response_length/mean", "actor/grad_norm", "actor/pg_loss"):
        assert [m[key] for m in by_hand] == pytest.approx([m[key] for m in history], rel=1e-5, abs=1e-6), key
