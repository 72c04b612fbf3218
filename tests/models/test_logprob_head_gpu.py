"""The chunked LM head on CUDA at a 150k vocabulary under bf16 autocast: the values and gradients of autograd over
full logits, without a float32 ``[N, V]`` block in memory. Marked ``gpu``: skipped without CUDA (not run on the
CPU-only development machine)."""

import pytest
import torch
from torch import nn

from rlflow.models.logprobs import head_log_probs


def full_logits(hidden, ids, head):
    logp = torch.log_softmax(head(hidden).float(), -1)
    return logp.gather(-1, ids[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.gpu
def test_chunked_head_on_cuda_matches_autograd_in_less_memory():
    N, H, V = 4096, 256, 151_936  # one float32 N x V block: 2.3 GiB
    torch.manual_seed(0)
    head = nn.Linear(H, V, bias=False, device="cuda")
    ids = torch.randint(V, (N,), device="cuda")
    base_hidden = torch.randn(N, H, device="cuda")
    results, peaks = [], []
    for fn in (lambda h: head_log_probs(h, ids, head), lambda h: full_logits(h, ids, head)):
        hidden = base_hidden.clone().requires_grad_(True)
        head.zero_grad()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.max_memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            lp, ent = fn(hidden)
        (lp.sum() + 0.1 * ent.sum()).backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - start)
        results.append((lp.detach(), ent.detach(), hidden.grad, head.weight.grad.clone()))
    fused, naive = results
    assert fused[0].dtype == torch.float32  # the softmax runs in float32, the matrix products in bf16
    for got, want in zip(fused, naive):  # same bf16 products, float32 softmax: equal up to summation order
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    full_block = N * V * 4
    assert peaks[1] > full_block  # the naive way holds at least one float32 [N, V] block
    assert peaks[0] < full_block / 2, (peaks, full_block)  # the chunked head never does
