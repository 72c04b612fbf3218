"""VLLMRollout: the single-turn rollout sampling with an in-process vLLM engine: ``SingleTurnRollout(VLLMEngine(...))``
with the engine's options among its own."""

from __future__ import annotations

import importlib.util

from rlflow.rollout.engines.base import Engine
from rlflow.rollout.engines.vllm import INSTALL_HINT, VLLMEngine
from rlflow.rollout.single_turn import SingleTurnRollout
from rlflow.rollout.weight_sync import DEFAULT_BUCKET_BYTES


class VLLMRollout(SingleTurnRollout):
    """Turns prompts into ``n`` samples each with vLLM, in the trainer's process (colocated, as verl's hybrid
    engine).

    Same contract as :class:`~rlflow.rollout.hf.HFRollout` (left-padded prompts in; responses, mask, the
    sampler's log-probs, group ids and text out). ``bind(model, tokenizer)`` (the Trainer calls it) starts the
    engine from the model's config (one engine per model shape and options per process, shared by rollouts
    bound to models of that shape: ``VLLMEngine(shared=True)``) and loads the model's weights into it;
    ``sync_weights`` sends every update, gathered bucket by bucket (FSDP2 shards too), then resets vLLM's prefix
    cache. The engine holds its own weights, so the Trainer never copies a sharded model for it.

    Args:
        n, temperature, top_p, top_k, max_new_tokens, do_sample, seed, stop_token_ids, bucket_bytes: as ``HFRollout``.
        engine: an existing :class:`~rlflow.rollout.engines.vllm.VLLMEngine` to use instead of the shared one.
        dtype, max_model_len, kv_cache_memory_bytes, gpu_memory_utilization, enforce_eager: engine options.
        enable_prefix_caching, max_num_batched_tokens, max_num_seqs, enable_chunked_prefill: engine options.
        free_cache_engine: sleep between generations on GPU (all engine options: see ``VLLMEngine``).
        engine_seed: the engine's seed (its own random stream; the trainer's is untouched).
        weight_transfer: how updates reach the engine: ``"auto"`` (vLLM's weight-transfer protocol), a backend
            name, or ``"reload"`` (see ``VLLMEngine``).
        engine_kwargs: more ``vllm.LLM`` arguments.
        return_routed_experts: also write the MoE experts each token was routed to (``prompt_routed_experts``,
            ``routed_experts``, as ``HFRollout(return_routed_experts=True)``; verl's R3): CUDA GPUs only (vLLM's Model
            Runner V2), refused at once elsewhere.
        quantization: ``"fp8"``: sample from fp8 weights, as verl's ``rollout.quantization=fp8`` (vLLM quantizes
            every update; CUDA GPUs only, refused at once elsewhere; see ``VLLMEngine``).

    Raises:
        ImportError: at once when vLLM is not installed, with the install commands for CPU and GPU machines.
    """

    def __init__(self, n: int = 1, *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                 max_new_tokens: int = 512, do_sample: bool = True, seed: int | None = None,
                 stop_token_ids: tuple[int, ...] = (), bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 engine: Engine | None = None, dtype: str = "auto",
                 max_model_len: int | None = None, kv_cache_memory_bytes: int | None = None,
                 gpu_memory_utilization: float | None = None, enforce_eager: bool = False,
                 enable_prefix_caching: bool = True, max_num_batched_tokens: int | None = None,
                 max_num_seqs: int | None = None, enable_chunked_prefill: bool | None = None,
                 free_cache_engine: bool = True, engine_seed: int = 0, engine_kwargs: dict | None = None,
                 weight_transfer: str | None = "auto", return_routed_experts: bool = False,
                 quantization: str | None = None):
        if engine is None and importlib.util.find_spec("vllm") is None:
            raise ImportError(f"VLLMRollout needs vLLM, which is not installed: {INSTALL_HINT}")
        engine_kwargs = dict(engine_kwargs or {})
        if "quantization" in engine_kwargs:  # vLLM's own argument: one name either way
            if quantization is not None:
                raise ValueError(f"VLLMRollout: quantization={quantization!r} and engine_kwargs' quantization="
                                 f"{engine_kwargs['quantization']!r}: pass one of them")
            quantization = engine_kwargs.pop("quantization")
        engine = engine or VLLMEngine(
            dtype=dtype, max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_memory_bytes,
            gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching, max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs, enable_chunked_prefill=enable_chunked_prefill,
            free_cache_engine=free_cache_engine, seed=engine_seed, weight_transfer=weight_transfer, shared=True,
            return_routed_experts=return_routed_experts, quantization=quantization, **engine_kwargs)
        super().__init__(engine, n, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                         do_sample=do_sample, seed=seed, stop_token_ids=stop_token_ids,
                         return_routed_experts=return_routed_experts, bucket_bytes=bucket_bytes)
