"""Activation offloading (verl's model.enable_activation_offload): the update's forward pass keeps what backward
needs through torch's save_on_cpu, with the same loss and gradients; scoring passes are untouched
(tests/config/test_activation_offload_keys.py: verl's keys reach Policy and Critic)."""

import copy

import pytest
import torch
from tensordict import TensorDict

from rlflow import Critic, Policy
from rlflow.data import keys as K


def batch(vocab):
    g = torch.Generator().manual_seed(0)
    return TensorDict({K.PROMPT_IDS: torch.randint(3, vocab, (3, 5), generator=g),
                       K.PROMPT_MASK: torch.ones(3, 5, dtype=torch.long),
                       K.RESPONSE_IDS: torch.randint(3, vocab, (3, 4), generator=g),
                       K.RESPONSE_MASK: torch.ones(3, 4)}, [3])


def grads_and_outer_packs(role, loss_of):
    """Gradients of ``loss_of(role)`` and how many tensors an outer saved-tensor hook saw (an inner save_on_cpu
    takes them first)."""
    packs = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packs.append(1) or t, lambda t: t):
        loss = loss_of(role)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in role.module.parameters() if p.grad is not None], len(packs)


@pytest.mark.parametrize("kind", ["policy", "critic"])
def test_same_loss_and_gradients_with_activations_offloaded(model, tokenizer, kind):
    b = batch(len(tokenizer))
    if kind == "policy":
        make = lambda off: Policy(copy.deepcopy(model), tokenizer, activation_offload=off)  # noqa: E731
        loss_of = lambda p: sum(t.sum() for t in p.log_probs(b))  # noqa: E731
    else:
        make = lambda off: Critic(copy.deepcopy(model), activation_offload=off)  # noqa: E731
        loss_of = lambda c: (c.values(b) - 1.0).pow(2).sum()  # noqa: E731
    plain, offloaded = grads_and_outer_packs(make(False), loss_of), grads_and_outer_packs(make(True), loss_of)
    assert torch.equal(plain[0], offloaded[0]) and len(plain[1]) == len(offloaded[1]) > 0
    assert all(torch.equal(a, o) for a, o in zip(plain[1], offloaded[1]))
    assert offloaded[2] * 10 < plain[2]  # offloaded: save_on_cpu holds the forward pass's saved tensors (the loss's own are outside)
    with torch.no_grad():  # scoring: nothing is saved, so nothing to offload
        make(True)(b)
