"""Per-token log-probs and entropy of response tokens, without a float32 [B, T, V] logits copy.

The backbone runs once over prompt + response; the LM head and the softmax run over chunks of response
positions only (prompt positions are never scored), so only one chunk's logits exist at a time. The chunk
holds ``chunk_tokens`` positions, by default as many as fit ``LOGITS_CHUNK_BYTES`` of float32 logits (about
440 positions for a 150k-token vocabulary, all of a small model's).

For a plain ``nn.Linear`` head (transformers' ``lm_head``, tied or not) one autograd function,
:class:`ChunkedHeadLogProbs`, does each chunk's forward and backward by hand: it keeps only the hidden states
and two numbers per position, and the backward recomputes the chunk's logits and forms their gradient in
place (a fused linear-cross-entropy with the entropy term). Any other head (a LoRA-wrapped or FSDP-sharded
one, a head with a bias) runs the module itself per chunk under activation checkpointing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from rlflow.models.shared_prompt import can_share, distinct_prompts, shared_prompt_hidden_states
from rlflow.models.vision import is_multimodal, padded_hidden_states

LOGITS_CHUNK_BYTES = 256 * 2**20  # float32 logits per chunk when ``chunk_tokens`` is not given


def position_ids_from_mask(mask: Tensor) -> Tensor:
    """Positions that skip left padding: ``cumsum(mask) - 1``, clamped at 0 (what HF generation uses)."""
    return (mask.long().cumsum(-1) - 1).clamp_min(0)


def auto_chunk_tokens(vocab_size: int, budget_bytes: int = LOGITS_CHUNK_BYTES) -> int:
    """Positions per chunk so that one chunk's float32 logits take at most ``budget_bytes`` (at least 16)."""
    return max(16, budget_bytes // (4 * max(vocab_size, 1)))


def _chunk_log_probs(hidden: Tensor, head: nn.Module, ids: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    log_z = torch.logsumexp(logits, dim=-1)
    chosen = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - log_z
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

    Shapes: hidden ``N x H``, weight ``V x H``, ids ``N`` -> log-probs, entropy ``N`` (float32). The matrix products
    run in ``compute_dtype`` (the autocast dtype under mixed precision, as ``head(hidden)`` would), the softmax in
    float32; the weight's gradient is accumulated over chunks in float32.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, ids: Tensor, temperature: float, chunk: int,
                compute_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        log_probs = hidden.new_empty(n, dtype=torch.float32)
        entropy, log_z = torch.empty_like(log_probs), torch.empty_like(log_probs)
        w = weight.to(compute_dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, n, chunk):
                z = (hidden[s : s + chunk].to(compute_dtype) @ w.T).float()
                if temperature != 1.0:
                    z.div_(temperature)
                lz = torch.logsumexp(z, dim=-1)
                log_probs[s : s + chunk] = z.gather(-1, ids[s : s + chunk, None]).squeeze(-1) - lz
                p = (z - lz[:, None]).exp_()
                entropy[s : s + chunk] = lz - torch.linalg.vecdot(p, z)
                log_z[s : s + chunk] = lz
        ctx.save_for_backward(hidden, weight, ids, log_z, entropy)
        ctx.temperature, ctx.chunk, ctx.compute_dtype = temperature, chunk, compute_dtype
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs: Tensor | None, grad_entropy: Tensor | None):
        hidden, weight, ids, log_z, entropy = ctx.saved_tensors
        n, T, cd = hidden.shape[0], ctx.temperature, ctx.compute_dtype
        g_lp = grad_log_probs if grad_log_probs is not None else torch.zeros_like(log_z)
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
                gl, ge = g_lp[s : s + ctx.chunk, None].float(), g_h[s : s + ctx.chunk, None].float()
                p = (z - lz).exp_()
                # z <- dL/dz = p * (-g_l - g_H (log p + H)) + g_l at the chosen token; log p = z - log Z
                z.sub_(lz).add_(ent).mul_(-ge).sub_(gl).mul_(p)
                z.scatter_add_(1, ids[s : s + ctx.chunk, None], gl)
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
    """Log-probs and entropy of ``ids`` (``N``) from hidden states ``N x H``, the LM head in chunks of
    ``chunk_tokens`` positions (default: :func:`auto_chunk_tokens` of the head's vocabulary); see the module
    docstring for the two ways a chunk is computed."""
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
        return empty, empty
    return torch.cat(logps), torch.cat(ents)


class TokenLogProbs(nn.Module):
    """Wraps a Hugging Face causal LM; ``forward`` scores the response tokens.

    Being an ``nn.Module`` whose ``forward`` is the whole computation lets
    strategies (DDP, FSDP2) wrap it like any model.

    Args:
        lm: a causal LM (``PreTrainedModel`` with ``get_decoder`` and ``get_output_embeddings``).
        temperature: logits are divided by it, as the sampler does.
        chunk_tokens: response positions scored per chunk of the LM head (default: as many as fit
            ``LOGITS_CHUNK_BYTES`` of float32 logits, :func:`auto_chunk_tokens`).
        remove_padding: run the backbone on packed sequences (``rlflow.models.packing``); positions
            after the end of each response (given ``response_mask``) then get 0.
        pack_length: tokens per packed row (default: the longest sequence of the batch).
        share_prompts: in the padded layout, run each distinct prompt once for all its rows
            (``rlflow.models.shared_prompt``); ``False``: every row runs its own prompt.

    :meth:`sequence_parallel` splits each packed row over a process group (``rlflow.models.ulysses``).
    """

    def __init__(self, lm: nn.Module, temperature: float = 1.0, chunk_tokens: int | None = None,
                 remove_padding: bool = False, pack_length: int | None = None, share_prompts: bool = True):
        super().__init__()
        self.lm = lm
        self.share_prompts = share_prompts
        self.temperature = temperature
        self.chunk_tokens = chunk_tokens
        self.remove_padding, self.pack_length = remove_padding, pack_length
        self.sp_group = None

    def sequence_parallel(self, group) -> None:
        """Run the backbone sequence-parallel over ``group`` (Ulysses); needs ``remove_padding``."""
        self.sp_group = enable_sequence_parallel(self.lm, group, self.remove_padding)

    def forward(self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                response_mask: Tensor | None = None, multi_modal: list[dict] | None = None) -> tuple[Tensor, Tensor]:
        """Shapes: prompt ``B x P`` (left-padded), response ``B x R`` -> log-probs, entropy ``B x R``.

        ``multi_modal``: for a vision-language model, each row's processor outputs (``rlflow.models.vision``).
        """
        if self.remove_padding:
            from rlflow.models.packing import packed_log_probs

            return packed_log_probs(self.lm, prompt_ids, prompt_mask, response_ids, response_mask,
                                    temperature=self.temperature, chunk_tokens=self.chunk_tokens,
                                    pack_length=self.pack_length, sp_group=self.sp_group, multi_modal=multi_modal)
        hidden = response_hidden_states(self.lm, prompt_ids, prompt_mask, response_ids, multi_modal=multi_modal,
                                        share_prompts=self.share_prompts)
        B, R, H = hidden.shape
        logps, ents = head_log_probs(hidden.reshape(B * R, H), response_ids.reshape(B * R),
                                     self.lm.get_output_embeddings(), self.temperature, self.chunk_tokens)
        return logps.view(B, R), ents.view(B, R)


def enable_sequence_parallel(lm: nn.Module, group, remove_padding: bool):
    """Checks and switches ``lm`` to Ulysses attention; returns ``group`` (``None`` when it has one rank)."""
    import torch.distributed as dist

    if group is not None and is_multimodal(lm):
        raise ValueError("sequence parallelism (Ulysses) is not supported for vision-language models yet: the image "
                         "features of a sequence would have to be split with its tokens; use sequence_parallel_size=1")
    if group is None or dist.get_world_size(group) == 1:
        return None
    if not remove_padding:
        raise ValueError("sequence parallelism runs on packed sequences: set remove_padding=True "
                         "(verl: actor_rollout_ref.model.use_remove_padding=True)")
    from rlflow.models import ulysses

    ulysses.check_heads(lm, dist.get_world_size(group))
    ulysses.enable(lm)
    return group


def response_hidden_states(lm: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                           response_mask: Tensor | None = None, remove_padding: bool = False,
                           pack_length: int | None = None, multi_modal: list[dict] | None = None,
                           share_prompts: bool = True) -> Tensor:
    """Last hidden states at the positions that predict each response token: ``B x R x H``.

    The response attends fully: right padding never influences earlier positions
    under a causal mask, and tool/observation tokens must be seen by later ones.
    ``remove_padding`` packs the sequences (``rlflow.models.packing``; zeros after each response's end).
    ``multi_modal``: each row's vision inputs, for a vision-language model (``rlflow.models.vision``; its
    positions are then the model's 3-D rotary positions over prompt + response).
    ``share_prompts``: rows with the same prompt (a prompt's samples) share one pass over it
    (``rlflow.models.shared_prompt``; where it applies, see ``can_share``).
    """
    if remove_padding:
        from rlflow.models.packing import packed_response_hidden_states

        return packed_response_hidden_states(lm, prompt_ids, prompt_mask, response_ids, response_mask, pack_length,
                                             multi_modal)
    P, R = prompt_ids.shape[1], response_ids.shape[1]
    if is_multimodal(lm):
        return padded_hidden_states(lm, prompt_ids, prompt_mask, response_ids, multi_modal)[:, P - 1 : P + R - 1]
    if share_prompts and can_share(lm):
        shared = distinct_prompts(prompt_ids, prompt_mask)
        if shared is not None:  # each distinct prompt runs once (rlflow.models.shared_prompt)
            return shared_prompt_hidden_states(lm, prompt_ids, prompt_mask, response_ids, *shared)
    # the last response token is not fed: no scored position reads its hidden state (causal attention)
    fed = response_ids[:, : max(R - 1, 0)]
    input_ids = torch.cat([prompt_ids, fed], dim=1)
    mask = torch.cat([prompt_mask, torch.ones_like(fed)], dim=1)
    out = lm.get_decoder()(input_ids=input_ids, attention_mask=mask, position_ids=position_ids_from_mask(mask))
    return out.last_hidden_state[:, P - 1 : P + R - 1]
