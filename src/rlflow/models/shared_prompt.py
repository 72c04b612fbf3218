"""Shared prompts: a prompt's ``n`` samples share the model's work on the prompt's tokens.

A GRPO-style batch holds every prompt ``n`` times (one row per sample). Under causal attention the prompt's
hidden states and keys/values do not depend on what follows them, so they are the same in every copy: the
prompt runs through the decoder once per distinct prompt, its KV cache is gathered to the rows (an index, so
gradients from every sample flow back to the one prompt pass and sum there, as they would over the copies), and
each row's response runs on top of it. Log-probs are those of the padded pass up to float rounding; gradients
too (summed in another order). The idea is known as shared-prefix training ("Prefix Grouper", arXiv 2506.05433).

Per prompt the model runs over ``P + n (R - 1)`` tokens instead of ``n (P + R - 1)``: on the default job (6-token
prompts, ``n = 8``, 3 response tokens fed) 30 instead of 72. The longer the prompts next to the responses, the
more it saves. Generation shares the prefill the same way (``rlflow.rollout.engines.hf``).

Used when it can be (:func:`can_share`): a text model with transformers' dynamic KV cache, without gradient
checkpointing (which turns the cache off) and without FSDP-sharded layers (ranks must run the same number
of forward passes: whether rows repeat is a per-rank fact).
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from rlflow.models.checks import activation_checkpointing
from rlflow.models.head import position_ids_from_mask
from rlflow.models.vision import is_multimodal


def can_share(lm: nn.Module) -> bool:
    """Whether ``lm`` (a causal LM, or a PEFT model around one) can run a prompt once for several rows."""
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    if is_multimodal(base) or activation_checkpointing(base):
        return False
    if not getattr(base, "_supports_default_dynamic_cache", lambda: False)():  # e.g. recurrent layers
        return False
    # hybrids whose cache holds recurrent states too (Qwen3.5's Gated DeltaNet: transformers' LinearAttentionLayer
    # has no batch_select_indices to copy a prompt's state to its rows)
    kinds = getattr(getattr(base, "config", None), "layer_types", None) or ()
    if any(kind not in ("full_attention", "sliding_attention") for kind in kinds):
        return False
    from torch.distributed.fsdp import FSDPModule

    return not any(isinstance(m, FSDPModule) for m in base.modules())


def cache_argument(lm: nn.Module) -> str:
    """The name of the KV-cache argument of ``lm.forward`` (a PEFT model: its base model's):
    ``cache`` from transformers 5.2x on, ``past_key_values`` before (deprecated since)."""
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def distinct_prompts(prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[Tensor, Tensor] | None:
    """``(first, inverse)``: the row of each distinct (left-padded) prompt's first copy, and each row's distinct
    prompt (``rows[i]`` is ``rows[first[inverse[i]]]``); ``None`` when no prompt repeats."""
    rows = prompt_ids.shape[0]
    if rows < 2:
        return None
    keyed = torch.cat([prompt_ids * prompt_mask, prompt_mask], dim=1)  # padding ids never make prompts differ
    starts = torch.ones(rows, dtype=torch.bool, device=keyed.device)
    starts[1:] = (keyed[1:] != keyed[:-1]).any(-1)  # a new prompt begins here (a rollout's rows come in runs)
    inverse = starts.long().cumsum(0) - 1
    count = int(inverse[-1]) + 1
    # Distinct hashes of the runs' prompts mean distinct prompts; equal ones (a prompt in several runs, or a
    # collision) go through the exact, slower row-wise unique. Ids < 2**18 times weights < 2**30, summed over
    # < 2**15 columns: no int64 overflow.
    weights = torch.randint(1, 2**30, (keyed.shape[1],), generator=torch.Generator().manual_seed(0)).to(keyed.device)
    if len(torch.unique((keyed[starts] * weights).sum(-1))) < count:
        _, inverse = torch.unique(keyed, dim=0, return_inverse=True)
        count = int(inverse.max()) + 1
    if count == rows:
        return None
    order = torch.arange(rows, device=inverse.device)
    first = torch.full((count,), rows, dtype=torch.long, device=inverse.device).scatter_reduce(
        0, inverse, order, reduce="amin")
    return first, inverse


def prompt_cache(decoder: nn.Module, config, ids: Tensor, mask: Tensor, first: Tensor,
                 inverse: Tensor) -> tuple[DynamicCache, Tensor]:
    """Run the distinct prompts ``ids[first]`` through ``decoder`` once; returns their KV cache gathered to every
    row (``B`` rows) and every row's last hidden state (``B x H``)."""
    ids, mask = ids[first], mask[first]
    cache = DynamicCache(config=config)
    out = decoder(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                  use_cache=True, **{cache_argument(decoder): cache})
    cache.batch_select_indices(inverse)
    return cache, out.last_hidden_state[:, -1][inverse]


def shared_prompt_hidden_states(lm: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                                first: Tensor, inverse: Tensor) -> Tensor:
    """What ``rlflow.models.logprobs.response_hidden_states`` returns (``B x R x H``: the hidden states that
    predict each response token), with each distinct prompt run once."""
    P, R = prompt_ids.shape[1], response_ids.shape[1]
    decoder = lm.get_decoder()
    cache, last = prompt_cache(decoder, lm.config, prompt_ids, prompt_mask, first, inverse)
    if R <= 1:  # the last prompt position predicts the only response token
        return last[:, None][:, :R]
    fed = response_ids[:, : R - 1]  # the last response token is not fed (no scored position reads it)
    mask = torch.cat([prompt_mask, torch.ones_like(fed)], dim=1)
    positions = (prompt_mask.sum(-1, keepdim=True) + torch.arange(R - 1, device=fed.device)).long()
    out = decoder(input_ids=fed, attention_mask=mask, position_ids=positions, use_cache=True,
                  **{cache_argument(decoder): cache})
    return torch.cat([last[:, None], out.last_hidden_state], dim=1)
