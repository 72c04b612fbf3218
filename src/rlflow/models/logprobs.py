"""Per-token log-probs and entropy of response tokens: :class:`TokenLogProbs` picks how the batch is laid out.

The backbone runs once over prompt + response, in one of four layouts: padded (every row its own prompt),
shared-prompt (each distinct prompt once, :mod:`rlflow.models.shared_prompt`), packed (no padding,
:mod:`rlflow.models.packing`) and packed over a sequence-parallel group (:mod:`rlflow.models.ulysses`). The LM
head then scores the response positions only, in chunks (:mod:`rlflow.models.head`, whose names
``head_log_probs``, ``ChunkedHeadLogProbs``, ``auto_chunk_tokens``, ``position_ids_from_mask`` and
``LOGITS_CHUNK_BYTES`` are importable from here too).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from rlflow.models import ulysses
from rlflow.models.head import (LOGITS_CHUNK_BYTES, ChunkedHeadLogProbs, auto_chunk_tokens,  # noqa: F401  (here before)
                                head_log_probs, head_top_k, position_ids_from_mask)
from rlflow.models.packing import packed_log_probs, packed_response_hidden_states
from rlflow.models.shared_prompt import can_share, distinct_prompts, shared_prompt_hidden_states
from rlflow.models.vision import is_multimodal, padded_hidden_states


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

    #: whether the module the strategy made of this one takes the rollout's MoE routing (``routed_experts``, R3):
    #: set by ``MegatronStrategy(router_replay="R3")``; transformers' MoE blocks take no given routing
    replays_rollout_routing = False

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
                response_mask: Tensor | None = None, multi_modal: list[dict] | None = None,
                topk_ids: Tensor | None = None) -> tuple[Tensor, ...]:
        """Shapes: prompt ``B x P`` (left-padded), response ``B x R`` -> log-probs, entropy ``B x R``.

        ``multi_modal``: for a vision-language model, each row's processor outputs (``rlflow.models.vision``).
        ``topk_ids`` (``B x R x k``, a distillation teacher's top-k tokens): also return the log-probs of those
        tokens, ``B x R x k``, from the same head pass (the full-vocabulary log-softmax is never kept).
        """
        scored = response_ids if topk_ids is None else torch.cat([response_ids[..., None], topk_ids], dim=-1)
        if self.remove_padding:
            logps, ents = packed_log_probs(self.lm, prompt_ids, prompt_mask, response_ids, response_mask,
                                           temperature=self.temperature, chunk_tokens=self.chunk_tokens,
                                           pack_length=self.pack_length, sp_group=self.sp_group,
                                           multi_modal=multi_modal, scored_ids=scored)
        else:
            hidden = response_hidden_states(self.lm, prompt_ids, prompt_mask, response_ids, multi_modal=multi_modal,
                                            share_prompts=self.share_prompts)
            B, R, H = hidden.shape
            logps, ents = head_log_probs(hidden.reshape(B * R, H), scored.reshape(B * R, *scored.shape[2:]),
                                         self.lm.get_output_embeddings(), self.temperature, self.chunk_tokens)
            logps, ents = logps.view(*scored.shape), ents.view(B, R)
        return (logps, ents) if topk_ids is None else (logps[..., 0], ents, logps[..., 1:])

    @torch.no_grad()
    def top_k(self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, k: int,
              response_mask: Tensor | None = None, multi_modal: list[dict] | None = None) -> tuple[Tensor, ...]:
        """A distillation teacher's scoring: the response tokens' log-probs ``B x R`` and the ``k`` most likely
        tokens' log-probs and ids at each response position, ``B x R x k`` each (the full-vocabulary
        log-softmax, not renormalised over the ``k``; verl's teacher ``topk`` log-probs)."""
        hidden = response_hidden_states(self.lm, prompt_ids, prompt_mask, response_ids, response_mask,
                                        self.remove_padding, self.pack_length, multi_modal, self.share_prompts)
        B, R, H = hidden.shape
        chosen, top_lp, top_ids = head_top_k(hidden.reshape(B * R, H), response_ids.reshape(B * R),
                                             self.lm.get_output_embeddings(), k, self.temperature, self.chunk_tokens)
        return chosen.view(B, R), top_lp.view(B, R, k), top_ids.view(B, R, k)


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
