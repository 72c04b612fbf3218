"""Vision-language models under the Megatron strategy: the language model converted, the vision tower kept.

A Qwen2.5-VL or Qwen3.5 checkpoint (transformers' ``...ForConditionalGeneration``) is a vision tower (with its patch
merger) and a language model that the conversion covers (Qwen2.5-VL: a Qwen2 decoder; Qwen3.5 / Qwen3.5-MoE: the
Qwen3.5 text decoders of :mod:`.qwen3_5`). Under the strategy:

- the language model becomes megatron-core's ``GPTModel`` as a text model does (:func:`language_config` is the
  config it is built from: the checkpoint's ``text_config``, with the checkpoint's ``tie_word_embeddings``);
- the vision tower stays transformers' module, whole on every first-stage rank (tensor parallel 1 for it: each
  tensor-parallel rank runs it on the same images and gets the same gradient). Its features replace the token
  embeddings at the image-pad positions, and the result is the decoder's input (megatron-core's ``decoder_input``);
- the rotary angles are the model's multimodal ones (M-RoPE): the 3-D positions come from the Hugging Face model's
  ``get_rope_index`` over prompt + response (:func:`rlflow.models.vision.rope_position_ids`, as the transformers
  path), and the temporal / height / width frequency sections are recomposed by the model's own rotary module
  (Qwen2.5-VL: consecutive sections; Qwen3.5: interleaved), so the table equals transformers';
- the tower trains with the rest (its parameters are the module's, so the Trainer's optimizer holds them and the
  strategy reduces their gradients over the data-parallel replicas) unless ``freeze_vision_tower`` froze it;
- its weights keep transformers' names (``model.visual.*``; the language model's are ``model.language_model.*``) in
  checkpoints and in the weights sent to the generation engine (:mod:`.slots`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rlflow.models.vision import concat_inputs, has_images, multimodal_base, rope_position_ids, vision_tower

# vision-language model types whose language model the conversion covers -> that language model's type
LANGUAGE_MODELS = {"qwen2_5_vl": "qwen2_5_vl_text", "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
LANGUAGE_PREFIX = "model.language_model."  # transformers' names of the language model's weights in such a model
TOWER_PREFIX = "model.visual."


def is_vision_language(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def language_config(config):
    """The config the ``GPTModel`` is built from: ``config`` for a text model, a vision-language model's text config
    (with its ``tie_word_embeddings``, which transformers keeps on the outer config) for a VLM."""
    if not is_vision_language(config):
        return config
    if config.model_type not in LANGUAGE_MODELS:
        raise ValueError(f"the Megatron strategy converts the vision-language models {', '.join(LANGUAGE_MODELS)}; "
                         f"got model_type={config.model_type!r}")
    text = copy.deepcopy(config.text_config)
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    return text


def hf_name(name: str, vision_language: bool) -> str:
    """A text model's weight name (``model.layers.0...``) as the vision-language model names it."""
    return LANGUAGE_PREFIX + name.removeprefix("model.") if vision_language and name.startswith("model.") else name


@dataclass
class VisionBatch:
    """One batch's images in the decoder's layout (:mod:`.heads`: each row's real tokens first)."""

    positions: Tensor          # 3 x B' x S multimodal positions
    image_mask: Tensor         # B' x S: True on the image-pad tokens of the prompts
    inputs: dict[str, Tensor]  # the rows' processor outputs, concatenated (``pixel_values``, ``image_grid_thw``)


class VisionPart(nn.Module):
    """What a vision-language model adds to its converted language model: the tower (first pipeline stage only),
    the 3-D positions and the multimodal rotary angles.

    Args:
        hf_model: the Hugging Face ``...ForConditionalGeneration`` (its tower is copied; its ``get_rope_index`` and
            rotary module are used, and read no weights).
        first_stage: whether this rank embeds the tokens (and so runs the tower).
    """

    def __init__(self, hf_model: nn.Module, first_stage: bool):
        super().__init__()
        tower = vision_tower(hf_model)
        if tower is None:
            raise ValueError(f"{type(hf_model).__name__}: no vision tower found (get_encoder('image'))")
        self.tower = copy.deepcopy(tower) if first_stage else None
        self.image_token_id = hf_model.config.image_token_id
        self.merge = hf_model.config.vision_config.spatial_merge_size
        # not submodules: the Hugging Face model goes to the meta device after the conversion, and neither reads weights
        self._hf = [hf_model]
        self._recompose = hf_model.get_decoder().rotary_emb.recomposition_frequencies

    def batch(self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, rows: list[dict] | None,
              source: Tensor, shape: tuple[int, int]) -> VisionBatch:
        """The images and positions of a left-padded batch, moved to the decoder's layout: column ``source[i, j]`` of
        prompt + response at position ``j`` of row ``i`` (``>= P + R``: padding), padded to ``shape`` (B' x S)."""
        P, R = prompt_ids.shape[1], response_ids.shape[1]
        ids = torch.cat([prompt_ids, response_ids], 1)
        mask = torch.cat([prompt_mask, torch.ones_like(response_ids)], 1)
        inputs = concat_inputs(rows or [], ids.device)
        images = torch.cat([prompt_ids == self.image_token_id, torch.zeros_like(response_ids, dtype=torch.bool)], 1)
        grid = inputs.get("image_grid_thw")
        expected = 0 if grid is None else int(grid.prod(-1).sum()) // self.merge ** 2
        if expected != int(images.sum()):
            raise ValueError(f"{expected} image features for {int(images.sum())} image tokens: the rows' "
                             "multi_modal_inputs are missing or do not belong to these prompts")
        positions = rope_position_ids(self._hf[0], ids, mask, inputs, images)  # 3 x B x (P + R)
        past = source >= P + R
        column = source.clamp(max=P + R - 1)
        laid_positions = positions.gather(2, column[None].expand(3, *column.shape)).masked_fill(past[None], 0)
        laid_images = images.gather(1, column) & ~past
        B, S = source.shape
        full_positions = laid_positions.new_zeros(3, *shape)
        full_positions[:, :B, :S] = laid_positions
        full_images = laid_images.new_zeros(shape)
        full_images[:B, :S] = laid_images
        return VisionBatch(full_positions, full_images, inputs)

    def rotary(self, positions: Tensor, inv_freq: Tensor) -> Tensor:
        """``3 x B x S`` positions -> ``[S, B, 1, D]`` rotary angles (megatron-core's ``rotary_pos_emb`` layout)."""
        freqs = positions[..., None].float() * inv_freq  # 3 x B x S x D/2
        return self._recompose(freqs).transpose(0, 1)[:, :, None, :]  # the model's sections, halves repeated

    def embed(self, embeddings: Tensor, batch: VisionBatch) -> Tensor:
        """``[S, B, H]`` token embeddings with the tower's features written into the image-pad positions, in order."""
        if not has_images(batch.inputs):
            return embeddings
        pixels = batch.inputs["pixel_values"].to(next(self.tower.parameters()).dtype)
        features = self.tower(pixels, grid_thw=batch.inputs["image_grid_thw"]).pooler_output
        rows = embeddings.transpose(0, 1)
        mask = batch.image_mask[..., None]
        return rows.masked_scatter(mask, features.to(rows.dtype)).transpose(0, 1).contiguous()
