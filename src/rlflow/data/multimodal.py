"""Vision-language prompts in verl's layout: an ``images`` column and ``<image>`` placeholders.

A row (parquet / json / in memory) holds its prompt (a string or chat messages) with one ``<image>``
placeholder per image, and a list of images under ``image_key`` (default ``images``). An image is
``{"bytes": ...}`` (what ``datasets`` writes for an ``Image`` column, and verl's geo3k preprocessing),
``{"path": ...}``, a path string, raw bytes or a PIL image. Relative paths are tried against the working
directory, then the data file's folder.

:func:`collate_multimodal` splits each message at the placeholders into verl's content parts
(``{"type": "image"}`` / ``{"type": "text", ...}``), renders them with the processor's chat template and
runs the processor on the text and the row's images (RGB): ``prompt_ids`` hold the expanded image-pad
tokens, and the row's processor tensors go into ``multi_modal_inputs`` (one dict per row: variable image
counts and sizes), its decoded images into ``multi_modal_data`` (``{"image": [...]}``, for engines that run
their own processor, e.g. vLLM). With ``image_patch_size`` (verl's ``data.image_patch_size``), each image is
first resized as verl's ``qwen_vl_utils.fetch_image`` does (:func:`patch_resize`), then the processor runs.

Bad images: :func:`check_images` decodes every image once when the data is loaded. A missing file,
undecodable bytes or a placeholder count that does not match the images raise a
:class:`~rlflow.data.rows.DataError` naming the file, the row and the image, or, with
``skip_bad_images=True``, drop the row and count it (``PromptData.skipped_images``).
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Sequence
from pathlib import Path

import torch
from tensordict import NonTensorStack, TensorDict

from rlflow.data import keys as K
from rlflow.data.nontensor import per_row  # noqa: F401  (it lived here: importable from here, as before)
from rlflow.data.rows import DataError, agent_name_column

PLACEHOLDER = "<image>"


# ---------------------------------------------------------------------------- images
def _search_dirs(name: str) -> list[Path]:
    dirs = [Path.cwd()]
    for part in name.split(" + "):
        if not part.startswith("<"):
            dirs.append(Path(part).expanduser().parent)
    return dirs


def load_image(ref, where: str, name: str = ""):
    """One image reference (see the module docstring) -> an RGB PIL image; a :class:`DataError` naming
    ``where`` (file, row, image) when it is missing or cannot be decoded."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(ref, Image.Image):
        return ref.convert("RGB")
    if isinstance(ref, dict):
        data, path = ref.get("bytes"), ref.get("path") or ref.get("image")
        if data is None and path is None:
            raise DataError(f"{where}: an image needs 'bytes' or 'path' (got keys {sorted(ref)})")
        ref = data if data is not None else path
    if isinstance(ref, (bytes, bytearray, memoryview)):
        source, label = io.BytesIO(bytes(ref)), f"{len(ref)} bytes"
    elif isinstance(ref, (str, Path)):
        text = str(ref).removeprefix("file://")
        candidates = [Path(text).expanduser()] if Path(text).is_absolute() else [d / text for d in _search_dirs(name)]
        found = next((p for p in candidates if p.is_file()), None)
        if found is None:
            raise DataError(f"{where}: image file not found: {text}")
        source, label = found, str(found)
    else:
        raise DataError(f"{where}: an image must be bytes, a path, a {{'bytes'|'path': ...}} dict or a PIL image, "
                          f"got {type(ref).__name__}")
    try:
        with Image.open(source) as image:
            return image.convert("RGB")  # decodes now: a truncated file fails here, not in the processor
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise DataError(f"{where}: cannot decode image ({label}): {e}") from e


def image_refs(row: dict) -> list:
    """The row's image references (``[]`` when it has none)."""
    refs = row.get("images")
    if refs is None:
        return []
    return list(refs) if isinstance(refs, (list, tuple)) else [refs]


def _placeholders(prompt) -> int:
    texts = [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]
    return sum(t.count(PLACEHOLDER) for t in texts)


def check_images(rows: list[dict], name: str, skip: bool = False) -> tuple[list[dict], int]:
    """Decode every image of ``rows`` once; returns the rows kept and how many were skipped.

    A row fails (:class:`DataError` naming ``name``, the row and the image) or, with ``skip``, is dropped
    and counted, when an image is missing or corrupt, when its ``<image>`` placeholders do not match its
    images, or when it holds videos (not supported yet).
    """
    kept, skipped = [], 0
    for row in rows:
        where = f"{name}, row {row['index']}"
        try:
            if row.get("videos"):
                raise DataError(f"{where}: video inputs are not supported yet")
            refs = image_refs(row)
            if _placeholders(row["prompt"]) != len(refs):
                raise DataError(f"{where}: {len(refs)} image(s) but {_placeholders(row['prompt'])} "
                                  f"'{PLACEHOLDER}' placeholder(s) in the prompt (one per image, in order)")
            for j, ref in enumerate(refs):
                load_image(ref, f"{where}, image {j}", name)
        except DataError:
            if not skip:
                raise
            skipped += 1
            continue
        kept.append(row)
    return kept, skipped


# ---------------------------------------------------------------------------- prompts
def messages_with_images(prompt) -> list[dict]:
    """Chat messages whose ``<image>`` placeholders became content parts (verl's ``_build_messages``)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    out = []
    for m in messages:
        parts = [{"type": "image"} if seg == PLACEHOLDER else {"type": "text", "text": seg}
                 for seg in re.split(f"({re.escape(PLACEHOLDER)})", m["content"]) if seg]
        out.append({"role": m["role"], "content": parts})
    return out


# qwen_vl_utils' bounds for one image, in merged tokens (verl resizes with them before the processor runs)
MIN_IMAGE_TOKENS, MAX_IMAGE_TOKENS, MAX_ASPECT_RATIO = 4, 16384, 200


def patch_size_dims(height: int, width: int, patch_size: int, merge: int = 2) -> tuple[int, int]:
    """``(height, width)`` rounded to multiples of ``patch_size x merge`` pixels and kept within
    ``[4, 16384]`` merged tokens (``qwen_vl_utils.smart_resize``, which verl calls with
    ``factor = 2 x data.image_patch_size``)."""
    factor = patch_size * merge
    low, high = MIN_IMAGE_TOKENS * factor ** 2, MAX_IMAGE_TOKENS * factor ** 2
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image of {width}x{height} pixels: aspect ratio over {MAX_ASPECT_RATIO}")
    h, w = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
    if h * w > high:
        beta = math.sqrt(height * width / high)
        h, w = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h * w < low:
        beta = math.sqrt(low / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def patch_resize(image, patch_size: int | None):
    """``image`` (RGB PIL) resized to :func:`patch_size_dims` (PIL's default filter, as qwen_vl_utils);
    ``patch_size=None``: unchanged."""
    if patch_size is None:
        return image
    h, w = patch_size_dims(image.height, image.width, patch_size)
    return image if (h, w) == (image.height, image.width) else image.resize((w, h))


def process_row(row: dict, processor, name: str, template_kwargs: dict | None = None,
                patch_size: int | None = None, processor_kwargs: dict | None = None
                ) -> tuple[str, list[int], dict, list]:
    """``(rendered text, prompt ids, processor tensors, images)`` of one row; ``template_kwargs``: more
    ``apply_chat_template`` arguments; ``patch_size``: resize the images first (:func:`patch_resize`);
    ``processor_kwargs`` go to the processor's call (verl's ``data.mm_processor_kwargs``)."""
    where = f"{name}, row {row['index']}"
    images = [load_image(ref, f"{where}, image {j}", name) for j, ref in enumerate(image_refs(row))]
    try:
        images = [patch_resize(image, patch_size) for image in images]
    except ValueError as e:
        raise DataError(f"{where}: {e}") from e
    text = processor.apply_chat_template(messages_with_images(row["prompt"]), add_generation_prompt=True,
                                         tokenize=False, **(template_kwargs or {}))
    try:
        out = processor(text=[text], images=images or None, return_tensors="pt", **(processor_kwargs or {}))
    except Exception as e:  # the processor's own message, with the row it came from
        raise DataError(f"{where}: the processor failed: {e}") from e
    ids = out["input_ids"][0][out["attention_mask"][0].bool()].tolist()
    tensors = {k: v for k, v in out.items() if images and k in ("pixel_values", "image_grid_thw")}
    return text, ids, tensors, images


def prompt_length(row: dict, processor, name: str = "", template_kwargs: dict | None = None,
                  patch_size: int | None = None, processor_kwargs: dict | None = None) -> int:
    """Tokens of the row's prompt after the chat template, image-pad tokens included."""
    return len(process_row(row, processor, name, template_kwargs, patch_size, processor_kwargs)[1])


def collate_multimodal(rows: Sequence[dict], processor, max_prompt_length: int | None = None,
                       name: str = "", template_kwargs: dict | None = None,
                       patch_size: int | None = None, processor_kwargs: dict | None = None) -> TensorDict:
    """Process rows into a batch: left-padded ``prompt_ids``/``prompt_mask`` with the image-pad tokens, the
    non-tensor fields, and per row ``multi_modal_inputs`` and ``multi_modal_data`` (module docstring).

    A prompt longer than ``max_prompt_length`` raises: cutting it could cut image tokens (filter such
    prompts with ``filter_overlong_prompts``).
    """
    texts, ids, inputs, data = [], [], [], []
    for row in rows:
        text, seq, tensors, images = process_row(row, processor, name, template_kwargs, patch_size, processor_kwargs)
        if max_prompt_length is not None and len(seq) > max_prompt_length:
            raise DataError(f"{name}, row {row['index']}: prompt has {len(seq)} tokens (image tokens included) > "
                              f"max_prompt_length={max_prompt_length}; vision-language prompts are not truncated "
                              "(it could cut image tokens): raise max_prompt_length, lower max_pixels or set "
                              "filter_overlong_prompts")
        texts.append(text)
        ids.append(seq)
        inputs.append(tensors)
        data.append({"image": images} if images else {})
    P = max(len(s) for s in ids)
    pad = processor.tokenizer.pad_token_id
    return TensorDict(
        {
            K.PROMPT_IDS: torch.tensor([[pad] * (P - len(s)) + s for s in ids], dtype=torch.long),
            K.PROMPT_MASK: torch.tensor([[0] * (P - len(s)) + [1] * len(s) for s in ids], dtype=torch.long),
            K.PROMPT_TEXT: NonTensorStack(*texts),
            K.RAW_PROMPT: NonTensorStack(*[r["prompt"] for r in rows]),  # with its <image> placeholders
            K.GROUND_TRUTH: NonTensorStack(*[r["ground_truth"] for r in rows]),
            K.DATA_SOURCE: NonTensorStack(*[r["data_source"] for r in rows]),
            K.EXTRA_INFO: NonTensorStack(*[r["extra_info"] for r in rows]),
            K.MULTI_MODAL_INPUTS: NonTensorStack(*inputs),
            K.MULTI_MODAL_DATA: NonTensorStack(*data),
            **agent_name_column(rows),
        },
        batch_size=[len(rows)],
    )
