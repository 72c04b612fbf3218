"""verl's quantization-aware training keys -> ``Policy`` / ``Critic.from_pretrained(qat=...)`` (``rlflow.models.qat``).

verl declares the actor's QAT block three times: ``actor.qat`` (its ``ActorConfig``; no engine of verl 1dda039
reads it), ``actor.fsdp_config.qat`` (what its FSDP engine reads) and ``actor.megatron.qat`` (its Megatron engine's).
Here ``actor.qat`` and ``actor.fsdp_config.qat`` both turn QAT on under FSDP (the enabled blocks must agree on
``mode``, ``group_size`` and ``ignore_patterns``); the Megatron block is refused, with the reason. Training
fake-quantizes the policy's linear layers to NVFP4 (weights only, ``mode=w4a16``), and every rollout engine is
sent the quantized-dequantized weights, so generation samples from the policy being trained. The critic's blocks
(``critic.fsdp.qat``, ``critic.megatron.qat``) quantize the critic the same way, as verl's critic engine does.
"""

from __future__ import annotations

from rlflow.config.verl.loading import ConfigError, NotSupportedError, VerlConfig
from rlflow.models.qat import MODES

A, C = "actor_rollout_ref.actor", "critic"
BLOCKS = {A: (f"{A}.qat", f"{A}.fsdp_config.qat", f"{A}.megatron.qat"), C: (f"{C}.fsdp.qat", f"{C}.megatron.qat")}
MODELS = {A: "actor_rollout_ref.model", C: "critic.model"}
SETTINGS = ("mode", "group_size", "ignore_patterns")


def qat_argument(cfg: VerlConfig, notes: list[str], role: str = A, rollout_name: str = "") -> dict:
    """``{"qat": {...}}`` for ``Policy.from_pretrained`` (``role`` the actor) or ``Critic.from_pretrained``
    (``role="critic"``) when one of the role's QAT blocks is enabled, else ``{}``."""
    blocks = BLOCKS[role]
    on = [b for b in blocks if cfg[f"{b}.enable"]]
    if not on:
        return {}
    first, megatron_block, strategy = on[0], blocks[-1], cfg[f"{role}.strategy"]
    if strategy == "megatron":
        raise NotSupportedError(f"{first}.enable", True, "quantization-aware training under the Megatron strategy",
                                "verl fake-quantizes megatron-core's layers with NVIDIA ModelOpt; rlflow's QAT "
                                "(rlflow.models.qat) replaces transformers' nn.Linear layers: use strategy=fsdp.")
    if megatron_block in on:
        raise ConfigError(f"{megatron_block}.enable=True: verl reads the megatron block under strategy=megatron "
                          f"only; with strategy={strategy} set " + " or ".join(f"{b}.enable=True" for b in blocks[:-1]))
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
    if cfg[f"{MODELS[role]}.lora_rank"] or cfg[f"{MODELS[role]}.lora_adapter_path"]:
        raise NotSupportedError(f"{first}.enable", True, "quantization-aware training with LoRA",
                                "the adapter's merged weights are not quantized; verl's QAT trains full weights.")
    what = ("the critic's linear layers (its value head too, under the name value_head)" if role == C
            else "the policy's linear layers")
    engine = ("vLLM runs them in its own dtype, 16-bit on GPUs (no NVFP4 kernels: no speed-up)"
              if rollout_name == "VLLMRollout" else "generates with them")
    where = ("" if role == C else f"; the rollout engine is sent the quantized-dequantized weights and {engine}; "
             "the reference is the unquantized model")
    notes.append(f"{first}.enable=True: quantization-aware training: {what} compute with NVFP4 fake-quantized weights "
                 f"({mode}, groups of {group_size}; ignored: {list_of(patterns)}), gradients pass straight through "
                 f"to the full-precision weights{where}")
    return {"qat": {"mode": mode, "group_size": group_size, "ignore_patterns": list_of(patterns)}}


def comparable(value):
    """A setting as compared across blocks: a list of patterns (None: none), or the value."""
    return list_of(value) if value is None or isinstance(value, (list, tuple)) else value


def list_of(value) -> list:
    return [] if value is None else [value] if isinstance(value, str) else list(value)
