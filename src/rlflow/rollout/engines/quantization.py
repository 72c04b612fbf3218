"""Quantized rollouts (verl's ``rollout.quantization``): vLLM samples from fp8 weights, the trainer keeps its own.

verl's ``quantization: fp8`` is DeepSeek-V3's block scheme: each linear layer's weight in float8 e4m3, one float32
scale per 128x128 block (the block's largest magnitude / 448), activations quantized on the fly per token in groups
of 128; embeddings, the LM head, norms and MoE routers (``mlp.gate``, ``ignored_layers`` in verl) stay in the
model's dtype. vLLM 0.32 has that scheme built in as an *online* quantization, ``quantization="fp8_per_block"``: it
loads 16-bit checkpoint weights and quantizes each linear layer once its weights have arrived. Its layerwise reload,
the path every rlflow weight update takes (``reload_weights``, and the weight-transfer engines'
``start_weight_update`` / ``finish_weight_update``: CUDA IPC, NCCL, ``rlflow_shm``), runs that quantization again
on every update, writing into the tensors the engine (and its CUDA graphs) already hold. So rlflow sends the
trainer's weights as they are and vLLM quantizes them: no second quantizer to keep in step with vLLM's kernels.
verl, written for vLLMs without that reload, quantizes on the trainer side and patches vLLM's
``Fp8LinearMethod.process_weights_after_loading`` instead; the numbers are the same (both scale by absmax / 448
per 128x128 block), rlflow moves 16-bit rather than 8-bit tensors to the engine.

vLLM's fp8 block kernels run on CUDA GPUs. Its CPU build (0.32) has fp8 matmuls only on CPUs with AMX tiles
(Sapphire Rapids or newer), keeping activations in 16 bits, a scheme rlflow has not run; without AMX it fails
while building the model ("Failed to find a kernel that can implement the ScaledMM linear layer"). rlflow
therefore refuses quantized rollouts without CUDA at once (:func:`quantization_unavailable`).
"""

from __future__ import annotations

import json

import torch

#: MoE routers stay in the model's dtype, as verl keeps them (its ``ignored_layers``: ``model.layers.N.mlp.gate``):
#: fnmatch patterns of vLLM's ``quantization_config.ignore``, which do not match ``mlp.gate_proj`` / ``gate_up_proj``.
ROUTERS_KEPT = ("*.mlp.gate",)

#: verl's ``rollout.quantization`` values rlflow rolls out -> the ``vllm.LLM`` arguments that give the same scheme.
QUANTIZATIONS = {"fp8": {"quantization": "fp8_per_block", "quantization_config": {"ignore": list(ROUTERS_KEPT)}}}

NEEDS_CUDA = ("quantized rollouts run on CUDA GPUs (vLLM's fp8 block kernels); {missing}. vLLM 0.32's CPU build "
              "has fp8 matmuls only on CPUs with AMX tiles (16-bit activations, a scheme rlflow has not run) and "
              "without them fails to build the model (no kernel for the ScaledMM linear layer)")


def vllm_arguments(quantization: str | None) -> dict:
    """The ``vllm.LLM`` arguments of a rollout quantization: :data:`QUANTIZATIONS` for rlflow's names (``"fp8"``),
    any other name as vLLM's own ``quantization=`` argument (``"fp8_per_tensor"``, or a pre-quantized checkpoint's
    method), nothing for ``None``."""
    if quantization is None:
        return {}
    if quantization not in QUANTIZATIONS:
        return {"quantization": quantization}
    return json.loads(json.dumps(QUANTIZATIONS[quantization]))  # a copy: vLLM may keep and change it


def quantization_unavailable() -> str | None:
    """Why this machine cannot roll out quantized weights (no CUDA GPU), or ``None`` where it can. Reads no vLLM
    module (importing vLLM changes the host process)."""
    if not torch.cuda.is_available():
        return NEEDS_CUDA.format(missing="this machine has no CUDA GPU") + ". Roll out in the model's dtype here"
    return None


def server_flags(quantization: str | None) -> list[str]:
    """The vLLM server's command-line flags for a rollout quantization (:func:`vllm_arguments`)."""
    options = vllm_arguments(quantization)
    flags = ["--quantization", options["quantization"]] if options else []
    return flags + (["--quantization-config", json.dumps(options["quantization_config"])]
                    if "quantization_config" in options else [])
