"""Where a model path points: a local folder, or a Hugging Face hub id (downloaded as transformers does).

``Policy.from_pretrained`` and the config path both go through :func:`locate_model`:

- an existing folder is used as it is, whatever it looks like;
- a ``.gguf`` file is converted once to a Hugging Face folder in rlflow's cache (``rlflow.models.gguf``),
  which is used from then on;
- a path that cannot be a hub id (``./x``, ``../x``, ``/x``, ``~/x``, ``a/b/c``) is a local folder that
  does not exist: a clear error, never a download attempt;
- a hub id (``org/name``) is handed to transformers when the hub is reachable (it downloads, or
  revalidates its cache, exactly as ``from_pretrained`` always does). Offline (``HF_HUB_OFFLINE=1``,
  or no answer from the hub within a few seconds) it loads from the Hugging Face cache, or fails at
  once with one message saying how to fetch it (``hf download ORG/NAME``).

Imports nothing heavy (the config is checked with it before torch loads).
"""

from __future__ import annotations

import os
import re
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from rlflow.models.gguf import gguf_to_folder

__all__ = ["ModelNotFoundError", "Located", "locate_model", "looks_like_hub_id", "hub_offline_reason"]

# A hub id: "name" or "org/name" (letters, digits, - _ .), not starting with "." or "-".
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")
PROBE_TIMEOUT_S = 3.0


class ModelNotFoundError(FileNotFoundError):
    """A model path that is neither a local folder nor a hub model that can be loaded now."""


@dataclass(frozen=True)
class Located:
    """``path``: what to pass to transformers; ``folder``: a local folder holding it, when there is one."""

    path: str
    folder: Path | None
    source: str  # "local", "gguf" (converted), "cache" (offline, from the Hugging Face cache) or "hub" (downloads)


def looks_like_hub_id(path: str) -> bool:
    """``Qwen/Qwen2.5-0.5B-Instruct`` or ``gpt2``; not ``./m``, ``../m``, ``/m``, ``~/m`` or ``a/b/c``."""
    return bool(_HUB_ID.match(path)) and ".." not in path and not path.endswith((".py", ".json", ".yaml"))


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def hub_offline_reason() -> str | None:
    """Why the hub cannot be used now (offline mode set, or no answer within a few seconds); ``None`` if it can.

    The probe goes through urllib, which honours the ``HTTPS_PROXY``/``NO_PROXY`` variables as the hub
    client does; any HTTP answer (even an error status) means the hub is reachable.
    """
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if _truthy(name):
            return f"{name}={os.environ[name]} is set"
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=PROBE_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        return f"{endpoint} did not answer within {PROBE_TIMEOUT_S:.0f} s ({reason})"
    return None


def cached_folder(repo_id: str) -> Path | None:
    """The newest cached snapshot of ``repo_id`` holding a ``config.json``, if any."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    cache = os.environ.get("HF_HUB_CACHE") or (os.environ.get("HF_HOME") and os.path.join(os.environ["HF_HOME"], "hub"))
    found = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache or None)  # env read now, not at import
    return Path(found).parent if isinstance(found, str) else None


def locate_model(path: str | os.PathLike, key: str = "model path") -> Located:
    """Resolve a model path as described in the module docstring; raises :class:`ModelNotFoundError`."""
    text = str(path)
    local = Path(text).expanduser()
    if local.is_dir():
        return Located(str(local), local, "local")
    if local.is_file() and local.suffix == ".gguf":  # converted once to a cached folder that every path reads
        folder = gguf_to_folder(local)
        return Located(str(folder), folder, "gguf")
    if local.exists():
        raise ModelNotFoundError(f"{key}={text!r}: {local} is a file; a model is a folder with config.json and weights")
    if not looks_like_hub_id(text):
        raise ModelNotFoundError(f"{key}={text!r}: no such folder {local.resolve()}")
    cached = cached_folder(text)
    offline = hub_offline_reason()
    if offline is None:
        return Located(text, None, "hub")
    if cached is not None:
        return Located(str(cached), cached, "cache")
    raise ModelNotFoundError(
        f"{key}={text!r}: no local folder {local.resolve()}, and the hub model '{text}' is not in the Hugging Face "
        f"cache, and the hub cannot be reached ({offline}). Fetch it where there is network with `hf download "
        f"{text}` (into the cache; or add --local-dir DIR and use DIR), or give the path of a local model folder.")
