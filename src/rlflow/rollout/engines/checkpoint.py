"""Deprecated: this module is now :mod:`rlflow.rollout.engines.weights_on_disk` (weight buckets written as a
Hugging Face folder for engines that load from disk)."""

from __future__ import annotations

import warnings

from rlflow.rollout.engines.weights_on_disk import *  # noqa: F403
from rlflow.rollout.engines.weights_on_disk import model_folder, shared_temp_dir, write_checkpoint  # noqa: F401

warnings.warn("rlflow.rollout.engines.checkpoint is now rlflow.rollout.engines.weights_on_disk; import it from "
              "there", DeprecationWarning, stacklevel=2)
