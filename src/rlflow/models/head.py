"""The LM head scored in chunks: per-token log-probs and entropy without a float32 [B, T, V] logits copy.

The backbone runs once over prompt + response; the LM head and the softmax run over chunks of response
positions only (prompt positions are never scored), so only one chunk's logits exist at a time. The chunk
holds ``chunk_tokens`` positions, by default as many as fit ``LOGITS_CHUNK_BYTES`` of float32 logits (about
440 positions for a 150k-token vocabulary, all of a small model's).

For a plain ``nn.Linear`` head (transformers' ``lm_head``, tied or not) one autograd function,
:class:`ChunkedHeadLogProbs`, does each chunk's forward and backward by hand: it keeps only the hidden states
and two numbers per position, and the backward recomputes the chunk's logits and forms their gradient in
place (a fused linear-cross-entropy with the entropy term). Any other head (a LoRA-wrapped or FSDP-sharded
one, a head with a bias) runs the module itself per chunk under activation checkpointing.

A leaf: it knows hidden states, token ids and a head, never a layout. :mod:`rlflow.models.logprobs` (which lays
out the batch: padded, shared-prompt, packed, Ulysses) and the layouts themselves build on it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

LOGITS_CHUNK_BYTES = 256 * 2**20  # float32 logits per chunk when ``chunk_tokens`` is not given


def position_ids_from_mask(mask: Tensor) -> Tensor:
    """Positions that skip left padding: ``cumsum(mask) - 1``, clamped at 0 (what HF generation uses)."""
    return (mask.long().cumsum(-1) - 1).clamp_min(0)


def auto_chunk_tokens(vocab_size: int, budget_bytes: int = LOGITS_CHUNK_BYTES) -> int:
    """Positions per chunk so that one chunk's float32 logits take at most ``budget_bytes`` (at least 16)."""
    return max(16, budget_bytes // (4 * max(vocab_size, 1)))


def _chunk_log_probs(hidden: Tensor, head: nn.Module, ids: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """``ids``: ``n x J`` (``J`` tokens scored per position)."""
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    log_z = torch.logsumexp(logits, dim=-1)
    chosen = logits.gather(-1, ids) - log_z[:, None]
    # entropy = log Z - sum softmax(z) * z
    entropy = log_z - (F.softmax(logits, dim=-1) * logits).sum(-1)
    return chosen, entropy


def _plain_linear(head: nn.Module) -> bool:
    """A head whose output is exactly ``hidden @ weight.T``: an unwrapped, hook-free ``nn.Linear`` without bias
    whose weight is an ordinary tensor (FSDP2 changes the class of a module it shards; PEFT replaces it)."""
    return (type(head) is nn.Linear and head.bias is None and not head._forward_hooks
            and not head._forward_pre_hooks and type(head.weight) in (nn.Parameter, Tensor))


class ChunkedHeadLogProbs(torch.autograd.Function):
    r"""Log-prob of ``ids`` and entropy under ``softmax(hidden @ weight.T / T)``, chunk by chunk, with a hand-written
    backward that recomputes each chunk's logits (``N x V``) instead of saving them.

    With :math:`z = h W^\top / T` (float32), :math:`p = \mathrm{softmax}(z)`, :math:`\log Z = \mathrm{logsumexp}(z)`:
    log-prob :math:`\ell = z_y - \log Z`, entropy :math:`H = \log Z - \sum_v p_v z_v`, and for upstream gradients
    :math:`g_\ell, g_H`:

    .. math:: \frac{\partial L}{\partial z_v} = g_\ell (\delta_{vy} - p_v) - g_H\, p_v (\log p_v + H),
              \qquad \frac{\partial L}{\partial h} = \frac{1}{T} \frac{\partial L}{\partial z} W,
              \qquad \frac{\partial L}{\partial W} = \frac{1}{T} \frac{\partial L}{\partial z}^{\top} h.

    Several tokens per position (``ids`` ``N x J``: the sampled token and a distillation teacher's top-k) give
    :math:`\partial L / \partial z_v = \sum_j g_{\ell_j} (\delta_{v y_j} - p_v) - \ldots`, the same pass.

    Shapes: hidden ``N x H``, weight ``V x H``, ids ``N`` (or ``N x J``) -> log-probs ``N`` (``N x J``), entropy ``N``
    (float32). The matrix products run in ``compute_dtype`` (the autocast dtype under mixed precision, as
    ``head(hidden)`` would), the softmax in float32; the weight's gradient is accumulated over chunks in float32.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, ids: Tensor, temperature: float, chunk: int,
                compute_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        ctx.flat = ids.dim() == 1  # one token per position: log-probs ``N``
        ids = ids[:, None] if ctx.flat else ids
        n = hidden.shape[0]
        log_probs = hidden.new_empty(ids.shape, dtype=torch.float32)
        entropy = hidden.new_empty(n, dtype=torch.float32)
        log_z = torch.empty_like(entropy)
        w = weight.to(compute_dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, n, chunk):
                z = (hidden[s : s + chunk].to(compute_dtype) @ w.T).float()
                if temperature != 1.0:
                    z.div_(temperature)
                lz = torch.logsumexp(z, dim=-1)
                log_probs[s : s + chunk] = z.gather(-1, ids[s : s + chunk]) - lz[:, None]
                p = (z - lz[:, None]).exp_()
                entropy[s : s + chunk] = lz - torch.linalg.vecdot(p, z)
                log_z[s : s + chunk] = lz
        ctx.save_for_backward(hidden, weight, ids, log_z, entropy)
        ctx.temperature, ctx.chunk, ctx.compute_dtype = temperature, chunk, compute_dtype
        return (log_probs[:, 0] if ctx.flat else log_probs), entropy

    @staticmethod
    def backward(ctx, grad_log_probs: Tensor | None, grad_entropy: Tensor | None):
        hidden, weight, ids, log_z, entropy = ctx.saved_tensors
        n, T, cd = hidden.shape[0], ctx.temperature, ctx.compute_dtype
        g_lp = grad_log_probs if grad_log_probs is not None else torch.zeros(ids.shape, device=log_z.device)
        g_lp = g_lp[:, None] if g_lp.dim() == 1 else g_lp
        g_h = grad_entropy if grad_entropy is not None else torch.zeros_like(log_z)
        w = weight.to(cd)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, n, ctx.chunk):
                h = hidden[s : s + ctx.chunk].to(cd)
                z = (h @ w.T).float()
                if T != 1.0:
                    z.div_(T)
                lz, ent = log_z[s : s + ctx.chunk, None], entropy[s : s + ctx.chunk, None]
                gl, ge = g_lp[s : s + ctx.chunk].float(), g_h[s : s + ctx.chunk, None].float()
                p = (z - lz).exp_()
                # z <- dL/dz = p * (-sum_j g_lj - g_H (log p + H)) + g_lj at each token y_j; log p = z - log Z
                z.sub_(lz).add_(ent).mul_(-ge).sub_(gl.sum(-1, keepdim=True)).mul_(p)
                z.scatter_add_(1, ids[s : s + ctx.chunk], gl)
                if T != 1.0:
                    z.div_(T)
                grad_z = z.to(cd)
                if grad_hidden is not None:
                    grad_hidden[s : s + ctx.chunk] = (grad_z @ w).to(hidden.dtype)
                if grad_weight is not None:
                    grad_weight.add_((grad_z.T @ h).float())
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None, None


def head_log_probs(hidden: Tensor, ids: Tensor, head: nn.Module, temperature: float = 1.0,
                   chunk_tokens: int | None = None) -> tuple[Tensor, Tensor]:
    """Log-probs and entropy of ``ids`` (``N``, or ``N x J`` for several tokens per position: log-probs ``N x J``)
    from hidden states ``N x H``, the LM head in chunks of ``chunk_tokens`` positions (default:
    :func:`auto_chunk_tokens` of the head's vocabulary); see the module docstring for the two ways a chunk is
    computed."""
    if ids.dim() == 1:
        logps, ents = head_log_probs(hidden, ids[:, None], head, temperature, chunk_tokens)
        return logps[:, 0], ents
    if chunk_tokens is None:
        chunk_tokens = auto_chunk_tokens(getattr(head, "out_features", None) or head.weight.shape[0])
    if ids.shape[0] and _plain_linear(head):
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype
        return ChunkedHeadLogProbs.apply(hidden, head.weight, ids, temperature, chunk_tokens, dtype)
    logps, ents = [], []
    for start in range(0, ids.shape[0], chunk_tokens):
        h, i = hidden[start : start + chunk_tokens], ids[start : start + chunk_tokens]
        if torch.is_grad_enabled() and h.requires_grad:
            lp, ent = checkpoint(_chunk_log_probs, h, head, i, temperature, use_reentrant=False)
        else:
            lp, ent = _chunk_log_probs(h, head, i, temperature)
        logps.append(lp)
        ents.append(ent)
    if not logps:  # no position: keep the graph connected to the backbone
        empty = hidden.sum(-1)[:0].float()
        return empty[:, None].expand(0, ids.shape[1]), empty
    return torch.cat(logps), torch.cat(ents)


@torch.no_grad()
def head_top_k(hidden: Tensor, ids: Tensor, head: nn.Module, k: int, temperature: float = 1.0,
               chunk_tokens: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """A distillation teacher's pass: the log-prob of ``ids`` (``N``) and the ``k`` most likely tokens' log-probs and
    ids (``N x k`` each, most likely first) under the full-vocabulary log-softmax, chunk by chunk, without grad."""
    if chunk_tokens is None:
        chunk_tokens = auto_chunk_tokens(getattr(head, "out_features", None) or head.weight.shape[0])
    chosen, top_lp, top_ids = [], [], []
    for start in range(0, ids.shape[0], chunk_tokens):
        logits = head(hidden[start : start + chunk_tokens]).float()
        if temperature != 1.0:
            logits = logits / temperature
        logp = torch.log_softmax(logits, dim=-1)
        chosen.append(logp.gather(-1, ids[start : start + chunk_tokens, None])[:, 0])
        values, indices = logp.topk(k, dim=-1)
        top_lp.append(values)
        top_ids.append(indices)
    if not chosen:
        return (hidden.new_zeros(0, dtype=torch.float32), hidden.new_zeros(0, k, dtype=torch.float32),
                ids.new_zeros(0, k))
    return torch.cat(chosen), torch.cat(top_lp), torch.cat(top_ids)
