"""verl's model-loading and prompt-rendering keys -> the arguments of ``Policy.from_pretrained``,
``Critic.from_pretrained``, ``PromptData`` and a vLLM engine: ``*.model.trust_remote_code``,
``*.model.override_config``, ``data.trust_remote_code``, ``data.apply_chat_template_kwargs``,
``data.image_patch_size``, ``*.model.use_liger`` (Liger kernels, on CUDA GPUs). Only values are checked
here; the overrides meet the model's config when it loads (``rlflow.models.hf_config``), in the dry run too.
"""

from __future__ import annotations

from rlflow.config.verl.devices import Devices
from rlflow.config.verl.loading import ConfigError, NotSupportedError, VerlConfig
from rlflow.models.hf_config import ATTN, effective_overrides
from rlflow.models.liger import liger_missing

RESERVED_TEMPLATE_ARGS = ("conversation", "messages", "tokenize", "add_generation_prompt", "return_dict",
                          "return_tensors", "tools")


def chat_template_kwargs(cfg: VerlConfig) -> dict:
    """``data.apply_chat_template_kwargs``: more ``apply_chat_template`` arguments for every prompt rendering."""
    key = "data.apply_chat_template_kwargs"
    value = cfg[key]
    if not isinstance(value, dict):
        raise ConfigError(f"{key}={value!r}: must be a mapping of apply_chat_template arguments "
                          f"(e.g. +{key}.enable_thinking=false)")
    reserved = sorted(set(value) & set(RESERVED_TEMPLATE_ARGS))
    if reserved:
        raise ConfigError(f"{key}.{reserved[0]}: rlflow sets {', '.join(reserved)} itself when it renders prompts "
                          "(tools come from multi_turn.tool_config_path)")
    return dict(value)


def patch_size(cfg: VerlConfig) -> int | None:
    """``data.image_patch_size``; null: the processor's own patch size (build_data fills it in, as verl)."""
    value = cfg["data.image_patch_size"]
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(f"data.image_patch_size={value!r}: must be a positive number of pixels, or null for the "
                          "processor's own patch size")
    return value


def model_loading(cfg: VerlConfig, role: str) -> dict:
    """``<role>.model.trust_remote_code`` / ``override_config`` -> ``from_pretrained`` arguments (only those set);
    for the policy, ``data.trust_remote_code`` alone trusts its tokenizer / processor."""
    key = f"{role}.model.override_config"
    overrides = cfg[key]
    if not isinstance(overrides, dict):
        raise ConfigError(f"{key}={overrides!r}: must be a mapping of model config entries "
                          f"(e.g. +{key}.attention_dropout=0.1)")
    out = {"trust_remote_code": True} if cfg[f"{role}.model.trust_remote_code"] else {}
    if role == "actor_rollout_ref" and cfg["data.trust_remote_code"] and not out:
        out["tokenizer_trust_remote_code"] = True  # the data is tokenized with the policy's tokenizer
    return out | ({"override_config": dict(overrides)} if overrides else {})


def engine_loading(rollout_kwargs: dict, loading: dict) -> None:
    """A vLLM engine loads the policy's folder itself: it gets ``trust_remote_code`` and the config overrides
    (vLLM's ``hf_overrides``; ``attn_implementation`` is transformers', not vLLM's)."""
    extra = dict(rollout_kwargs.get("engine_kwargs") or {})
    if loading.get("trust_remote_code"):
        extra["trust_remote_code"] = True
    overrides = {k: v for k, v in effective_overrides(loading.get("override_config")).items() if k != ATTN}
    if overrides:
        extra["hf_overrides"] = overrides
    if extra:
        rollout_kwargs["engine_kwargs"] = extra


def liger(cfg: VerlConfig, devices: Devices, role: str) -> dict:
    """``<role>.model.use_liger`` -> ``from_pretrained(use_liger=True)`` (``rlflow.models.liger``) where Liger's
    kernels can run: a transformers model (fsdp/fsdp2) on CUDA GPUs, with liger-kernel installed."""
    key = f"{role}.model.use_liger"
    if not cfg[key]:
        return {}
    strategy = cfg["actor_rollout_ref.actor.strategy" if role == "actor_rollout_ref" else f"{role}.strategy"]
    if strategy == "megatron":
        raise NotSupportedError(key, True, "Liger kernels under the Megatron strategy",
                                "liger-kernel patches transformers models; megatron-core builds its own layers.")
    if devices.accelerator != "cuda":
        raise NotSupportedError(key, True, "Liger kernels without a CUDA GPU (liger-kernel's Triton kernels run on "
                                "CUDA GPUs; this run is on CPU)")
    missing = liger_missing(need_cuda=False)
    if missing is not None:
        raise ConfigError(f"{key}=True: {missing}")
    return {"use_liger": True}
