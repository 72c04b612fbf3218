"""The Critic: a value model (a causal LM's backbone plus a scalar head) for PPO with GAE."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import Tensor, nn

from rlflow.data import keys as K
from rlflow.models.checks import enable_activation_checkpointing, offloaded_activations
from rlflow.models.hf_config import load_config, model_kwargs
from rlflow.models.hub import locate_model
from rlflow.models.liger import apply_liger
from rlflow.models.logprobs import enable_sequence_parallel, response_hidden_states
from rlflow.models.packing import pack, packed_hidden_states, unpack
from rlflow.models.qat import apply_qat
from rlflow.models.ulysses import sequence_parallel_outputs
from rlflow.module import BatchModule
from rlflow.trainer.batching import scoring_pieces


class ValueHeadModel(nn.Module):
    """``forward`` gives the value of the state before each response token: ``B x R``.

    As in verl, the value for response token t is read at the position that
    predicts it (the hidden state after the prompt and the first t-1 tokens).
    """

    def __init__(self, lm: nn.Module, remove_padding: bool = False, pack_length: int | None = None):
        super().__init__()
        self.lm = lm
        self.remove_padding, self.pack_length = remove_padding, pack_length
        hidden = lm.config.hidden_size
        self.value_head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.value_head.weight)  # start from V = 0: no bias before the first update
        nn.init.zeros_(self.value_head.bias)
        self.sp_group = None

    def sequence_parallel(self, group) -> None:
        """Run the backbone sequence-parallel over ``group`` (Ulysses); needs ``remove_padding``."""
        self.sp_group = enable_sequence_parallel(self.lm, group, self.remove_padding)

    def forward(self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                response_mask: Tensor | None = None) -> Tensor:
        if self.remove_padding:  # packed sequences; values after each response's end are 0
            packed = pack(prompt_ids, prompt_mask, response_ids, response_mask, self.pack_length,
                          getattr(self.lm.config, "pad_token_id", None) or 0)
            if self.sp_group is None:
                values = self.value_head(packed_hidden_states(self.lm, packed))
            else:
                values = sequence_parallel_outputs(self.lm, packed, lambda h, _: self.value_head(h), self.sp_group)
            return unpack(values.squeeze(-1).float(), packed)
        hidden = response_hidden_states(self.lm, prompt_ids, prompt_mask, response_ids)
        return self.value_head(hidden).squeeze(-1).float()


class Critic(BatchModule):
    """Writes ``values`` (no gradients); the Trainer calls :meth:`values` under autograd when updating it.

    Args:
        model: a causal LM whose backbone becomes the value model (its LM head is unused).
        micro_batch_size: rows per forward pass when scoring.
        max_tokens_per_micro_batch: token budget per scoring forward pass instead (verl's ``critic.use_dynamic_bsz``
            + ``forward_max_token_len_per_gpu``; see ``Policy``); ``None``: split by rows only.
        remove_padding: run the backbone on packed sequences (``rlflow.models.packing``).
        activation_offload: activations of the update's forward pass kept in CPU memory (as ``Policy``'s).
        lora: a ``peft.LoraConfig`` or an adapter folder: LoRA adapters on the backbone (``rlflow.models.lora``,
            verl's ``critic.model.lora_rank`` / ``lora_adapter_path``); the backbone's own weights are frozen and
            only the adapter and the value head (new, so always trained) train.
        qat: quantization-aware training, as ``Policy``'s (``rlflow.models.qat.apply_qat``'s arguments): the
            backbone's linear layers and the value head (``value_head``, unless an ignore pattern names it) compute
            with NVFP4 fake-quantized weights (verl's critic engine quantizes its critic the same way).
    """

    in_keys = (K.PROMPT_IDS, K.PROMPT_MASK, K.RESPONSE_IDS)
    out_keys = (K.VALUES,)

    def __init__(self, model: nn.Module, *, micro_batch_size: int | None = None,
                 max_tokens_per_micro_batch: int | None = None, remove_padding: bool = False, lora=None,
                 activation_offload: bool = False, qat: dict | None = None):
        if qat is not None and lora is not None:
            raise ValueError("Critic: qat with LoRA is not supported; use one or the other")
        if lora is not None:
            from rlflow.models.lora import apply_lora  # peft: imported only for LoRA

            model = apply_lora(model, lora)
        self.module: nn.Module = ValueHeadModel(model, remove_padding=remove_padding)
        if qat is not None:
            apply_qat(self.module, **qat)
        self.micro_batch_size, self.max_tokens_per_micro_batch = micro_batch_size, max_tokens_per_micro_batch
        self.remove_padding, self.activation_offload = remove_padding, activation_offload

    @classmethod
    def from_pretrained(cls, path, *, trust_remote_code: bool = False, override_config: dict | None = None,
                        config_path=None, gradient_checkpointing: bool = False, use_liger: bool = False,
                        **kwargs) -> "Critic":
        """A critic from a model folder or hub id (resolved as ``Policy.from_pretrained`` does;
        ``trust_remote_code``, ``override_config``, ``config_path`` (the model config, when not the folder's) and
        ``gradient_checkpointing``, ``use_liger`` as there)."""
        config = locate_model(config_path).path if config_path else None
        model = load_causal_lm(locate_model(path).path, trust_remote_code, override_config, config_path=config)
        if use_liger:
            apply_liger(model)
        if gradient_checkpointing:
            enable_activation_checkpointing(model, {"use_reentrant": False})
        return cls(model, **kwargs)

    def values(self, batch: TensorDict) -> Tensor:
        mask = (batch.get(K.RESPONSE_MASK, None),) if self.remove_padding else ()
        with offloaded_activations(self.activation_offload):
            return self.module(batch[K.PROMPT_IDS], batch[K.PROMPT_MASK], batch[K.RESPONSE_IDS], *mask)

    @torch.no_grad()
    def forward(self, batch: TensorDict) -> TensorDict:
        pieces, restore = scoring_pieces(batch, self.micro_batch_size, self.max_tokens_per_micro_batch)
        values = torch.cat([self.values(mb) for mb in pieces])
        batch[K.VALUES] = (values if restore is None else values[restore]) * batch[K.RESPONSE_MASK]
        return batch


def load_causal_lm(path, trust_remote_code: bool = False, override_config: dict | None = None,
                   where: str = "override_config", config_path=None) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained(path)`` with its config (``config_path``'s, when given) overridden
    first (``rlflow.models.hf_config``)."""
    from transformers import AutoModelForCausalLM


    config = load_config(config_path or path, override_config, trust_remote_code, where)
    return AutoModelForCausalLM.from_pretrained(path, config=config, **model_kwargs(override_config, trust_remote_code))
