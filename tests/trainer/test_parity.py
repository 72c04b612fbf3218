"""Trainer.fit equals a hand-written loop over the same modules: the Trainer adds no hidden math."""

import copy

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
