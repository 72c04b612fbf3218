"""The Critic: a value model (a causal LM's backbone plus a scalar head) for PPO with GAE."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import Tensor, nn

from rlflow.data import keys as K
from rlflow.models.logprobs import response_hidden_states
from rlflow.module import BatchModule


class ValueHeadModel(nn.Module):
    """``forward`` gives the value of the state before each response token: ``B x R``.

    As in verl, the value for response token t is read at the position that
    predicts it (the hidden state after the prompt and the first t-1 tokens).
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        hidden = lm.config.hidden_size
        self.value_head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.value_head.weight)  # start from V = 0: no bias before the first update
        nn.init.zeros_(self.value_head.bias)

    def forward(self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor) -> Tensor:
        hidden = response_hidden_states(self.lm, prompt_ids, prompt_mask, response_ids)
        return self.value_head(hidden).squeeze(-1).float()


class Critic(BatchModule):
    """Writes ``values`` (no gradients); the Trainer calls :meth:`values` under autograd when updating it.

    Args:
        model: a causal LM whose backbone becomes the value model (its LM head is unused).
        micro_batch_size: rows per forward pass when scoring.
    """

    in_keys = (K.PROMPT_IDS, K.PROMPT_MASK, K.RESPONSE_IDS)
    out_keys = (K.VALUES,)

    def __init__(self, model: nn.Module, *, micro_batch_size: int | None = None):
        self.module: nn.Module = ValueHeadModel(model)
        self.micro_batch_size = micro_batch_size

    @classmethod
    def from_pretrained(cls, path, **kwargs) -> "Critic":
        from transformers import AutoModelForCausalLM

        return cls(AutoModelForCausalLM.from_pretrained(path), **kwargs)

    def values(self, batch: TensorDict) -> Tensor:
        return self.module(batch[K.PROMPT_IDS], batch[K.PROMPT_MASK], batch[K.RESPONSE_IDS])

    @torch.no_grad()
    def forward(self, batch: TensorDict) -> TensorDict:
        size = self.micro_batch_size or batch.batch_size[0]
        batch[K.VALUES] = torch.cat([self.values(mb) for mb in batch.split(size)]) * batch[K.RESPONSE_MASK]
        return batch
