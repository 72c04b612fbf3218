"""A tiny vision-language model, its tokenizer and its processor, built in code: nothing is downloaded.

The model is a randomly initialised Qwen2.5-VL (or Qwen2-VL) of a few hundred thousand parameters;
the tokenizer is :func:`rlflow.models.tiny.char_tokenizer` with Qwen's vision and chat special tokens;
the processor is transformers' own Qwen2.5-VL processor around the PIL image processor
(``Qwen2VLImageProcessorPil``: the default ``Qwen2VLImageProcessor`` needs torchvision), so the
image -> ``pixel_values`` / ``image_grid_thw`` path is the one real checkpoints take.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlflow.models.tiny import DEFAULT_ALPHABET, char_tokenizer
from rlflow.models.vision import image_only_processor

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
VISION_ALPHABET = DEFAULT_ALPHABET + "\n.,"

#: Qwen's chat layout, short: ``<|im_start|>user\n{image}{text}<|im_end|>\n<|im_start|>assistant\n``.
#: Image parts become ``<|vision_start|><|image_pad|><|vision_end|>``; the processor expands the pad
#: to one token per merged patch.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def vision_tokenizer(alphabet: str = VISION_ALPHABET, words: tuple[str, ...] = ()):
    """The character tokenizer plus Qwen's vision and chat special tokens (each one token), ``words`` as
    tokens of their own (as a real vocabulary has common words), and the chat template."""
    tok = char_tokenizer(alphabet)
    tok.add_special_tokens({"additional_special_tokens": [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD,
                                                          IM_START, IM_END]})
    if words:
        tok.add_tokens(list(words))
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_processor(min_pixels: int = 56 * 56, max_pixels: int = 112 * 112, tokenizer=None):
    """A Qwen2.5-VL processor over the tiny tokenizer; images are resized into ``[min_pixels, max_pixels]``
    (multiples of 28 pixels: 14-pixel patches merged 2 x 2 into one token)."""
    from transformers import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    images = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)
    tokenizer = tokenizer or vision_tokenizer()
    return image_only_processor(Qwen2_5_VLProcessor)(image_processor=images, tokenizer=tokenizer,
                                                     video_processor=None, chat_template=CHAT_TEMPLATE)


def _vision_token_ids(tokenizer) -> dict[str, int]:
    ids = tokenizer.convert_tokens_to_ids([IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END])
    return dict(zip(("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"), ids))


def _text_config(tokenizer, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, max_positions,
                 section) -> dict:
    """The Qwen2 decoder of a tiny VLM, with 3-D rotary positions split ``section`` over (t, h, w)."""
    return dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
                num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                max_position_embeddings=max_positions, pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section})


def tiny_qwen2_5_vl(tokenizer, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                    intermediate_size: int = 128, vision_hidden_size: int = 32, vision_depth: int = 2,
                    vision_heads: int = 2, max_positions: int = 512, seed: int | None = None):
    """A randomly initialised Qwen2.5-VL: windowed vision blocks (the last one full attention), a 2 x 2
    patch merger, a Qwen2 decoder with 3-D multimodal rotary positions (``mrope_section`` over t, h, w)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    head_dim = hidden_size // num_heads
    section = [head_dim // 8, head_dim // 8 + head_dim // 16, head_dim // 8 + head_dim // 16]  # sums to head_dim / 2
    section[0] += head_dim // 2 - sum(section)
    config = Qwen2_5_VLConfig(
        text_config=_text_config(tokenizer, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads,
                                 max_positions, section),
        vision_config=dict(depth=vision_depth, hidden_size=vision_hidden_size, intermediate_size=2 * vision_hidden_size,
                           num_heads=vision_heads, out_hidden_size=hidden_size, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, window_size=56, fullatt_block_indexes=[vision_depth - 1]),
        tie_word_embeddings=True, **_vision_token_ids(tokenizer),
    )
    if seed is not None:
        torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config)


def tiny_qwen2_vl(tokenizer, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                  intermediate_size: int = 128, vision_hidden_size: int = 32, vision_depth: int = 2,
                  vision_heads: int = 2, max_positions: int = 512, seed: int | None = None):
    """A randomly initialised Qwen2-VL (full-attention vision blocks), same sizes as :func:`tiny_qwen2_5_vl`."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    head_dim = hidden_size // num_heads
    section = [head_dim // 4, head_dim // 8, head_dim // 8]
    section[0] += head_dim // 2 - sum(section)
    config = Qwen2VLConfig(
        text_config=_text_config(tokenizer, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads,
                                 max_positions, section),
        vision_config=dict(depth=vision_depth, embed_dim=vision_hidden_size, hidden_size=hidden_size,
                           mlp_ratio=2, num_heads=vision_heads, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2),
        tie_word_embeddings=True, **_vision_token_ids(tokenizer),
    )
    if seed is not None:
        torch.manual_seed(seed)
    return Qwen2VLForConditionalGeneration(config)


def save_model_folder(model, processor, folder: str | Path) -> Path:
    """Write ``model`` and ``processor`` as a Hugging Face folder (config, weights, tokenizer, image processor,
    chat template) that :meth:`rlflow.models.policy.Policy.from_pretrained` and the verl entry point load."""
    folder = Path(folder)
    model.save_pretrained(folder)
    processor.tokenizer.save_pretrained(folder)
    processor.image_processor.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(processor.chat_template)
    return folder
