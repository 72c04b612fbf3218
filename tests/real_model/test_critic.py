"""A critic from the real model (verl's default: the critic starts from the actor's checkpoint): values have the
response's shape and value-loss steps train it, head first, then the backbone."""

from __future__ import annotations

import torch

from rlflow import Critic, HFRollout, ValueLoss
from rlflow.data import keys as K
from tests.real_model.helpers import chat_batch

QUESTIONS = ("What is the capital of France? Answer in one word.", "Name a color.")


def test_critic_values_have_the_response_shape_and_a_value_loss_step_trains_it(smollm2_dir, policy, tok):
    critic = Critic.from_pretrained(smollm2_dir)
    greedy = HFRollout(n=1, do_sample=False, max_new_tokens=12)  # the first stops at 8, the second at 12
    greedy.bind(policy.model, tok)
    batch = critic(greedy(chat_batch(tok, QUESTIONS)))
    mask = batch[K.RESPONSE_MASK]
    assert batch[K.VALUES].shape == batch[K.RESPONSE_IDS].shape and batch[K.VALUES].dtype == torch.float32
    assert (mask == 0).any() and batch[K.VALUES].eq(0).all()  # the head starts at 0 (values masked after the EOS)

    batch[K.OLD_VALUES] = batch[K.VALUES]
    batch[K.RETURNS] = torch.linspace(0.2, 1.0, mask.shape[1]).expand_as(mask) * mask  # a target per token
    head, last_mlp = critic.module.value_head, critic.module.lm.model.layers[-1].mlp.down_proj
    before = last_mlp.weight.detach().clone()
    opt = torch.optim.SGD(critic.module.parameters(), lr=1e-4)  # no optimizer state: 135M parameters stay cheap
    losses = []
    for step in range(2):
        batch[K.VALUES] = critic.values(batch)  # under autograd
        out = ValueLoss(clip_range=None)(batch)
        out.loss.backward()
        assert head.weight.grad.abs().max() > 0
        if step == 0:  # the zero head passes no gradient to the backbone on the first step...
            assert last_mlp.weight.grad is None or last_mlp.weight.grad.eq(0).all()
        else:  # ...and does once it has moved
            assert last_mlp.weight.grad.abs().max() > 0
        opt.step()
        opt.zero_grad(set_to_none=False)
        losses.append(out.loss.item())
    assert losses[1] < losses[0] and out.stats["critic/vf_loss"] == losses[1]
    assert not torch.equal(last_mlp.weight, before)
    values = critic(batch.clone())[K.VALUES]
    assert values[mask == 0].eq(0).all() and values[mask == 1].abs().min() > 0
