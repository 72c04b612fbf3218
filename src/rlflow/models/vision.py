"""Vision-language models: processors, per-row vision inputs, and the multimodal rotary positions.

A batch row of a vision-language prompt carries its processor outputs (``multi_modal_inputs``: for the
Qwen-VL family ``pixel_values`` ``[patches, C*T*P*P]`` and ``image_grid_thw`` ``[images, 3]``). A forward
pass over several rows concatenates them along dim 0 in row order (:func:`concat_inputs`), which is the
order the model scatters image features into the image-pad tokens of the flattened ``input_ids``.

Positions. Qwen2-VL / Qwen2.5-VL use 3-D rotary positions (``mrope``: temporal, height, width): text
tokens get the same index on the three axes, the tokens of an image get its grid coordinates, and the
text after an image continues from the largest index so far + 1. :func:`rope_position_ids` computes
them with the model's own ``get_rope_index`` — the function ``generate`` uses for the prompt — over the
whole prompt + response; generation continues the response from the same ``rope_deltas``, so the policy
scores every token at the position it was sampled at. Models without ``get_rope_index`` (LLaVA-style)
use the 1-D positions of the text path.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from torch import Tensor, nn


def is_multimodal(model: nn.Module) -> bool:
    """True for image-text-to-text models (their config has a ``vision_config``)."""
    return getattr(getattr(model, "config", None), "vision_config", None) is not None


def multimodal_base(lm: nn.Module) -> nn.Module:
    """The base model of an image-text-to-text model (``...ForConditionalGeneration.model``: vision tower,
    decoder, ``get_rope_index``), also under a PEFT wrapper (whose ``.model`` is the whole LM)."""
    return (lm.get_base_model() if hasattr(lm, "get_base_model") else lm).model


def vision_tower(lm: nn.Module) -> nn.Module | None:
    """The vision encoder of an image-text-to-text model (Qwen-VL's ``visual``, LLaVA's ``vision_tower``, ...,
    as transformers' ``get_encoder("image")`` finds it), also under a PEFT wrapper; ``None`` for a text model."""
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    if not is_multimodal(base) or not hasattr(base, "get_encoder"):
        return None
    tower = base.get_encoder(modality="image")
    return None if tower is base or tower is getattr(base, "model", None) else tower


def freeze_vision_tower(lm: nn.Module) -> int:
    """Stop training the vision tower of ``lm`` (verl's ``actor.freeze_vision_tower``: ``requires_grad_(False)``
    on it, LoRA adapters inside it included); returns how many parameters it froze."""
    tower = vision_tower(lm)
    if tower is None:
        raise ValueError(f"freeze_vision_tower: {type(lm).__name__} has no vision tower (not an image-text-to-text "
                         "model)")
    tower.requires_grad_(False)
    return sum(p.numel() for p in tower.parameters())


# ---------------------------------------------------------------------------- processors
def image_only_processor(cls: type) -> type:
    """``cls`` (a transformers processor class) usable without a video processor.

    transformers builds video processors with torchvision; without it, a Qwen-VL processor cannot be
    constructed at all, although images need only the PIL image processor. The returned subclass
    accepts ``video_processor=None`` (videos then fail inside the processor, images work) and keeps
    ``cls``'s name.
    """

    class ImageOnly(cls):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    ImageOnly.__name__ = ImageOnly.__qualname__ = cls.__name__
    return ImageOnly


def _has_torchvision() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchvision") is not None


def load_processor(path, min_pixels: int | None = None, max_pixels: int | None = None, *,
                   trust_remote_code: bool = False):
    """The processor of a local model folder, with the image size bounds overridden when given
    (``trust_remote_code``: transformers' switch for a folder's own processor code).

    With torchvision installed this is ``AutoProcessor.from_pretrained``; without it, the same processor
    class is built from ``AutoImageProcessor`` (which then falls back to the PIL image processor),
    ``AutoTokenizer`` and the folder's chat template, without a video processor.
    """
    import transformers
    from transformers import AutoConfig, AutoImageProcessor, AutoProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    sizes = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
    trust = {"trust_remote_code": trust_remote_code}
    if _has_torchvision():
        return AutoProcessor.from_pretrained(path, **sizes, **trust)
    model_type = AutoConfig.from_pretrained(path, **trust).model_type
    name = PROCESSOR_MAPPING_NAMES.get(model_type)
    if name is None:
        raise ValueError(f"{path}: no processor class known for model type '{model_type}'")
    tokenizer = AutoTokenizer.from_pretrained(path, **trust)
    template_file = Path(path) / "chat_template.jinja"
    template = template_file.read_text() if template_file.exists() else tokenizer.chat_template
    images = AutoImageProcessor.from_pretrained(path, **sizes, **trust)
    kwargs = {"video_processor": None} if "video_processor" in getattr(transformers, name).get_attributes() else {}
    return image_only_processor(getattr(transformers, name))(image_processor=images, tokenizer=tokenizer,
                                                             chat_template=template, **kwargs)


# ---------------------------------------------------------------------------- per-row inputs
def concat_inputs(rows, device=None) -> dict[str, Tensor]:
    """Per-row processor outputs (a list of dicts of tensors, ``{}`` for a row without images) -> one dict,
    each tensor concatenated along dim 0 in row order, on ``device``."""
    keys = sorted({k for row in rows if row for k in row})
    return {k: torch.cat([row[k] for row in rows if row and k in row]).to(device) for k in keys}


def _accepts(module: nn.Module, name: str) -> bool:
    """Whether the model's own ``forward`` takes ``name`` (a PEFT wrapper's takes ``**kwargs``: look inside)."""
    inner = module.get_base_model() if hasattr(module, "get_base_model") else module
    return name in inspect.signature(inner.forward).parameters


def image_token_mask(lm: nn.Module, prompt_ids: Tensor, response_len: int = 0) -> Tensor:
    """``B x (P + R)``: True on the prompt's image-pad tokens. A response token with the image-pad id (a
    sampler may draw one) is text: generation embedded it as a token, never as an image."""
    mask = prompt_ids == lm.config.image_token_id
    return torch.cat([mask, mask.new_zeros(mask.shape[0], response_len)], dim=1)


def generation_inputs(lm: nn.Module, input_ids: Tensor, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
    """What ``generate`` needs besides ids and mask: the vision inputs and, where the model asks for them,
    the token types (1 on image-pad tokens) it derives the 3-D positions from."""
    extra = dict(inputs)
    if inputs and _accepts(lm, "mm_token_type_ids"):
        extra["mm_token_type_ids"] = image_token_mask(lm, input_ids).long()
    return extra


def check_image_tokens(lm: nn.Module, inputs: dict[str, Tensor], image_mask: Tensor) -> None:
    """Raise unless the images of ``inputs`` fill exactly the ``image_mask`` tokens (``image_grid_thw``:
    ``t x h x w / merge**2`` tokens per image)."""
    tokens = int(image_mask.sum())
    grid = inputs.get("image_grid_thw")
    expected = 0 if grid is None else int(grid.prod(-1).sum()) // lm.config.vision_config.spatial_merge_size ** 2
    if (grid is not None or not has_images(inputs)) and expected != tokens:
        raise ValueError(f"{expected} image features for {tokens} image tokens: the rows' multi_modal_inputs are "
                         "missing or do not belong to these prompts")


def rope_position_ids(lm: nn.Module, input_ids: Tensor, attention_mask: Tensor, inputs: dict[str, Tensor],
                      image_mask: Tensor) -> Tensor:
    """Positions of ``input_ids`` (``B x L``) under ``attention_mask``: ``3 x B x L`` multimodal rotary
    positions when the model has ``get_rope_index`` (see the module docstring; ``image_mask`` marks the
    image tokens), else ``B x L`` (``cumsum(mask) - 1``, clamped at 0). Masked positions get 0."""
    base = multimodal_base(lm) if is_multimodal(lm) else None
    if base is not None and hasattr(base, "get_rope_index"):
        positions, _ = base.get_rope_index(input_ids=input_ids, mm_token_type_ids=image_mask.long(),
                                           image_grid_thw=inputs.get("image_grid_thw"), attention_mask=attention_mask)
        return positions
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def has_images(inputs: dict[str, Tensor]) -> bool:
    return bool(inputs) and any(v.numel() for v in inputs.values())


def image_features(lm: nn.Module, inputs: dict[str, Tensor]) -> Tensor:
    """The vision tower's features of every image in ``inputs``, one row per image token (``N x H``)."""
    pooled = multimodal_base(lm).get_image_features(**inputs, return_dict=True).pooler_output
    return torch.cat(list(pooled)) if isinstance(pooled, (list, tuple)) else pooled.reshape(-1, pooled.shape[-1])


def dummy_inputs(lm: nn.Module, device) -> dict[str, Tensor]:
    """One blank image of one merged token, in the Qwen-VL layout (``pixel_values``, ``image_grid_thw``)."""
    vc = lm.config.vision_config
    merge = vc.spatial_merge_size
    patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    return {"pixel_values": torch.zeros(merge * merge, patch_dim, device=device),
            "image_grid_thw": torch.tensor([[1, merge, merge]], device=device)}


def _several_processes() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def multimodal_hidden_states(lm: nn.Module, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor,
                             inputs: dict[str, Tensor], image_mask: Tensor) -> Tensor:
    """The multimodal base model's last hidden states (``B x L x H``): token embeddings with the image
    features written into the ``image_mask`` tokens (in order), then the decoder at ``position_ids``.

    With several processes, a pass without any image runs the vision tower on a blank image and adds
    0 x its output: under FSDP2 each vision block is a sharded unit whose forward all-gathers its
    parameters, and a rank that skipped them would leave the others waiting (the zero term also gives
    the tower a zero gradient instead of none, which DDP needs). verl does the same.
    """
    base = multimodal_base(lm)
    embeds = base.get_input_embeddings()(input_ids)
    tokens = int(image_mask.sum())
    if has_images(inputs) or tokens:
        features = image_features(lm, inputs).to(embeds.dtype) if has_images(inputs) else embeds[:0, 0]
        if features.shape[0] != tokens:
            raise ValueError(f"{features.shape[0]} image features for {tokens} image tokens: the rows' "
                             "multi_modal_inputs are missing or do not belong to these prompts")
        embeds = embeds.masked_scatter(image_mask.unsqueeze(-1), features)
    elif _several_processes():
        embeds = embeds + 0.0 * image_features(lm, dummy_inputs(lm, embeds.device)).sum().to(embeds.dtype)
    out = base(input_ids=None, inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids,
               use_cache=False)
    return out.last_hidden_state


def padded_hidden_states(lm: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                         rows: list[dict] | None) -> Tensor:
    """Last hidden states over prompt + response (``B x (P + R) x H``), the response attending fully
    (as the text path does), at the 3-D positions of :func:`rope_position_ids`."""
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    mask = torch.cat([prompt_mask, torch.ones_like(response_ids)], dim=1)
    inputs = concat_inputs(rows or [], input_ids.device)
    images = image_token_mask(lm, prompt_ids, response_ids.shape[1])
    check_image_tokens(lm, inputs, images)
    positions = rope_position_ids(lm, input_ids, mask, inputs, images)
    return multimodal_hidden_states(lm, input_ids, mask, positions, inputs, images)
