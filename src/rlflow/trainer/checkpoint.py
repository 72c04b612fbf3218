"""Deprecated: this module is now :mod:`rlflow.trainer.training_state` (the training state's checkpoints: save,
load, resume; ``checkpoint`` named three different things)."""

from __future__ import annotations

import warnings

from rlflow.trainer.training_state import *  # noqa: F403
from rlflow.trainer.training_state import CheckpointError, latest_checkpoint, load, resume, save  # noqa: F401

warnings.warn("rlflow.trainer.checkpoint is now rlflow.trainer.training_state; import it from there",
              DeprecationWarning, stacklevel=2)
