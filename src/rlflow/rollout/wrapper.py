"""Rollouts that wrap another rollout, and joining batches of different widths."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as nnF
from tensordict import TensorDict

from rlflow.data import keys as K
from rlflow.module import BatchModule

LEFT_PADDED = (K.PROMPT_IDS, K.PROMPT_MASK, K.PROMPT_ROUTED_EXPERTS)
ROUTING = (K.PROMPT_ROUTED_EXPERTS, K.ROUTED_EXPERTS)  # padded with -1: no expert


class RolloutWrapper(BatchModule):
    """Forwards what the Trainer asks of a rollout (``bind``, ``sync_weights``, ``with_options``,
    ``temperature``, ``max_new_tokens``, ``n``) to the wrapped ``rollout``.

    ``with_options`` (validation sampling) returns the wrapped rollout's copy: validation samples
    plainly, without what the wrapper adds.
    """

    def __init__(self, rollout):
        self.rollout = rollout
        self.in_keys, self.out_keys = tuple(rollout.in_keys), tuple(rollout.out_keys)

    def bind(self, model, tokenizer) -> None:
        self.rollout.bind(model, tokenizer)

    def sync_weights(self, trained):
        return self.rollout.sync_weights(trained)

    def with_options(self, **overrides):
        return self.rollout.with_options(**overrides)

    @property
    def tokenizer(self):
        return self.rollout.tokenizer

    @property
    def holds_own_weights(self) -> bool:
        return self.rollout.holds_own_weights

    @property
    def temperature(self) -> float:
        return self.rollout.temperature

    @property
    def max_new_tokens(self) -> int | None:
        return self.rollout.max_new_tokens

    @property
    def n(self) -> int:
        return self.rollout.n


def cat_batches(batches: Sequence[TensorDict], pad_token_id: int) -> TensorDict:
    """Concatenate batches along rows, padding 2-D tensors to a common width first.

    Prompt ids/mask are padded on the left (they are left-padded), every other ``[B, X]`` tensor
    on the right; ids get ``pad_token_id``, routed experts -1, everything else 0. All batches must have the same keys.
    The result carries no TensorDict device tag (its tensors stay where they were).
    """
    keys = [set(b.keys()) for b in batches]
    if any(k != keys[0] for k in keys):
        raise KeyError(f"cannot join batches with different keys: {[sorted(k ^ keys[0]) for k in keys]}")
    padded = []
    for b in batches:
        b = b.clone(False)
        b.clear_device_()  # a TensorDict's device tag (None or set) must agree for cat; the tensors keep theirs
        for key in keys[0]:
            value = b.get(key)
            if not isinstance(value, torch.Tensor) or value.dim() < 2:
                continue
            width = max(other.get(key).shape[1] for other in batches)
            gap = width - value.shape[1]
            if gap:
                fill = pad_token_id if key in (K.PROMPT_IDS, K.RESPONSE_IDS) else -1 if key in ROUTING else 0
                pad = (0, 0) * (value.dim() - 2) + ((gap, 0) if key in LEFT_PADDED else (0, gap))
                b.set(key, nnF.pad(value, pad, value=fill))
        padded.append(b)
    return torch.cat(padded)
