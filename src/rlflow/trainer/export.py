"""Deprecated: this module is now :mod:`rlflow.trainer.hf_export` (a checkpoint's policy as a Hugging Face folder)."""

from __future__ import annotations

import warnings

from rlflow.trainer.hf_export import *  # noqa: F403
from rlflow.trainer.hf_export import ExportError, export_hf, load_policy_state  # noqa: F401

warnings.warn("rlflow.trainer.export is now rlflow.trainer.hf_export; import it from there", DeprecationWarning,
              stacklevel=2)
