"""Per-token log-probs and entropy of response tokens, without a float32 [B, T, V] logits copy.

The backbone runs once over prompt + response; the LM head and the softmax run
over chunks of response positions only (prompt positions are never scored).
Under autograd each chunk is checkpointed, so only its hidden states are kept
and its logits are recomputed in the backward pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from rlflow.models.vision import is_multimodal, padded_hidden_states


def position_ids_from_mask(mask: Tensor) -> Tensor:
    """Positions that skip left padding: ``cumsum(mask) - 1``, clamped at 0 (what HF generation uses)."""
    return (mask.long().cumsum(-1) - 1).clamp_min(0)


def _chunk_log_probs(hidden: Tensor, head: nn.Module, ids: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    log_z = torch.logsumexp(logits, dim=-1)
    chosen = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - log_z
    # entropy = log Z - sum softmax(z) * z
    entropy = log_z - (F.softmax(logits, dim=-1) * logits).sum(-1)
    return chosen, entropy


def head_log_probs(hidden: Tensor, ids: Tensor, head: nn.Module, temperature: float = 1.0,
                   chunk_tokens: int = 4096) -> tuple[Tensor, Tensor]:
    """Log-probs and entropy of ``ids`` (``N``) from hidden states ``N x H``: the LM head in chunks of
    ``chunk_tokens`` positions, each checkpointed under autograd (its logits are recomputed in the backward)."""
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
        chunk_tokens: response positions scored per chunk of the LM head.
        remove_padding: run the backbone on packed sequences (``rlflow.models.packing``); positions
            after the end of each response (given ``response_mask``) then get 0.
        pack_length: tokens per packed row (default: the longest sequence of the batch).

    :meth:`sequence_parallel` splits each packed row over a process group (``rlflow.models.ulysses``).
    """

    def __init__(self, lm: nn.Module, temperature: float = 1.0, chunk_tokens: int = 4096,
                 remove_padding: bool = False, pack_length: int | None = None):
        super().__init__()
        self.lm = lm
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
        hidden = response_hidden_states(self.lm, prompt_ids, prompt_mask, response_ids, multi_modal=multi_modal)
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
                           pack_length: int | None = None, multi_modal: list[dict] | None = None) -> Tensor:
    """Last hidden states at the positions that predict each response token: ``B x R x H``.

    The response attends fully: right padding never influences earlier positions
    under a causal mask, and tool/observation tokens must be seen by later ones.
    ``remove_padding`` packs the sequences (``rlflow.models.packing``; zeros after each response's end).
    ``multi_modal``: each row's vision inputs, for a vision-language model (``rlflow.models.vision``; its
    positions are then the model's 3-D rotary positions over prompt + response).
    """
    if remove_padding:
        from rlflow.models.packing import packed_response_hidden_states

        return packed_response_hidden_states(lm, prompt_ids, prompt_mask, response_ids, response_mask, pack_length,
                                             multi_modal)
    P, R = prompt_ids.shape[1], response_ids.shape[1]
    if is_multimodal(lm):
        return padded_hidden_states(lm, prompt_ids, prompt_mask, response_ids, multi_modal)[:, P - 1 : P + R - 1]
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    mask = torch.cat([prompt_mask, torch.ones_like(response_ids)], dim=1)
    out = lm.get_decoder()(input_ids=input_ids, attention_mask=mask, position_ids=position_ids_from_mask(mask))
    return out.last_hidden_state[:, P - 1 : P + R - 1]
