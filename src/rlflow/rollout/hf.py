"""HFRollout: the single-turn rollout sampling with transformers' ``generate`` (:class:`HFEngine`)."""

from __future__ import annotations

import torch
from torch import Tensor

from rlflow.rollout.engines.hf import HFEngine
from rlflow.rollout.single_turn import SingleTurnRollout
from rlflow.rollout.weight_sync import DEFAULT_BUCKET_BYTES


class HFRollout(SingleTurnRollout):
    """Turns prompts into ``n`` samples each with ``model.generate``.

    Reads left-padded prompts; writes right-padded responses, a response mask
    that covers tokens up to and including the first EOS, the sampler's
    log-probs (temperature-scaled, before top-k/top-p truncation, as the policy
    computes them), a ``group`` id per prompt and the decoded text. Non-tensor
    prompt fields (ground truth, data source, ...) are repeated with their rows.

    On one device the model is the policy's own module (``bind``), so weight sync
    after an update is free; under FSDP2 the Trainer binds a full copy and
    ``sync_weights`` refreshes it in buckets.
    """

    makes_image_engine = True  # HFEngine generates with images (vision-language prompts)

    def __init__(self, n: int = 1, *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                 max_new_tokens: int = 512, do_sample: bool = True, seed: int | None = None,
                 stop_token_ids: tuple[int, ...] = (), bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        super().__init__(None, n, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                         do_sample=do_sample, seed=seed, stop_token_ids=stop_token_ids,
                         bucket_bytes=bucket_bytes)

    def make_engine(self, model, tokenizer) -> HFEngine:
        return HFEngine(model, tokenizer)


def response_mask_until_eos(response: Tensor, eos_token_id: int | list[int] | None) -> Tensor:
    """1 on tokens up to and including the first EOS, 0 after it (``B x R`` int64)."""
    if eos_token_id is None:
        return torch.ones_like(response)
    eos_ids = torch.as_tensor(eos_token_id, device=response.device).reshape(-1)
    is_eos = torch.isin(response, eos_ids).long()
    # tokens strictly after the first EOS have a positive count of EOS before them
    after = (is_eos.cumsum(-1) - is_eos) > 0
    return (~after).long()
