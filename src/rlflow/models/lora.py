"""LoRA on the policy, with PEFT: adapters, the adapter-disabled reference, trainable-only state, merged weights.

A LoRA policy is a ``peft.PeftModel``: every targeted ``nn.Linear`` holds its frozen base weight ``W``
(``out x in``) and two trainable factors ``A`` (``r x in``) and ``B`` (``out x r``, zero at the start).
Its forward computes ``x W^T + s * (x A^T) B^T`` with ``s = alpha / r`` (rsLoRA: ``alpha / sqrt(r)``).

What rlflow builds on that:

- **the reference for free**: the KL anchor is the same model with the adapter switched off
  (:class:`~rlflow.models.policy.AdapterDisabledReference`, PEFT's ``disable_adapter``), never a second copy of the weights;
- **trainable-only state**: :func:`keep_trainable_state_only` makes the policy module's ``state_dict``
  hold the adapter alone, so a checkpoint saves what changes (the base weights are the model folder's);
- **merged weights for generation engines**: :func:`merged_weight_buckets` yields ``W' = W + s B A``
  (DoRA: ``W' = m / ||W + s B A||_row * (W + s B A)``) under Hugging Face names, gathered from FSDP2
  shards bucket by bucket, so any engine that loads HF weights can generate with the adapter applied;
  :func:`adapter_buckets` yields the adapter alone, for an engine that keeps the adapter unmerged.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.tuners.lora import Linear as LoraLinear
from torch import Tensor, nn

from rlflow.weights import DEFAULT_BUCKET_BYTES, gather_full, tensor_buckets, tied_aliases

ADAPTER_DIR = "lora_adapter"  # a checkpoint's adapter config (verl's name)


def is_lora(model) -> bool:
    """True for a PEFT model (LoRA adapters on a transformers model)."""
    return isinstance(model, PeftModel)


def apply_lora(model: nn.Module, lora: LoraConfig | str | Path) -> PeftModel:
    """``model`` with LoRA adapters: new ones from a ``LoraConfig``, or an adapter folder loaded trainable.

    PEFT replaces the targeted layers of ``model`` in place; the returned ``PeftModel`` wraps it.
    """
    if isinstance(model, PeftModel):
        raise ValueError("the model already has adapters (a PeftModel): pass it without lora=")
    if isinstance(lora, LoraConfig):
        if lora.lora_dropout:
            warnings.warn(f"LoraConfig(lora_dropout={lora.lora_dropout}): dropout makes the policy's log-probs "
                          "random during updates, so the PPO ratio is not 1 on the first update; RL usually uses 0",
                          stacklevel=3)
        return get_peft_model(model, lora)
    if isinstance(lora, (str, Path)):
        folder = Path(lora).expanduser()
        if not (folder / "adapter_config.json").exists():
            raise FileNotFoundError(f"lora={str(lora)!r}: not an adapter folder (no adapter_config.json)")
        return PeftModel.from_pretrained(model, str(folder), is_trainable=True)
    raise TypeError(f"lora must be a peft.LoraConfig or an adapter folder, got {type(lora).__name__}")


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of every parameter that trains (with LoRA: the adapter's)."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def merged_copy(model: PeftModel) -> nn.Module:
    """A plain transformers model with the adapter merged in (PEFT's ``merge_and_unload`` on a copy)."""
    return copy.deepcopy(model).merge_and_unload()


# ---------------------------------------------------------------- what a checkpoint holds
def keep_trainable_state_only(module: nn.Module) -> None:
    """Make ``module.state_dict()`` hold its trainable parameters only, and ``load_state_dict`` accept that.

    With LoRA the trainable parameters are the adapter: a checkpoint then holds what training changes
    (with the optimizer, RNG and data position), not the frozen base weights. Works through Fabric's
    save/load on one device, DDP and FSDP2 (``torch.distributed.checkpoint`` asks the module for its
    state dict, so sharded checkpoints hold the adapter's shards only).
    """
    def trainable() -> set[str]:
        return {name for name, _ in trainable_parameters(module)}

    def drop_frozen(mod, state_dict, prefix, local_metadata):
        keep = {prefix + name for name in trainable()}
        for key in [k for k in state_dict if k not in keep]:
            del state_dict[key]

    def allow_missing_frozen(mod, incompatible):
        names = trainable()
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys
                                        if any(k == n or k.endswith("." + n) for n in names)]

    module.register_state_dict_post_hook(drop_frozen)
    module.register_load_state_dict_post_hook(allow_missing_frozen)


def save_adapter_config(model: PeftModel, folder: Path) -> None:
    """The adapter's ``adapter_config.json`` (rank, alpha, targets, base model) in ``folder``."""
    model.peft_config[model.active_adapter].save_pretrained(str(folder))


# ---------------------------------------------------------------- weights for generation engines
def hf_name(peft_name: str) -> str:
    """A PEFT parameter name -> the base model's Hugging Face name (``...q_proj.base_layer.weight`` -> ``...q_proj.weight``)."""
    name = peft_name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def adapter_buckets(model: PeftModel, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[list[tuple[str, Tensor]]]:
    """The trainable (adapter) parameters under their PEFT names, full tensors, in buckets."""
    return tensor_buckets(trainable_parameters(model), bucket_bytes)


def _lora_layers(model: PeftModel) -> dict[str, LoraLinear]:
    adapter = model.active_adapter
    tied = {alias for names in tied_aliases(model).values() for alias in names} | set(tied_aliases(model))
    layers = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
            continue
        if not isinstance(module, LoraLinear) or module.lora_bias[adapter] or (
                adapter in module.lora_variant and not module.use_dora[adapter]):
            raise NotImplementedError(f"merged-weight sync supports LoRA, rsLoRA and DoRA on Linear layers; {name} is "
                                      f"{type(module).__name__} with another variant or lora_bias")
        if f"{name}.base_layer.weight" in tied:
            raise NotImplementedError(f"merged-weight sync: {name}'s weight is tied to another parameter (an LM head "
                                      "tied to the embeddings); leave it out of target_modules")
        layers[name] = module
    return layers


def merged_linear_weight(layer: LoraLinear, adapter: str, weight: Tensor, lora_a: Tensor, lora_b: Tensor,
                         magnitude: Tensor | None = None) -> Tensor:
    """``W + s B A`` (``out x in``; transposed back for ``fan_in_fan_out`` layers), DoRA-rescaled when ``magnitude``.

    DoRA: ``m / ||W + s B A||`` per output row, times ``W + s B A`` (PEFT's ``merge``).
    """
    delta = (lora_b @ lora_a) * layer.scaling[adapter]
    w = weight.T if layer.fan_in_fan_out else weight
    merged = w + delta.to(w.dtype)
    if magnitude is not None:
        merged = (magnitude / torch.linalg.norm(merged, dim=1)).to(merged.dtype).unsqueeze(1) * merged
    return merged.T if layer.fan_in_fan_out else merged


@torch.no_grad()
def merged_weight_buckets(model: PeftModel, bucket_bytes: int = DEFAULT_BUCKET_BYTES, only_adapted: bool = False
                          ) -> Iterator[list[tuple[str, Tensor]]]:
    """The model's weights with the adapter merged, under Hugging Face names, in buckets of ``bucket_bytes``.

    Each LoRA layer's base weight comes out as :func:`merged_linear_weight`; its factors do not. With
    ``only_adapted`` only what training changes comes out (merged LoRA weights and other trainable
    parameters, e.g. ``modules_to_save``): after the first full copy, that is all an engine needs.
    FSDP2 shards are gathered bucket by bucket (one collective per bucket), as in ``full_weight_buckets``; a
    model whose weights a strategy holds elsewhere (the Megatron strategy's ``weight_buckets``) is merged there.
    """
    aliases = {hf_name(n): [hf_name(a) for a in more] for n, more in tied_aliases(model).items()}
    elsewhere = getattr(model, "weight_buckets", None)  # a strategy holds the weights (Megatron) and merges them
    if elsewhere is not None:
        for bucket in elsewhere(bucket_bytes, only_adapted=only_adapted):
            yield [pair for name, t in bucket for pair in [(name, t)] + [(a, t) for a in aliases.get(name, ())]]
        return
    adapter = model.active_adapter
    layers = _lora_layers(model)
    params = dict(model.named_parameters())
    items, size = [], 0  # (hf name, [(source name, param)], LoRA layer or None)
    for name, param in params.items():
        layer_name = _owner(name, layers)
        if ".original_module." in name or (layer_name and name[len(layer_name):].startswith(".lora_")):
            continue  # modules_to_save's untouched original; LoRA factors (inside the merged weight)
        if layer_name and name == f"{layer_name}.base_layer.weight":
            layer = layers[layer_name]
            sources = [name] + [f"{layer_name}.{part}.{adapter}.weight" for part in ("lora_A", "lora_B")]
            if layer.use_dora[adapter]:
                sources.append(f"{layer_name}.lora_magnitude_vector.{adapter}.weight")
            item = (hf_name(name), [(s, params[s]) for s in sources], layer)
        elif only_adapted and not param.requires_grad:
            continue
        else:
            item = (hf_name(name).replace(f".modules_to_save.{adapter}.", "."), [(name, param)], None)
        nbytes = param.numel() * param.element_size()
        if items and size + nbytes > bucket_bytes:
            yield _merged_bucket(items, adapter, aliases)
            items, size = [], 0
        items.append(item)
        size += nbytes
    if items:
        yield _merged_bucket(items, adapter, aliases)


def _owner(name: str, layers: dict) -> str | None:
    """The LoRA layer whose parameter ``name`` is (the longest module path prefix in ``layers``), if any."""
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in layers:
            return prefix
    return None


def _merged_bucket(items, adapter: str, aliases: dict[str, list[str]]) -> list[tuple[str, Tensor]]:
    """Gather a bucket's sources (one collective per mesh), merge, and add tied parameters' other names
    (an engine that reloads in place, vLLM, needs ``lm_head.weight`` besides the tied embeddings)."""
    flat = [pair for _, sources, _ in items for pair in sources]
    full = iter(t for _, t in gather_full(flat))
    out = []
    for name, sources, layer in items:
        tensors = [next(full) for _ in sources]
        tensor = merged_linear_weight(layer, adapter, *tensors) if layer is not None else tensors[0]
        out += [(name, tensor)] + [(alias, tensor) for alias in aliases.get(name, ())]
    return out
