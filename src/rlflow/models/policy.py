"""The Policy: a Hugging Face causal LM that scores response tokens."""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import torch
from tensordict import TensorDict
from torch import Tensor, nn

from rlflow.data import keys as K
from rlflow.data.nontensor import per_row
from rlflow.models.checks import (check_model_folder, check_tokenizer, enable_activation_checkpointing,
                                  offloaded_activations)
from rlflow.models.hf_config import load_config, model_kwargs
from rlflow.models.hub import locate_model
from rlflow.models.liger import apply_liger
from rlflow.models.logprobs import TokenLogProbs
from rlflow.models.qat import apply_qat, plain_copy, quantized_layers
from rlflow.models.vision import freeze_vision_tower as freeze, load_processor
from rlflow.module import BatchModule
from rlflow.trainer.batching import scoring_pieces


class Policy(BatchModule):
    """A causal LM or an image-text-to-text model (any architecture transformers loads, or an in-memory model).

    As a module in the chain it writes ``log_prob_key`` (default ``old_log_probs``)
    and ``entropy`` without gradients; during updates the Trainer calls
    :meth:`log_probs` under autograd.

    Args:
        model: the causal LM.
        tokenizer: its tokenizer (the rollout decodes with it); default: the processor's.
        processor: for a vision-language model, its processor (images -> ``pixel_values``; the prompt data
            uses it). Batches then carry ``multi_modal_inputs`` (``rlflow.models.vision``).
        temperature: the sampling temperature; log-probs use the same scaled logits.
        micro_batch_size: rows per forward pass when scoring a batch (``None``: all at once).
        max_tokens_per_micro_batch: token budget per scoring forward pass instead (verl's
            ``log_prob_use_dynamic_bsz`` + ``log_prob_max_token_len_per_gpu``): rows grouped by length as the
            Trainer's training micro-batches are (``rlflow.trainer.batching``), results in the batch's row order;
            ``micro_batch_size`` then also caps the rows. ``None``: split by rows only.
        gradient_checkpointing: recompute activations in the backward pass.
        activation_offload: keep the activations the backward pass needs in CPU memory
            (``torch.autograd.graph.save_on_cpu``) during the update's forward pass; the same loss and
            gradients, less accelerator memory (verl's ``model.enable_activation_offload``; on CPU nothing moves).
        log_prob_key / entropy_key: where the scoring pass writes (``entropy_key=None`` skips it).
        remove_padding: score packed sequences without padding (``rlflow.models.packing``); log-probs and
            entropy after the end of each response (``response_mask``) are then 0.
        lora: a ``peft.LoraConfig`` (new adapters) or an adapter folder (trained further) to put LoRA
            adapters on ``model`` (PEFT wraps it in place; :attr:`model` is then the ``PeftModel``). Only the
            adapter is trainable; :meth:`reference` is the same model with the adapter off; checkpoints hold
            the adapter (see ``rlflow.models.lora`` and the LoRA docs page). A ``PeftModel`` passed as
            ``model`` is used as it is.
        share_prompts: rows with the same prompt (a prompt's ``n`` samples) run it through the model once
            (``rlflow.models.shared_prompt``; padded layout, where the model allows it). Same results.
        freeze_vision_tower: a vision-language model's vision tower (with any LoRA adapters in it) is not trained
            (``rlflow.models.vision.freeze_vision_tower``); a text model is an error.
        qat: quantization-aware training (verl's ``qat``): ``{"mode": "w4a16", "group_size": 16,
            "ignore_patterns": [...]}`` (any subset; ``rlflow.models.qat.apply_qat``'s arguments) makes the model's
            linear layers compute with NVFP4 fake-quantized weights, straight-through gradients to the master
            weights; engines are sent the quantized values, and :meth:`reference` is the unquantized model.
    """

    in_keys = (K.PROMPT_IDS, K.PROMPT_MASK, K.RESPONSE_IDS)
    activation_offload = False  # a reference (AdapterDisabledReference, ...) scores without it

    def __init__(
        self,
        model: nn.Module,
        tokenizer=None,
        *,
        processor=None,
        temperature: float = 1.0,
        micro_batch_size: int | None = None,
        max_tokens_per_micro_batch: int | None = None,
        gradient_checkpointing: bool = False,
        log_prob_key: str = K.OLD_LOG_PROBS,
        entropy_key: str | None = K.ENTROPY,
        remove_padding: bool = False,
        lora=None,
        share_prompts: bool = True,
        freeze_vision_tower: bool = False,
        activation_offload: bool = False,
        qat: dict | None = None,
    ):
        if tokenizer is None and processor is not None:
            tokenizer = processor.tokenizer
        if tokenizer is not None:  # ids beyond the embedding table would fail mid-generation

            check_tokenizer(tokenizer, model)
            if tokenizer.pad_token is None:  # common for base models; prompts need a pad id for left padding
                tokenizer.pad_token = tokenizer.eos_token
        if qat is not None:
            if lora is not None or lora_module(model) is not None:
                raise ValueError("Policy: qat with LoRA is not supported (the adapter's merged weights would need "
                                 "quantizing); use one or the other")
            apply_qat(model, **qat)
        if lora is not None:
            from rlflow.models.lora import apply_lora

            model = apply_lora(model, lora)
        if freeze_vision_tower:
            freeze(model)
        self.model = model
        self.processor = processor
        self.tokenizer = tokenizer
        self.micro_batch_size, self.max_tokens_per_micro_batch = micro_batch_size, max_tokens_per_micro_batch
        self.log_prob_key, self.entropy_key = log_prob_key, entropy_key
        self.module: nn.Module = TokenLogProbs(model, temperature=temperature, remove_padding=remove_padding,
                                                   share_prompts=share_prompts)
        self.remove_padding, self.share_prompts = remove_padding, share_prompts
        self.activation_offload = activation_offload
        if gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
            enable_activation_checkpointing(model, {"use_reentrant": False})
        if lora_module(model) is not None:  # checkpoints save what training changes: the adapter
            lora_module(model).keep_trainable_state_only(self.module)

    @property
    def out_keys(self) -> tuple[str, ...]:
        return (self.log_prob_key,) + ((self.entropy_key,) if self.entropy_key else ())

    @property
    def temperature(self) -> float:
        return self.module.temperature

    @classmethod
    def from_pretrained(cls, path: str | Path, *, min_pixels: int | None = None, max_pixels: int | None = None,
                        trust_remote_code: bool = False, override_config: dict | None = None,
                        tokenizer_trust_remote_code: bool | None = None,
                        tokenizer_path: str | Path | None = None, config_path: str | Path | None = None,
                        chat_template: str | None = None, use_liger: bool = False, **kwargs) -> "Policy":
        """Load a model (weights, config, tokenizer): a local folder, or a Hugging Face hub id.

        A hub id (``"Qwen/Qwen2.5-0.5B-Instruct"``) loads as in transformers: downloaded or revalidated
        when the hub is reachable, from the cache when offline (``HF_HUB_OFFLINE=1``); neither fails at
        once with :class:`~rlflow.models.hub.ModelNotFoundError`. A path that is not a hub id (``./m``,
        ``/m``, ``a/b/c``) is only ever a local folder. ``kwargs`` go to the ``Policy`` constructor;
        ``lora=`` as there (the adapter then records the folder's absolute path as its base model).

        An image-text-to-text model (its config has a ``vision_config``: Qwen2-VL, Qwen2.5-VL, ...) is loaded
        with ``AutoModelForImageTextToText`` and its processor (``rlflow.models.vision.load_processor``;
        ``min_pixels`` / ``max_pixels`` bound the image sizes); anything else with ``AutoModelForCausalLM``.

        ``trust_remote_code``: run the folder's own model code (transformers' switch, off by default);
        ``tokenizer_trust_remote_code`` (default: the same) for its tokenizer / processor. ``override_config``
        entries update the model's config before it is built (``rlflow.models.hf_config``: e.g.
        ``{"attention_dropout": 0.1}``, ``{"attn_implementation": "eager"}``). ``tokenizer_path`` (a folder or
        hub id) is where the tokenizer and the processor are read from, and ``config_path`` the model config
        (``config.json``), when they are not the model's own (verl's ``model.tokenizer_path`` /
        ``model.hf_config_path``). ``chat_template`` replaces the tokenizer's (and the processor's) chat template
        (verl's ``model.custom_chat_template``). ``use_liger``: patch liger-kernel's Triton kernels into the
        model (``rlflow.models.liger``; verl's ``model.use_liger``): they run on CUDA GPUs only.
        """
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer


        located = locate_model(path)
        path = (check_model_folder(located.folder, tokenizer=tokenizer_path is None) if located.folder is not None
                else located.path)  # clear errors now
        folder = Path(path).expanduser()
        weights = folder.resolve() if folder.is_dir() else path  # absolute: a LoRA adapter records it as its base
        trust_tokenizer = trust_remote_code if tokenizer_trust_remote_code is None else tokenizer_trust_remote_code
        config = load_config(config_path or path, override_config, trust_remote_code)
        load, tokens = {"config": config, **model_kwargs(override_config, trust_remote_code)}, tokenizer_path or path
        if getattr(config, "vision_config", None) is not None:
            processor = load_processor(tokens, min_pixels, max_pixels, trust_remote_code=trust_tokenizer)
            tokenizer = processor.tokenizer
            tokenizer.padding_side = "left"
            model = AutoModelForImageTextToText.from_pretrained(weights, **load)
        else:
            processor = None
            tokenizer = AutoTokenizer.from_pretrained(tokens, padding_side="left", trust_remote_code=trust_tokenizer)
            model = AutoModelForCausalLM.from_pretrained(weights, **load)
        check_tokenizer(tokenizer, source=str(tokens))
        if use_liger:
            apply_liger(model)
        if chat_template is not None:
            tokenizer.chat_template = chat_template
            if processor is not None:  # a VLM's prompts are rendered by its processor
                processor.chat_template = chat_template
        return cls(model, tokenizer, processor=processor, **kwargs)

    def log_probs(self, batch: TensorDict, topk_ids: Tensor | None = None) -> tuple[Tensor, ...]:
        """Log-probs and entropy of ``batch``'s response tokens (``B x R`` each), under the caller's grad mode.

        Rows of a vision-language batch are scored with their images (``multi_modal_inputs``). ``topk_ids``
        (``B x R x k``: a distillation teacher's top-k tokens) adds a third output, the log-probs of those
        tokens (``B x R x k``), from the same pass.
        """
        extra = {} if topk_ids is None else {"topk_ids": topk_ids}
        if K.MULTI_MODAL_INPUTS in batch.keys():
            extra["multi_modal"] = per_row(batch, K.MULTI_MODAL_INPUTS)
        if K.ROUTED_EXPERTS in batch.keys() and getattr(self.module, "replays_rollout_routing", False):
            extra["routed_experts"] = (batch[K.PROMPT_ROUTED_EXPERTS], batch[K.ROUTED_EXPERTS])  # MoE replay (R3)
        # trained multi-token prediction layers (Megatron's, rlflow.strategies.megatron.mtp) train on the response mask
        wants_mask = self.remove_padding or getattr(self.module, "mtp_losses", None) is not None
        mask = (batch.get(K.RESPONSE_MASK, None),) if wants_mask else ()
        with offloaded_activations(self.activation_offload):
            return self.module(batch[K.PROMPT_IDS], batch[K.PROMPT_MASK], batch[K.RESPONSE_IDS], *mask, **extra)

    def with_auxiliary_loss(self, out, num_tokens: float):
        """A micro-batch's ``LossOutput`` plus the loss the model's own layers left in its :meth:`log_probs` passes:
        multi-token prediction under the Megatron strategy (``rlflow.strategies.megatron.mtp``), its per-layer mean
        cross-entropy as stats. ``num_tokens``: the mini-batch's response tokens per process (the token-mean divisor)."""
        losses = getattr(self.module, "mtp_losses", None)
        extra = losses.take(num_tokens) if losses is not None else None
        if extra is None:
            return out
        return dataclasses.replace(out, loss=out.loss + extra[0], stats=out.stats | extra[1])

    @torch.no_grad()
    def forward(self, batch: TensorDict) -> TensorDict:
        pieces, restore = scoring_pieces(batch, self.micro_batch_size, self.max_tokens_per_micro_batch)
        parts = [self.log_probs(mb) for mb in pieces]
        log_probs = torch.cat([lp for lp, _ in parts])
        batch[self.log_prob_key] = log_probs if restore is None else log_probs[restore]
        if self.entropy_key:
            entropy = torch.cat([ent for _, ent in parts])
            batch[self.entropy_key] = entropy if restore is None else entropy[restore]
        return batch

    @torch.no_grad()
    def top_k(self, batch: TensorDict, k: int) -> tuple[Tensor, Tensor, Tensor]:
        """A distillation teacher's pass (``rlflow.models.teacher``), split as :meth:`forward`: the response tokens'
        log-probs ``B x R`` and the ``k`` most likely tokens' log-probs and ids at each position, ``B x R x k``."""
        pieces, restore = scoring_pieces(batch, self.micro_batch_size, self.max_tokens_per_micro_batch)
        parts = []
        for mb in pieces:
            extra = {"multi_modal": per_row(mb, K.MULTI_MODAL_INPUTS)} if K.MULTI_MODAL_INPUTS in mb.keys() else {}
            parts.append(self.module.top_k(mb[K.PROMPT_IDS], mb[K.PROMPT_MASK], mb[K.RESPONSE_IDS], k,
                                           mb.get(K.RESPONSE_MASK, None), **extra))
        outs = [torch.cat(column) for column in zip(*parts)]
        return tuple(o if restore is None else o[restore] for o in outs)

    def reference(self, micro_batch_size: int | None = None,
                  max_tokens_per_micro_batch: int | None = None) -> "Policy":
        """The KL anchor, writing ``ref_log_probs``: a frozen copy of the model, or with LoRA the same model
        with its adapter disabled (no copy). ``micro_batch_size``, ``max_tokens_per_micro_batch``: its scoring
        passes' rows / token budget (each defaults to the policy's)."""
        micro = micro_batch_size if micro_batch_size is not None else self.micro_batch_size
        tokens = max_tokens_per_micro_batch if max_tokens_per_micro_batch is not None \
            else self.max_tokens_per_micro_batch
        if lora_module(self.model) is not None:
            return AdapterDisabledReference(self, micro, tokens)
        frozen = plain_copy(self.model).eval().requires_grad_(False)  # quantization-aware training: unquantized
        return Policy(
            frozen,
            self.tokenizer,
            processor=self.processor,
            temperature=self.temperature,
            micro_batch_size=micro,
            max_tokens_per_micro_batch=tokens,
            log_prob_key=K.REF_LOG_PROBS,
            entropy_key=None,
            remove_padding=self.remove_padding,
            share_prompts=self.share_prompts,
        )

    def engine_copy(self) -> nn.Module:
        """A full copy for a generation engine of its own (when training shards the weights): the model, or
        with LoRA a plain transformers model with the adapter merged (any engine loads it; weight sync then
        sends the merged weights of the adapted layers), or with quantization-aware training a plain model holding
        the fake-quantized weights (weight sync sends those, ``rlflow.models.qat``)."""
        lora = lora_module(self.model)
        if lora is not None:
            return lora.merged_copy(self.model)
        return plain_copy(self.model, served=True) if quantized_layers(self.model) else copy.deepcopy(self.model)


class AdapterDisabledReference(Policy):
    """The KL reference of a LoRA policy: the policy's own module, scored with the adapter off.

    Nothing is copied: :attr:`module` is the policy's (as the strategy wrapped it), and scoring runs
    under ``PeftModel.disable_adapter()``, so the log-probs are the base model's. Writes ``ref_log_probs``.
    """

    def __init__(self, policy: Policy, micro_batch_size: int | None = None,
                 max_tokens_per_micro_batch: int | None = None):
        # no module of its own (Policy.__init__ would build one): the policy's is used, see `module`
        self.source = policy
        self.model, self.tokenizer = policy.model, policy.tokenizer
        self.micro_batch_size = micro_batch_size if micro_batch_size is not None else policy.micro_batch_size
        self.max_tokens_per_micro_batch = (max_tokens_per_micro_batch if max_tokens_per_micro_batch is not None
                                           else policy.max_tokens_per_micro_batch)
        self.log_prob_key, self.entropy_key = K.REF_LOG_PROBS, None
        self.remove_padding = policy.remove_padding

    @property
    def module(self) -> nn.Module:
        return self.source.module

    def log_probs(self, batch):
        with self.model.disable_adapter():
            return super().log_probs(batch)


def lora_module(model):
    """``rlflow.models.lora`` when ``model`` is a PEFT model, else ``None`` (plain runs never import PEFT)."""
    peft = sys.modules.get("peft")
    if peft is None or not isinstance(model, peft.PeftModel):
        return None
    from rlflow.models import lora

    return lora
