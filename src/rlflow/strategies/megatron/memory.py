"""Per-rank memory of a Megatron layout, from the Hugging Face config alone (no weights, no megatron import).

Parameters per rank: each decoder layer's matrices are split over the ``tensor``-parallel ranks (its
norms are whole on every rank), the layers over the ``pipeline`` stages, the experts over the
``expert``-parallel ranks; the embedding (first stage) and the output layer (last stage; a tied
embedding keeps a copy there when there are several stages) are split over the vocabulary.

Bytes per parameter, as this plugin trains: float32 weights, float32 gradients and AdamW's two
float32 moments, **16 B** on every rank (the Trainer's optimizer over the rank's shards; mixed
precision is autocast); the precision-aware optimizer (``trained_bytes``, :func:`.precision_aware.trained_bytes`)
stores gradients and moments in fewer bytes. Megatron's distributed optimizer (``distributed_optimizer=True``, GPUs) shards the
12 B of master weights and moments over the data-parallel ranks: ``4 + 12 / DP`` B. A frozen
reference (KL term) adds 4 B/param, split like the policy.

Under LoRA (``lora=(r, target_modules)``) only the adapters train: the base weights are 4 B/param (no gradients,
no AdamW state), the adapters 16 B/param, and the reference is the adapter-disabled model (no copy). An adapted
projection ``in -> out`` holds ``r x (in + out)`` adapter parameters, split as :mod:`~rlflow.strategies.megatron.lora`
places them: column-parallel (q, k, v, gate, up) keep ``A`` whole and split ``B`` over TP, row-parallel (o, down)
split ``A`` and keep ``B`` whole.

Activations of one micro-batch on one stage, without recomputation, in 16-bit (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", eq. 2 with tensor parallelism, no
sequence parallelism): ``layers x s*b*h*(10 + 24/t + 5*a*s/(h*t))`` bytes; this plugin's pipeline runs
one micro-batch at a time, so one micro-batch's worth per stage. The log-prob head adds one float32
chunk of ``chunk x V/t`` logits (and a few of its size while it runs).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlflow.strategies.megatron import qwen3_5
from rlflow.strategies.megatron.layout import ParallelLayout
from rlflow.strategies.megatron.model import head_dim, padded_vocab
from rlflow.strategies.megatron.precision_aware import precision_dtypes, trained_bytes


@dataclass(frozen=True)
class LayerParameters:
    split: int        # matrices split over the tensor-parallel ranks
    whole: int        # norms and router, whole on every tensor-parallel rank
    experts: int      # expert matrices, split over the expert-parallel ranks


def layer_parameters(config) -> LayerParameters:
    """Parameters of one decoder layer of a Hugging Face config (Qwen2/Qwen3/Llama/Qwen3-MoE shapes)."""
    if qwen3_5.is_hybrid(config):
        return LayerParameters(*qwen3_5.layer_parameters(config))
    H, d, nq = config.hidden_size, head_dim(config), config.num_attention_heads
    nkv = getattr(config, "num_key_value_heads", None) or nq
    attention = H * nq * d * 2 + H * nkv * d * 2
    if config.model_type == "qwen2":
        attention += nq * d + 2 * nkv * d  # q/k/v biases
    whole = 2 * H + (2 * d if config.model_type in ("qwen3", "qwen3_moe") else 0)
    experts = 0
    if getattr(config, "num_experts", None):
        experts = config.num_experts * 3 * H * config.moe_intermediate_size
        whole += config.num_experts * H  # the router
        mlp = 0
    else:
        mlp = 3 * H * config.intermediate_size
    return LayerParameters(split=attention + mlp, whole=whole, experts=experts)


PROJECTIONS_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
PROJECTIONS_ROW = ("o_proj", "down_proj")


def lora_parameters(config, r: int, target_modules, tensor: int = 1) -> int:
    """Adapter parameters of one decoder layer on one tensor-parallel rank, for PEFT's ``target_modules`` (names or
    ``all-linear``); only the projections :mod:`~rlflow.strategies.megatron.lora` adapts count (a MoE model's
    attention; its experts are refused there)."""
    H, d, nq = config.hidden_size, head_dim(config), config.num_attention_heads
    nkv = getattr(config, "num_key_value_heads", None) or nq
    I = 0 if getattr(config, "num_experts", None) else config.intermediate_size
    shapes = {"q_proj": (H, nq * d), "k_proj": (H, nkv * d), "v_proj": (H, nkv * d), "o_proj": (nq * d, H),
              "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}
    names = {target_modules} if isinstance(target_modules, str) else set(target_modules or ())
    if "all-linear" in names:
        names = set(shapes)
    total = 0
    for name in names & set(shapes):
        n_in, n_out = shapes[name]
        if n_in and n_out:
            total += r * n_in + -(-n_out // tensor) * r if name in PROJECTIONS_COLUMN else \
                r * -(-n_in // tensor) + n_out * r
    return total


def optimizer_dtypes(optimizer_overrides: dict | None) -> tuple[dict | None, int]:
    """The precision-aware optimizer's dtypes in a strategy's ``optimizer_overrides`` (``None``: float32 AdamW) and
    the bytes of one trained parameter (weight, gradient, master copy, moments)."""
    dtypes = precision_dtypes(optimizer_overrides or {})
    return dtypes, trained_bytes(dtypes)


@dataclass(frozen=True)
class RankMemory:
    """The largest pipeline stage's share, per rank (bytes unless named otherwise)."""

    parameters: int               # parameters on one rank of the largest stage
    model_states: int             # weights + gradients + AdamW (16 B/param; trained_bytes)
    distributed_optimizer: int    # the same with Megatron's distributed optimizer (4 + 12/DP B/param)
    reference: int                # a frozen float32 copy for the KL term
    activations: int              # one micro-batch, no recomputation, 16-bit
    total_parameters: int         # of the whole model
    adapter_parameters: int = 0   # LoRA's, on the same rank (trained; the rest is frozen)

    def peak(self, with_reference: bool) -> int:
        return self.model_states + (self.reference if with_reference else 0) + self.activations


def rank_memory(config, layout: ParallelLayout, world_size: int, micro_batch: int, seq_len: int,
                chunk_tokens: int = 4096, lora: tuple[int, object] | None = None,
                trained_bytes: int = 16) -> RankMemory:
    """Estimate for the rank that holds the most parameters (see the module docstring); ``lora``: ``(r,
    target_modules)`` when only adapters train; ``trained_bytes``: weight, gradient and optimizer state of a trained
    parameter."""
    layer = layer_parameters(config)
    t, pp, ep = layout.tensor, layout.pipeline, layout.expert
    V, H, L = config.vocab_size, config.hidden_size, config.num_hidden_layers
    per_layer_rank = layer.split // t + layer.whole + layer.experts // ep
    vocab_rows = padded_vocab(V, t) // t * H
    tied = bool(config.tie_word_embeddings)
    stages = []
    for stage in range(pp):
        n = (L // pp) * per_layer_rank
        if stage == 0:
            n += vocab_rows
        if stage == pp - 1:
            n += H + (vocab_rows if (not tied or pp > 1) else 0)
        stages.append(n)
    largest = max(stages)
    total = L * (layer.split + layer.whole + layer.experts) + V * H * (1 if tied else 2) + H
    dp = layout.data_parallel(world_size)
    a, s, b = config.num_attention_heads, seq_len, micro_batch
    acts = (L // pp) * s * b * H * (10 + 24 / t + 5 * a * s / (H * t))
    head = 3 * min(chunk_tokens, s * b) * (padded_vocab(V, t) // t) * 4
    if lora is None:
        return RankMemory(parameters=largest, model_states=trained_bytes * largest,
                          distributed_optimizer=int((4 + 12 / dp) * largest), reference=4 * largest,
                          activations=int(acts + head), total_parameters=total)
    adapters = (L // pp) * lora_parameters(config, lora[0], lora[1], t)
    return RankMemory(parameters=largest, model_states=4 * largest + trained_bytes * adapters,
                      distributed_optimizer=int(4 * largest + (4 + 12 / dp) * adapters), reference=0,
                      activations=int(acts + head), total_parameters=total, adapter_parameters=adapters)
