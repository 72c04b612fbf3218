"""How a Megatron job splits its processes, checked against the world size and the model.

Pure Python (megatron-core is not imported): the verl entry point, the dry run and the memory
estimate use it without paying megatron's import.

Ranks are laid out as Megatron's ``order="tp-cp-ep-pp-dp"``: the ``tensor x context x pipeline``
ranks of one model replica are consecutive, and the replicas follow each other (data parallel
outermost). The Trainer's "group of consecutive ranks that trains on one batch" (the group it
already forms for sequence parallelism) is then exactly one model replica. Expert parallelism is
carved out of the data-parallel ranks, as in Megatron: the attention and dense layers are
replicated over ``data_parallel`` ranks that see different samples, the experts are split over
``expert`` of them and the tokens travel to their experts and back.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelLayout:
    """Parallel sizes of a Megatron run (verl's ``actor.megatron.*`` keys).

    Args:
        tensor: ranks that split each weight matrix (attention heads, MLP columns, vocabulary).
        pipeline: stages that split the decoder layers.
        context: ranks that split each sequence (Megatron's context parallelism; needs Transformer Engine).
        expert: ranks that split the experts of each MoE layer (taken from the data-parallel ranks).
        expert_tensor: ranks that split each expert's matrices (rlflow's conversion supports 1).
        virtual_pipeline: interleaved pipeline chunks per stage (not supported: see docs/megatron.md).
        sequence_parallel: Megatron's sequence parallelism with ``tensor > 1`` (needs the Transformer-Engine
            layer spec: the local spec's norms do not support it).
    """

    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1
    expert_tensor: int = 1
    virtual_pipeline: int | None = None
    sequence_parallel: bool = False

    def __post_init__(self):
        for name in ("tensor", "pipeline", "context", "expert", "expert_tensor"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelLayout.{name}={value!r}: must be an integer >= 1")
        if self.virtual_pipeline not in (None, 1):
            raise ValueError(f"virtual_pipeline={self.virtual_pipeline}: interleaved pipeline stages are not "
                             "supported (rlflow runs each micro-batch through the stages in order; docs/megatron.md)")
        if self.expert_tensor != 1:
            raise ValueError(f"expert_tensor={self.expert_tensor}: rlflow's weight conversion keeps each expert "
                             "whole on one rank (expert_tensor=1)")

    @property
    def model_parallel(self) -> int:
        """Ranks that hold one replica of the model (and train on one batch): tensor x context x pipeline."""
        return self.tensor * self.context * self.pipeline

    def data_parallel(self, world_size: int) -> int:
        """Model replicas: ``world_size / model_parallel``."""
        self.check_world(world_size)
        return world_size // self.model_parallel

    def check_world(self, world_size: int) -> None:
        if world_size % self.model_parallel:
            raise ValueError(f"{self.describe()} needs a multiple of {self.model_parallel} processes "
                             f"(tensor x context x pipeline), got {world_size}")
        dp = world_size // self.model_parallel
        if (dp * self.tensor * self.context) % (self.expert * self.expert_tensor):
            raise ValueError(f"expert parallel {self.expert} must divide data x tensor x context parallel "
                             f"{dp * self.tensor * self.context} (experts are split over data-parallel ranks)")

    def check_model(self, config) -> None:
        """The model's sizes split evenly: heads and key/value heads by ``tensor``, layers by ``pipeline``,
        experts by ``expert``. ``config`` is a Hugging Face config."""
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        layers, experts = config.num_hidden_layers, getattr(config, "num_experts", None) or 0
        problems = [f"{what} {n} not divisible by {size} ({why})" for what, n, size, why in (
            ("attention heads", heads, self.tensor, "tensor parallel"),
            ("key/value heads", kv, self.tensor, "tensor parallel"),
            ("layers", layers, self.pipeline, "pipeline parallel"),
            ("experts", experts, self.expert, "expert parallel"),
        ) if n % size]
        if self.expert > 1 and not experts:
            problems.append(f"expert parallel {self.expert} needs an MoE model ({config.model_type} has no experts)")
        if problems:
            raise ValueError(f"{self.describe()} does not fit {config.model_type}: " + "; ".join(problems))

    def describe(self, world_size: int | None = None) -> str:
        """E.g. ``TP 8 x PP 2 x DP 2 (32 processes)``."""
        parts = [f"TP {self.tensor}"] + [f"{k} {v}" for k, v in (("CP", self.context), ("PP", self.pipeline)) if v > 1]
        if world_size is not None and world_size % self.model_parallel == 0:
            parts.append(f"DP {world_size // self.model_parallel}")
        text = " x ".join(parts)
        if self.expert > 1:
            text += f", EP {self.expert}"
        if self.sequence_parallel:
            text += ", sequence parallel"
        return text + (f" ({world_size} processes)" if world_size is not None else "")
