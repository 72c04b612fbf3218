"""Padding removal: score a batch as packed sequences instead of a padded ``B x (P + R)`` block.

Each row of a batch is a left-padded prompt followed by a right-padded response.
Packing keeps, per row, the prompt's real tokens and the response up to its last
token with ``response_mask == 1`` (tool/observation tokens inside the response,
mask 0 in the middle, are kept: later tokens attend to them; only the trailing
padding after the end of the response goes). The last response token itself is
not fed either: no scored position reads its hidden state.

The kept sequences are laid end to end in rows of ``pack_length`` tokens
(first-fit decreasing), with ``position_ids`` restarting at 0 for each sequence
and ``attention_mask=None``. transformers (>= 4.5x; checked on 5.x, see
``masking_utils.find_packed_sequence_indices``; it needs ``use_cache=False``, else
the default KV cache disables the detection) then detects the packed format from
the position ids and builds a block-diagonal causal mask (sdpa / eager / flex), or
passes the sequence boundaries to flash-attention varlen kernels.

``pack_length=None`` makes each packed row as long as the longest sequence of the
batch: the attention never costs more than in the padded layout (with a dense
sdpa/eager mask a single packed row of all tokens would cost ``(sum of lengths)^2``).
With flash-attention, which is linear in the number of sequences, a large
``pack_length`` (one row) is best.

Vision-language models (``rlflow.models.vision``): the 3-D rotary positions of each sequence and its
image-token mask are computed in the padded layout and moved with its tokens (``carry``); the decoder
then gets ``4 x rows x pack_length`` positions (the restarting 1-D positions first: transformers reads
them to find the packed sequences, then the t/h/w positions), and the rows' images are concatenated in
the order their sequences lie in the packed rows (:attr:`Packed.order`).

Only the scored positions come back (``N`` of them, ``N`` = kept response
tokens), so the LM head and the softmax run over ``N`` positions, not ``B x R``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rlflow.models.head import head_log_probs
from rlflow.models.ulysses import sequence_parallel_outputs
from rlflow.models.vision import (check_image_tokens, concat_inputs, image_token_mask, is_multimodal,
                                  multimodal_hidden_states, rope_position_ids)


@dataclass
class Packed:
    """A packed batch and the index maps back to the ``B x R`` response layout.

    Attributes:
        input_ids, position_ids: ``rows x pack_length``; the tail of a row after its last
            sequence is pad tokens forming a sequence of their own (never read).
        src: ``N`` flat indices into ``rows * pack_length``: the positions predicting the kept response tokens.
        dst: ``N`` flat indices into ``B * R``: where each of those goes in the response layout.
        batch_size, response_len: ``B`` and ``R``.
        order: the batch rows in the order their sequences lie in the packed rows (images follow it).
        carried: the ``carry`` tensors of :func:`pack`, laid out as ``... x rows x pack_length`` (0 in the tails).
    """

    input_ids: Tensor
    position_ids: Tensor
    src: Tensor
    dst: Tensor
    batch_size: int
    response_len: int
    order: list[int] | None = None
    carried: dict[str, Tensor] | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens the backbone runs over, padding of the packed rows included."""
        return self.input_ids.numel()


def response_lengths(response_mask: Tensor) -> Tensor:
    """Per row, the index after the last response token with mask 1 (0 for an empty response)."""
    idx = torch.arange(1, response_mask.shape[1] + 1, device=response_mask.device)
    return (response_mask.bool() * idx).amax(-1)


def pack(
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor | None = None,
    pack_length: int | None = None,
    pad_token_id: int = 0,
    carry: dict[str, Tensor] | None = None,
) -> Packed:
    """Pack the rows' real tokens (see the module docstring). ``response_mask=None`` keeps every response token.

    ``carry``: per-token tensors ``... x B x (P + R)`` of the padded layout to move with the tokens.
    """
    B, P = prompt_ids.shape
    R = response_ids.shape[1]
    device = prompt_ids.device
    resp_len = response_lengths(response_mask) if response_mask is not None else torch.full((B,), R, device=device)
    ar = torch.arange(R, device=device)
    # fed tokens: prompt's real ones + response[: len - 1]
    fed = torch.cat([prompt_mask.bool(), ar[None] < (resp_len[:, None] - 1)], dim=1)  # B x (P + R)
    ids = torch.cat([prompt_ids, response_ids], dim=1)
    seq_len = fed.sum(-1)
    pos_in_seq = fed.long().cumsum(-1) - 1

    lengths = seq_len.tolist()
    L = max(max(lengths, default=1), pack_length or 0, 1)
    # first-fit decreasing over the rows: a Python loop over rows, never over tokens
    starts, bins = [0] * B, []  # bins: used length of each packed row
    for i in sorted(range(B), key=lambda i: -lengths[i]):
        for b, used in enumerate(bins):
            if used + lengths[i] <= L:
                starts[i], bins[b] = b * L + used, used + lengths[i]
                break
        else:
            starts[i] = len(bins) * L
            bins.append(lengths[i])
    rows = max(len(bins), 1)
    row_start = torch.tensor(starts, device=device, dtype=torch.long)

    # tails: pad tokens whose positions restart at 0 (a separate sequence nobody attends to)
    flat_pos = torch.arange(rows * L, device=device).remainder(L).view(rows, L)
    used = torch.tensor(bins or [0], device=device)
    position_ids = (flat_pos - used[:, None]).clamp_min(0).view(-1)
    input_ids = torch.full((rows * L,), pad_token_id, dtype=ids.dtype, device=device)
    r, c = fed.nonzero(as_tuple=True)
    target = row_start[r] + pos_in_seq[r, c]
    input_ids[target] = ids[r, c]
    position_ids[target] = pos_in_seq[r, c]
    carried = {}
    for name, value in (carry or {}).items():
        laid = value.new_zeros((*value.shape[:-2], rows * L))
        laid[..., target] = value[..., r, c]
        carried[name] = laid.view(*value.shape[:-2], rows, L)

    scored = ar[None] < resp_len[:, None]  # B x R
    b, t = scored.nonzero(as_tuple=True)
    p_len = prompt_mask.sum(-1)
    src = row_start[b] + p_len[b] - 1 + t
    return Packed(input_ids.view(rows, L), position_ids.view(rows, L), src, b * R + t, B, R,
                  sorted(range(B), key=starts.__getitem__), carried)


def unpack(values: Tensor, packed: Packed) -> Tensor:
    """``N x ...`` values at the kept positions -> ``B x R x ...``, zeros elsewhere (differentiable)."""
    out = values.new_zeros((packed.batch_size * packed.response_len, *values.shape[1:]))
    return out.index_copy(0, packed.dst, values).view(packed.batch_size, packed.response_len, *values.shape[1:])


def packed_hidden_states(lm: nn.Module, packed: Packed, multi_modal: list[dict] | None = None) -> Tensor:
    """The backbone over the packed rows; returns the ``N x H`` hidden states at the scored positions.

    ``multi_modal``: the batch rows' vision inputs (``rlflow.models.vision``), in batch order.
    """
    if is_multimodal(lm):
        inputs = concat_inputs([multi_modal[i] for i in packed.order] if multi_modal else [], packed.input_ids.device)
        rope = packed.carried["rope"]
        positions = torch.cat([packed.position_ids[None], rope]) if rope.ndim == 3 else packed.position_ids
        hidden = multimodal_hidden_states(lm, packed.input_ids, None, positions, inputs, packed.carried["image"])
    else:  # use_cache=False: transformers only looks for packed sequences when there is no KV cache
        hidden = lm.get_decoder()(input_ids=packed.input_ids, attention_mask=None, position_ids=packed.position_ids,
                                  use_cache=False).last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1])[packed.src]


def pack_batch(lm: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
               response_mask: Tensor | None = None, pack_length: int | None = None,
               multi_modal: list[dict] | None = None) -> Packed:
    """:func:`pack` with the model's pad id; for a vision-language model its rotary positions and image-token
    mask go along (``carried["rope"]``, ``carried["image"]``)."""
    carry = None
    if is_multimodal(lm):
        ids = torch.cat([prompt_ids, response_ids], dim=1)
        mask = torch.cat([prompt_mask, torch.ones_like(response_ids)], dim=1)
        images = image_token_mask(lm, prompt_ids, response_ids.shape[1])
        inputs = concat_inputs(multi_modal or [], ids.device)
        check_image_tokens(lm, inputs, images)
        carry = {"rope": rope_position_ids(lm, ids, mask, inputs, images), "image": images}
    return pack(prompt_ids, prompt_mask, response_ids, response_mask, pack_length, _pad_id(lm), carry)


def _pad_id(lm: nn.Module) -> int:
    pad = getattr(getattr(lm, "config", None), "pad_token_id", None)
    return int(pad) if pad is not None else 0


def packed_response_hidden_states(
    lm: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
    response_mask: Tensor | None = None, pack_length: int | None = None, multi_modal: list[dict] | None = None,
) -> Tensor:
    """What ``response_hidden_states`` returns (``B x R x H``), computed packed; zeros after each response's end."""
    packed = pack_batch(lm, prompt_ids, prompt_mask, response_ids, response_mask, pack_length, multi_modal)
    return unpack(packed_hidden_states(lm, packed, multi_modal), packed)


def packed_log_probs(
    lm: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
    response_mask: Tensor | None = None, *, temperature: float = 1.0, chunk_tokens: int | None = None,
    pack_length: int | None = None, sp_group=None, multi_modal: list[dict] | None = None,
    scored_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``TokenLogProbs`` on packed sequences: log-probs and entropy ``B x R`` (0 after each response's end).

    The LM head runs in chunks over the ``N`` kept positions only, checkpointed under autograd.
    ``sp_group``: split the sequence over that process group (``rlflow.models.ulysses``).
    ``multi_modal``: the rows' vision inputs (``rlflow.models.vision``).
    ``scored_ids``: the tokens to score, ``B x R x J`` (log-probs then ``B x R x J``); default: the responses'.
    """
    packed = pack_batch(lm, prompt_ids, prompt_mask, response_ids, response_mask, pack_length, multi_modal)
    scored = response_ids if scored_ids is None else scored_ids
    ids = scored.reshape(prompt_ids.shape[0] * response_ids.shape[1], *scored.shape[2:])[packed.dst]
    head = lm.get_output_embeddings()
    if sp_group is None:
        logps, ents = head_log_probs(packed_hidden_states(lm, packed, multi_modal), ids, head, temperature,
                                     chunk_tokens)
    else:
        def score(hidden: Tensor, index: Tensor) -> Tensor:
            lp, ent = head_log_probs(hidden, ids[index], head, temperature, chunk_tokens)
            return torch.cat([lp[:, None] if lp.dim() == 1 else lp, ent[:, None]], dim=-1)  # n x (J + 1)

        out = sequence_parallel_outputs(lm, packed, score, sp_group)
        logps, ents = out[:, :-1].reshape(-1, *scored.shape[2:]), out[:, -1]
    return unpack(logps, packed), unpack(ents, packed)
