"""A Hugging Face decoder (Qwen2/Qwen2.5, Qwen3, Qwen3-MoE, Llama, Qwen3.5 text; a Qwen2.5-VL / Qwen3.5 language model,
:mod:`.vision`) rebuilt as this rank's megatron-core shard.

:func:`transformer_config_kwargs` maps the Hugging Face config to Megatron's ``TransformerConfig``;
:class:`MegatronLM` holds the ``GPTModel`` of this rank (its pipeline stage, its tensor and expert
shards) and runs the decoder over a left-padded batch exactly as transformers does:

- the rotary table comes from the Hugging Face model's own ``inv_freq`` (so every rope variant with fixed
  frequencies matches), at positions ``0..S-1``: rows hold their real tokens first (:mod:`.heads`);
- the attention mask is causal only (padding comes after every real token);
- between pipeline stages the hidden states travel in float32 (:mod:`.pipeline`).

The weights are not initialised here (``perform_initialization=False``): :mod:`.slots` copies every
parameter from the Hugging Face model and checks that none is left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlflow.strategies.megatron import qwen3_5
from rlflow.strategies.megatron.layout import ParallelLayout
from rlflow.strategies.megatron.vision import (LANGUAGE_MODELS, VisionBatch, VisionPart, is_vision_language,
                                               language_config)


@dataclass(frozen=True)
class Architecture:
    """What distinguishes the supported decoders in Megatron's terms."""

    qkv_bias: bool    # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool     # RMSNorm on each head's queries and keys (Qwen3)
    moe: bool         # the MLPs are routed experts (Qwen3-MoE)


ARCHITECTURES = {
    "qwen2": Architecture(qkv_bias=True, qk_norm=False, moe=False),
    "mimo": Architecture(qkv_bias=True, qk_norm=False, moe=False),  # Qwen2 + MTP layers (rlflow.models.mimo)
    "qwen2_5_vl_text": Architecture(qkv_bias=True, qk_norm=False, moe=False),  # Qwen2.5-VL's language model (.vision)
    "llama": Architecture(qkv_bias=False, qk_norm=False, moe=False),
    "qwen3": Architecture(qkv_bias=False, qk_norm=True, moe=False),
    "qwen3_moe": Architecture(qkv_bias=False, qk_norm=True, moe=True),
    # Qwen3.5 (text): Gated DeltaNet and gated attention layers, zero-centred norms (strategies/megatron/qwen3_5.py)
    "qwen3_5_text": Architecture(qkv_bias=False, qk_norm=True, moe=False),
    "qwen3_5_moe_text": Architecture(qkv_bias=False, qk_norm=True, moe=True),  # + a gated shared expert
}


def architecture(config, layout: ParallelLayout | None = None) -> Architecture:
    """The architecture of a Hugging Face config (a vision-language model's: its language model's, :mod:`.vision`),
    or a clear error for what the conversion does not cover (at ``layout``, when given)."""
    if is_vision_language(config) and config.model_type in LANGUAGE_MODELS:
        if layout is not None and layout.sequence_parallel and layout.tensor > 1:
            raise ValueError(f"{config.model_type}: sequence parallelism does not combine with a vision-language "
                             "model under the Megatron strategy (its image features are written into the whole "
                             "sequence's embeddings before the decoder)")
        config = language_config(config)
    arch = ARCHITECTURES.get(config.model_type)
    if arch is None:
        raise ValueError(f"the Megatron strategy converts {', '.join(ARCHITECTURES)} models and the vision-language "
                         f"{', '.join(LANGUAGE_MODELS)}; got model_type={config.model_type!r}")
    unsupported = [what for what, bad in (
        ("hidden_act other than silu", config.hidden_act != "silu"),
        ("attention_bias=True", bool(getattr(config, "attention_bias", False))),
        ("mlp_bias=True", bool(getattr(config, "mlp_bias", False))),
        ("sliding-window attention", bool(getattr(config, "use_sliding_window", False))),
        ("dense layers between MoE layers (mlp_only_layers / decoder_sparse_step)",
         arch.moe and (bool(getattr(config, "mlp_only_layers", None))
                       or getattr(config, "decoder_sparse_step", 1) != 1)),
    ) if bad]
    if unsupported:
        raise ValueError(f"{config.model_type}: the Megatron conversion does not support {', '.join(unsupported)}")
    if layout is not None and qwen3_5.is_hybrid(config):
        qwen3_5.check_layout(layout, config)
    elif layout is not None and arch.moe and layout.tensor > 1:
        raise ValueError(f"{layout.describe()} does not fit {config.model_type}: MoE models run at tensor parallel 1 "
                         "under the Megatron strategy, their experts split by expert parallelism (expert_parallel=N); "
                         "megatron-core splits experts over tensor-parallel ranks (expert_tensor_parallel_size) only "
                         "with sequence parallelism, which rlflow's local layer spec does not run, and rlflow's weight "
                         "slots hold each expert whole")
    return arch


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def padded_vocab(vocab_size: int, tensor: int) -> int:
    """Rows of the embedding and output layer: the vocabulary rounded up to a multiple of ``tensor``.

    Every rank then holds ``ceil(V / tensor)`` rows, the split ``torch.chunk`` (and DTensor's ``Shard``)
    uses; the padding rows sit at the end of the last rank and never reach a softmax."""
    return math.ceil(vocab_size / tensor) * tensor


def transformer_config_kwargs(config, layout: ParallelLayout, *, on_cpu: bool, overrides: dict | None = None) -> dict:
    """``TransformerConfig`` arguments for a Hugging Face ``config`` under ``layout``.

    Dropout is 0 and every fusion is off (they need CUDA kernels or change numerics); parameters are
    float32 (mixed precision is the Fabric precision plugin's autocast). ``overrides`` (verl's
    ``megatron.override_transformer_config``) are applied last, e.g. recomputation on GPUs.
    """
    arch = architecture(config)
    kwargs = dict(
        num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
        ffn_hidden_size=getattr(config, "intermediate_size", None) or config.moe_intermediate_size, num_attention_heads=config.num_attention_heads,
        num_query_groups=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        kv_channels=head_dim(config), normalization="RMSNorm", layernorm_epsilon=config.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm, hidden_dropout=0.0, attention_dropout=0.0, attention_softmax_in_fp32=True,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        use_cpu_initialization=on_cpu, perform_initialization=False, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, tensor_model_parallel_size=layout.tensor,
        pipeline_model_parallel_size=layout.pipeline, context_parallel_size=layout.context,
        expert_model_parallel_size=layout.expert, expert_tensor_parallel_size=layout.expert_tensor,
        sequence_parallel=layout.sequence_parallel and layout.tensor > 1,
    )
    if qwen3_5.is_hybrid(config):
        kwargs.update(qwen3_5.config_kwargs(config))
    if arch.moe:
        kwargs.update(
            num_moe_experts=config.num_experts, moe_router_topk=config.num_experts_per_tok,
            moe_ffn_hidden_size=config.moe_intermediate_size,
            # transformers' Qwen3-MoE: softmax over all experts, top-k, renormalised when norm_topk_prob;
            # Megatron's default (top-k of the logits, then softmax) is the renormalised case
            moe_router_pre_softmax=not getattr(config, "norm_topk_prob", True),  # Qwen3.5-MoE: always renormalised
            # no auxiliary loss: transformers adds none unless output_router_logits, and a per-rank
            # load-balancing loss would make the update depend on how tokens are split over ranks
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            # the all-to-all dispatcher needs a CUDA stream; all-gather gives the same tokens to the same experts
            moe_token_dispatcher_type="allgather" if on_cpu else "alltoall",
            moe_grouped_gemm=False, moe_permute_fusion=False,
        )
    return kwargs | dict(overrides or {})


def _gpt_model_class():
    from megatron.core.models.gpt import GPTModel

    class RLFlowGPTModel(GPTModel):
        """``GPTModel`` whose tied embedding set-up does not go through CUDA.

        Megatron's ``setup_embeddings_and_output_layer`` zeroes the last pipeline stage's copy of a
        tied embedding, moves it to CUDA and all-reduces the first stage's weights into it. rlflow loads
        both copies from the same Hugging Face tensor, so only the attributes Megatron's gradient code
        reads are set (the two copies' gradients are summed in :mod:`.grads`).
        """

        def setup_embeddings_and_output_layer(self) -> None:
            if self.pre_process:
                self.embedding.word_embeddings.weight.is_embedding_or_output_parameter = True
            if self.post_process and self.output_layer.weight is not None:
                self.output_layer.weight.is_embedding_or_output_parameter = True
            if not self.share_embeddings_and_output_weights:
                return
            weight = self.shared_embedding_or_output_weight()
            if self.config.pipeline_model_parallel_size == 1:
                weight.zero_out_wgrad = True
                return
            weight.shared_embedding = True
            if not self.pre_process:
                weight.shared = True

    return RLFlowGPTModel


def layer_spec(config, kind: str):
    """Megatron's layer spec: ``"local"`` (megatron-core's own modules: runs anywhere) or
    ``"transformer_engine"`` (fused Transformer-Engine modules: CUDA only)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    arch = architecture(config)
    experts = config.num_experts if arch.moe else None
    if kind == "local":
        return specs.get_gpt_layer_local_spec(num_experts=experts, qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    if kind == "transformer_engine":
        return specs.get_gpt_layer_with_transformer_engine_spec(num_experts=experts, qk_layernorm=arch.qk_norm)
    raise ValueError(f"layer_spec={kind!r}: choose 'local' or 'transformer_engine'")


class MegatronLM(nn.Module):
    """This rank's shard of a Hugging Face decoder as a megatron-core ``GPTModel``.

    Args:
        hf_model: the Hugging Face causal LM (its config and rotary frequencies are read; weights are
            copied by :func:`rlflow.strategies.megatron.slots.load_from_hf`).
        layout: the parallel sizes (Megatron's process groups must already exist).
        spec: ``"local"`` or ``"transformer_engine"`` (see :func:`layer_spec`).
        on_cpu: apply the CPU-only choices of :func:`transformer_config_kwargs`.
        overrides: extra ``TransformerConfig`` fields.
    """

    def __init__(self, hf_model: nn.Module, layout: ParallelLayout, spec: str = "local", on_cpu: bool = True,
                 overrides: dict | None = None):
        super().__init__()
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.transformer_config import TransformerConfig

        config = language_config(hf_model.config)
        architecture(hf_model.config, layout)
        layout.check_model(config)
        rotary = hf_model.get_decoder().rotary_emb
        if getattr(rotary, "attention_scaling", 1.0) != 1.0 or getattr(rotary, "rope_type", "default") not in (
                "default", "linear", "llama3"):
            raise ValueError(f"rope_type={rotary.rope_type!r} (attention scaling {rotary.attention_scaling}) is not "
                             "supported by the Megatron conversion: it uses fixed rotary frequencies")
        self.hf_config, self.layout = config, layout
        self.tp_rank, self.tp_size = ps.get_tensor_model_parallel_rank(), layout.tensor
        self.first_stage, self.last_stage = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        self.config = TransformerConfig(**transformer_config_kwargs(config, layout, on_cpu=on_cpu, overrides=overrides))
        self.vocab_size = config.vocab_size
        rows = padded_vocab(config.vocab_size, layout.tensor)
        self.vocab_start = self.tp_rank * rows // layout.tensor
        self.vocab_local = max(0, min(rows // layout.tensor, config.vocab_size - self.vocab_start))  # real rows here
        if self.vocab_local == 0:
            raise ValueError(f"vocabulary {config.vocab_size} is too small for tensor parallel {layout.tensor}")
        block = qwen3_5.block_spec(config, self.config, spec) if qwen3_5.is_hybrid(config) else layer_spec(config, spec)
        self.gpt = _gpt_model_class()(
            config=self.config, vocab_size=rows, transformer_layer_spec=block,
            mtp_block_spec=self._mtp_spec(block, spec),
            max_sequence_length=config.max_position_embeddings, pre_process=self.first_stage,
            post_process=self.last_stage, share_embeddings_and_output_weights=bool(config.tie_word_embeddings),
            position_embedding_type="rope", parallel_output=True)
        self.register_buffer("inv_freq", rotary.inv_freq.detach().clone().float(), persistent=False)
        # a vision-language model's tower (first stage) and multimodal positions (.vision)
        self.vision = VisionPart(hf_model, self.first_stage) if is_vision_language(hf_model.config) else None
        self.explicit_mask = spec == "local"
        # transformers' nn.Embedding(padding_idx): that token's row gets no gradient from its lookups
        self.padding_idx = getattr(hf_model.get_input_embeddings(), "padding_idx", None)
        for name, param in self.gpt.named_parameters():
            # replicated over the tensor-parallel ranks, but each rank's copy only sees its own heads (q/k norms)
            # or tokens (sequence parallel): the gradients are partial sums (Megatron's finalize_model_grads too)
            # (and Qwen3.5's Gated DeltaNet out_norm, over each rank's value heads)
            if any(n in name for n in ("q_layernorm", "k_layernorm", "out_norm")) \
                    or getattr(param, "sequence_parallel", False):
                param.partial_over_tensor_parallel = True

    def _mtp_spec(self, block, spec: str):
        """megatron-core's multi-token prediction block (``mtp_num_layers`` MTP layers after the decoder) or ``None``."""
        if not self.config.mtp_num_layers:
            return None
        layout = self.layout
        if layout.pipeline > 1 or layout.context > 1 or self.config.sequence_parallel:
            raise ValueError(f"multi-token prediction runs at pipeline, context and sequence parallel 1 under rlflow's "
                             f"Megatron strategy (its MTP block sits with the embedding on one stage); got "
                             f"{layout.describe()}")
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        return get_gpt_mtp_block_spec(self.config, block, use_transformer_engine=spec == "transformer_engine")

    def rotary_and_mask(self, S: int, device) -> tuple[Tensor, Tensor | None]:
        """The rotary angles ``[S, 1, 1, D]`` of positions ``0..S-1`` and the causal mask (local spec) or ``None``."""
        positions = torch.arange(S, device=device)
        freqs = positions[:, None].float() * self.inv_freq  # rotary angles, halves repeated (transformers' rotate_half)
        rotary = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]
        # the local spec's default causal mask is built on CUDA: pass it (True = not attended); Transformer
        # Engine builds its own causal mask
        mask = torch.ones(S, S, dtype=torch.bool, device=device).triu(1)[None, None] if self.explicit_mask else None
        return rotary, mask

    def hidden_states(self, input_ids: Tensor, stage_input: Tensor | None, images: VisionBatch | None = None) -> Tensor:
        """This stage's output ``[S, B, H]``: the embedding (first stage) or ``stage_input``, then its layers.

        ``input_ids`` is ``B x S`` with every row's real tokens first and its padding last (see
        :mod:`.heads`), so position ``j`` is token ``j`` of its sequence and a causal mask is the whole
        mask: padding sits after every real token. On the last stage the output is the final-norm state.
        ``images`` (a vision-language model's batch, :mod:`.vision`): their features go into the embeddings and the
        rotary angles are taken at its 3-D positions.
        """
        S = input_ids.shape[1]
        positions = torch.arange(S, device=input_ids.device)
        rotary, mask = self.rotary_and_mask(S, input_ids.device)
        if images is not None:
            rotary = self.vision.rotary(images.positions, self.inv_freq)
        if self.first_stage:
            hidden = self.gpt.embedding(input_ids=input_ids, position_ids=positions[None])
            if images is not None:
                hidden = self.vision.embed(hidden, images)
            if self.padding_idx is not None and hidden.requires_grad:
                is_pad = (input_ids == self.padding_idx).transpose(0, 1)[..., None]  # S x B x 1
                if self.config.sequence_parallel:  # the embedding output is this rank's slice of the sequence
                    is_pad = is_pad.chunk(self.tp_size)[self.tp_rank]
                hidden.register_hook(lambda grad: grad.masked_fill(is_pad, 0.0))
        else:
            hidden = stage_input
            self.gpt.decoder.set_input_tensor(stage_input)  # Megatron's later stages read their input from here
        return self.gpt.decoder(hidden_states=hidden, attention_mask=mask, rotary_pos_emb=rotary)

    def full_sequence(self, hidden: Tensor) -> Tensor:
        """The last stage's ``[S, B, H]`` states: under sequence parallelism each rank holds ``S / tp`` of them, so
        they are gathered (the backward keeps this rank's slice of the gradient, which is complete: the head's
        input gradient is all-reduced over the tensor-parallel ranks in :meth:`logits`)."""
        if not self.config.sequence_parallel:
            return hidden
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)

    def sequence_chunk(self) -> int:
        """Pipeline messages hold ``S / tp`` positions under sequence parallelism: ``S`` must divide by this."""
        return self.tp_size if self.config.sequence_parallel else 1

    def output_weight(self) -> Tensor | None:
        """The output layer's weight when it is the (tied) embedding, else ``None`` (the layer's own)."""
        return self.gpt.shared_embedding_or_output_weight() if self.gpt.share_embeddings_and_output_weights else None

    def logits(self, hidden: Tensor, detach_weight: bool = False) -> Tensor:
        """``N x H`` final hidden states -> ``N x V_local`` logits of this rank's real vocabulary columns
        (``detach_weight``: no gradient reaches the output layer, as verl's MTP loss)."""
        layer = self.gpt.output_layer
        weight = self.output_weight()
        if detach_weight:
            weight = (layer.weight if weight is None else weight).detach()
        sequence_parallel, layer.sequence_parallel = layer.sequence_parallel, False  # its input is gathered already
        try:
            out, _ = layer(hidden[:, None], weight=weight)
        finally:
            layer.sequence_parallel = sequence_parallel
        return out[:, 0, : self.vocab_local]
