"""The hand-written chunked LM head (forward and backward) against autograd over full logits."""

import pytest
import torch
from torch import nn

from rlflow.models.logprobs import ChunkedHeadLogProbs, auto_chunk_tokens, head_log_probs


def full_logits_reference(hidden, head, ids, temperature):
    logits = head(hidden).float() / temperature
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, ids[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature, chunk, use_entropy", [(1.0, 5, True), (0.7, 3, True), (1.3, 64, False)])
def test_values_and_gradients_equal_autograd(temperature, chunk, use_entropy):
    torch.manual_seed(0)
    N, H, V = 17, 8, 50
    head = nn.Linear(H, V, bias=False)
    hidden = torch.randn(N, H, requires_grad=True)
    ids = torch.randint(V, (N,))
    g_lp, g_ent = torch.randn(N), torch.randn(N)
    results = []
    for fused in (True, False):
        h = hidden.detach().clone().requires_grad_(True)
        head.zero_grad()
        if fused:
            lp, ent = ChunkedHeadLogProbs.apply(h, head.weight, ids, temperature, chunk, torch.float32)
        else:
            lp, ent = full_logits_reference(h, head, ids, temperature)
        loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if use_entropy else 0)
        loss.backward()
        results.append((lp.detach(), ent.detach(), h.grad.clone(), head.weight.grad.clone()))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bf16_autocast_matches_the_module_under_autocast():
    """Under autocast the matrix products run in bf16 like ``head(hidden)`` does; the softmax in float32."""
    torch.manual_seed(1)
    head = nn.Linear(16, 40, bias=False)
    hidden, ids = torch.randn(9, 16, requires_grad=True), torch.randint(40, (9,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent = head_log_probs(hidden, ids, head, chunk_tokens=4)
        want_lp, want_ent = full_logits_reference(hidden, head, ids, 1.0)
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=1e-5)
    lp.sum().backward()
    assert hidden.grad.dtype == torch.float32 and head.weight.grad.dtype == torch.float32


def test_other_heads_take_the_checkpointed_path_with_the_same_result():
    torch.manual_seed(2)
    biased = nn.Linear(8, 30)
    plain = nn.Linear(8, 30, bias=False)
    plain.weight.data.copy_(biased.weight.data)
    biased.bias.data.zero_()
    hidden, ids = torch.randn(11, 8), torch.randint(30, (11,))
    for a, b in zip(head_log_probs(hidden, ids, biased, chunk_tokens=4), head_log_probs(hidden, ids, plain, chunk_tokens=4)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_auto_chunk_bounds_the_float32_logits():
    assert auto_chunk_tokens(151_936) == 441  # 256 MiB of float32 logits at Qwen2.5's vocabulary
    assert auto_chunk_tokens(40) > 1_000_000  # a tiny vocabulary: every position in one chunk
