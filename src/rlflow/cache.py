"""Where rlflow keeps what it makes once and reuses: warm starts, converted models, downloaded wheels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$RLFLOW_CACHE``, else ``$XDG_CACHE_HOME/rlflow``, else ``~/.cache/rlflow`` (read at each call)."""
    root = os.environ.get("RLFLOW_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rlflow"
    return Path(root)
