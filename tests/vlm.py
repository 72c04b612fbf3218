"""Shared builders for the vision-language tests: a tiny VLM, its processor, and rows in verl's layout."""

import io

import torch

from rlflow.data.prompts import PromptData
from rlflow.models.tiny_vlm import tiny_processor, tiny_qwen2_5_vl, tiny_qwen2_vl

MAKERS = {"qwen2_5_vl": tiny_qwen2_5_vl, "qwen2_vl": tiny_qwen2_vl}


def png(width: int, height: int, colour=(255, 0, 0)) -> bytes:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), (255, 255, 255))
    ImageDraw.Draw(image).rectangle((4, 4, width // 2, height // 2), fill=colour)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def rows() -> list[dict]:
    """Variable image counts and sizes: one image, two images of different sizes, none (text only), one wide."""
    return [
        {"prompt": "<image>how many red squares?", "images": [{"bytes": png(112, 84)}], "ground_truth": "1"},
        {"prompt": [{"role": "user", "content": "a <image> b <image> c?"}],
         "images": [{"bytes": png(56, 56, (0, 255, 0))}, {"bytes": png(84, 112, (0, 0, 255))}], "ground_truth": "2"},
        {"prompt": "no picture: 3+4?", "ground_truth": "7"},
        {"prompt": "<image>and this one?", "images": [{"bytes": png(168, 56, (9, 9, 9))}], "ground_truth": "0"},
    ]


def tiny_vlm(kind: str = "qwen2_5_vl", seed: int = 0, **sizes):
    """``(model, processor)``: a tiny random VLM of ``kind`` and its processor."""
    processor = tiny_processor()
    return MAKERS[kind](processor.tokenizer, seed=seed, **sizes), processor


def batch(processor, rows_=None):
    data = PromptData(rows_ or rows(), processor=processor, shuffle=False)
    return data.collate(data.train, processor.tokenizer)


def masked_max_diff(a, b, mask) -> float:
    return (a - b)[mask.bool()].abs().max().item()


__all__ = ["png", "rows", "tiny_vlm", "batch", "masked_max_diff", "torch"]
