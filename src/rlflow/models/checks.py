"""Checks of a local model folder and of a tokenizer against its model, before anything is trained.

Each failure is a :class:`ModelFolderError` whose message names the folder (or file) and what is
wrong with it, instead of an error from deep inside transformers after the weights have loaded.
Only the standard library is imported here: the checks run before torch or transformers load.
"""

from __future__ import annotations

import contextlib

import json
import struct
from pathlib import Path

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


class ModelFolderError(ValueError):
    """A model folder or tokenizer that cannot be used; the message names it."""


def _listing(folder: Path) -> str:
    names = sorted(p.name for p in folder.iterdir())
    return ", ".join(names[:10]) + (" ..." if len(names) > 10 else "") if names else "nothing"


def check_safetensors(file: Path) -> None:
    """A ``.safetensors`` file's header parses and its tensors fit in the file (a download or copy cut short
    fails here, naming the file)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelFolderError(f"{file}: {size} bytes, not a safetensors file (truncated?)")
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise ModelFolderError(f"{file}: truncated (its header says {header_len} bytes, the file has {size})")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as e:
            raise ModelFolderError(f"{file}: damaged safetensors header ({e})") from None
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + end > size:
        raise ModelFolderError(f"{file}: truncated ({size} bytes, its tensors need {8 + header_len + end}); "
                               "download or copy it again")


def check_model_folder(path: str | Path, *, tokenizer: bool = True, weights: bool = True) -> Path:
    """A local Hugging Face model folder: ``config.json`` (valid JSON with a ``model_type``), with ``weights``
    the weights (every shard an index names; safetensors headers intact; a dry run, which reads only the
    config, skips them) and, with ``tokenizer``, tokenizer files. Returns the folder."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise ModelFolderError(f"model folder {folder} does not exist")
    if not folder.is_dir():
        raise ModelFolderError(f"{folder} is a file; a model is a folder with config.json, weights and a tokenizer")
    config = folder / "config.json"
    if not config.is_file():
        raise ModelFolderError(f"{folder}: no config.json, so not a Hugging Face model folder (it holds: "
                               f"{_listing(folder)})")
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (ValueError, AttributeError) as e:
        raise ModelFolderError(f"{config}: not valid JSON ({e})") from None
    if not model_type:
        raise ModelFolderError(f"{config}: no 'model_type', so transformers cannot tell which model it is")
    if weights:
        check_weights(folder)
    if tokenizer and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ModelFolderError(f"{folder}: no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...); save the "
                               "tokenizer there with tokenizer.save_pretrained(folder)")
    return folder


def check_weights(folder: Path) -> None:
    """Weights in ``folder``: a weights file or a sharded index whose shards are all there; safetensors intact."""
    found = [folder / name for name in WEIGHT_FILES if (folder / name).is_file()]
    if not found:
        raise ModelFolderError(f"{folder}: no weights ({', '.join(WEIGHT_FILES[:2])} or a sharded index); "
                               f"it holds: {_listing(folder)}")
    for index in (w for w in found if w.name.endswith(".index.json")):
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as e:
            raise ModelFolderError(f"{index}: not a valid weight index ({e!r})") from None
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise ModelFolderError(f"{index} names shard(s) not in the folder: {missing}")
        found += [folder / s for s in shards]
    for w in found:
        if w.suffix == ".safetensors":
            check_safetensors(w)


def check_tokenizer(tokenizer, model=None, source: str = "") -> None:
    """A tokenizer that can pad prompts (a pad token, or an eos token to use as one) and whose ids all fit the
    model's embedding table. ``source`` names it in messages."""
    name = source or getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    if tokenizer.pad_token is None and tokenizer.eos_token is None:
        raise ModelFolderError(f"tokenizer {name}: no pad token and no eos token, so prompts cannot be padded; "
                               "set tokenizer.pad_token (e.g. tokenizer.add_special_tokens({'pad_token': '<pad>'}) "
                               "and resize the model's embeddings)")
    embeddings = model.get_input_embeddings() if model is not None and hasattr(model, "get_input_embeddings") else None
    if embeddings is None:
        return
    rows = embeddings.num_embeddings
    # the base vocabulary and the special ids that padding and stopping use must index the embedding table
    # (added tokens past it are tolerated: some tokenizers add e.g. <|endoftext|> that no prompt contains)
    used = {"vocabulary size": tokenizer.vocab_size} | {
        f"{k} id": getattr(tokenizer, f"{k}_id") + 1 for k in ("pad_token", "eos_token", "bos_token")
        if getattr(tokenizer, f"{k}_id", None) is not None}
    too_big = {k: v for k, v in used.items() if v > rows}
    if too_big:
        what = ", ".join(f"{k} {v if k.startswith('vocab') else v - 1}" for k, v in too_big.items())
        raise ModelFolderError(f"tokenizer {name} does not fit the model: {what}, but the embedding table has "
                               f"{rows} rows (a tokenizer from another model? or call "
                               "model.resize_token_embeddings(len(tokenizer)))")


def activation_checkpointing(model) -> bool:
    """Whether a transformers model has gradient (activation) checkpointing on, without the deprecation warning
    of ``is_gradient_checkpointing`` (transformers >= 5.2x: ``is_activation_checkpointing``)."""
    on = getattr(model, "is_activation_checkpointing", None)
    return bool(on if on is not None else getattr(model, "is_gradient_checkpointing", False))


def enable_activation_checkpointing(model, checkpoint_kwargs: dict) -> None:
    """Turn on a transformers model's gradient (activation) checkpointing, ``checkpoint_kwargs`` going to
    ``torch.utils.checkpoint``, under the name the installed transformers has (``activation_checkpointing_enable``
    from 5.2x on; ``gradient_checkpointing_enable``, deprecated since, before)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=checkpoint_kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)


def offloaded_activations(on: bool):
    """``save_on_cpu`` while autograd records (an update's forward pass), else nothing: a scoring pass under
    no_grad saves no activations."""
    import torch  # here, not at the top: see the module docstring

    if not (on and torch.is_grad_enabled()):
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
