"""verl's quantization-aware training keys -> ``Policy.from_pretrained(qat=...)`` (``rlflow.models.qat``).

verl declares the actor's QAT block three times: ``actor.qat`` (its actor config), ``actor.fsdp_config.qat``
(read by its FSDP engine) and ``actor.megatron.qat`` (its Megatron engine). Here any of them with ``enable=True``
turns QAT on; the enabled blocks must agree on ``mode``, ``group_size`` and ``ignore_patterns``. Training
fake-quantizes the policy's linear layers to NVFP4 (weights only, ``mode=w4a16``), and every rollout engine is
sent the quantized-dequantized weights, so generation samples from the policy being trained.
"""

from __future__ import annotations

from rlflow.config.verl.loading import ConfigError, NotSupportedError, VerlConfig
from rlflow.models.qat import MODES

A = "actor_rollout_ref.actor"
BLOCKS = (f"{A}.qat", f"{A}.fsdp_config.qat", f"{A}.megatron.qat")
SETTINGS = ("mode", "group_size", "ignore_patterns")


def qat_argument(cfg: VerlConfig, notes: list[str], rollout_name: str) -> dict:
    """``{"qat": {...}}`` for ``Policy.from_pretrained`` when an actor QAT block is enabled, else ``{}``."""
    on = [b for b in BLOCKS if cfg[f"{b}.enable"]]
    if not on:
        return {}
    first = on[0]
    if cfg[f"{A}.strategy"] == "megatron":
        raise NotSupportedError(f"{first}.enable", True, "quantization-aware training under the Megatron strategy",
                                "verl fake-quantizes megatron-core's layers with NVIDIA ModelOpt; rlflow's QAT "
                                "(rlflow.models.qat) replaces transformers' nn.Linear layers: use strategy=fsdp.")
    if f"{A}.megatron.qat" in on:
        raise ConfigError(f"{A}.megatron.qat.enable=True: verl reads the megatron block under strategy=megatron "
                          f"only; with strategy={cfg[f'{A}.strategy']} set {A}.fsdp_config.qat.enable=True "
                          f"(or {A}.qat.enable=True)")
    settings = {b: {k: cfg[f"{b}.{k}"] for k in SETTINGS} for b in on}
    chosen = settings[first]
    for block, values in settings.items():
        for k in SETTINGS:
            if comparable(values[k]) != comparable(chosen[k]):
                raise ConfigError(f"{block}.{k}={values[k]!r} differs from {first}.{k}={chosen[k]!r}: both QAT "
                                  "blocks are enabled, so they must agree (or enable one)")
    mode, group_size, patterns = chosen["mode"], chosen["group_size"], chosen["ignore_patterns"]
    if mode == "w4a4":
        raise NotSupportedError(f"{first}.mode", mode, "QAT with 4-bit activations (w4a4)",
                                "verl calls it experimental (KL-divergence problems); use mode=w4a16.")
    if mode not in MODES:
        raise ConfigError(f"{first}.mode={mode!r}: unknown QAT mode; verl's are w4a16 (NVFP4 weights) and w4a4")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ConfigError(f"{first}.group_size={group_size!r}: must be a positive integer (NVFP4's is 16)")
    if patterns is not None and not all(isinstance(p, str) for p in list_of(patterns)):
        raise ConfigError(f"{first}.ignore_patterns={patterns!r}: must be a list of module-name patterns "
                          "('re:<regex>' or a substring)")
    M = "actor_rollout_ref.model"
    if cfg[f"{M}.lora_rank"] or cfg[f"{M}.lora_adapter_path"]:
        raise NotSupportedError(f"{first}.enable", True, "quantization-aware training with LoRA",
                                "the adapter's merged weights are not quantized; verl's QAT trains full weights.")
    where = ("vLLM runs them in 16 bits (no NVFP4 kernels: no speed-up)" if rollout_name == "VLLMRollout"
             else "it generates with them")
    notes.append(f"{first}.enable=True: quantization-aware training: the policy's linear layers compute with NVFP4 "
                 f"fake-quantized weights ({mode}, groups of {group_size}; ignored: {list_of(patterns)}), gradients "
                 f"pass straight through to the full-precision weights; the rollout engine is sent the "
                 f"quantized-dequantized weights and {where}; the reference is the unquantized model")
    return {"qat": {"mode": mode, "group_size": group_size, "ignore_patterns": list_of(patterns)}}


def comparable(value):
    """A setting as compared across blocks: a list of patterns (None: none), or the value."""
    return list_of(value) if value is None or isinstance(value, (list, tuple)) else value


def list_of(value) -> list:
    return [] if value is None else [value] if isinstance(value, str) else list(value)
