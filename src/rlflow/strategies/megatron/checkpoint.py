"""Deprecated: this module is now :mod:`rlflow.strategies.megatron.sharded_checkpoint` (Megatron's training checkpoints)."""

from __future__ import annotations

import warnings

from rlflow.strategies.megatron.sharded_checkpoint import META_FILE, ShardedCheckpoint  # noqa: F401

warnings.warn("rlflow.strategies.megatron.checkpoint is now rlflow.strategies.megatron.sharded_checkpoint; import it "
              "from there", DeprecationWarning, stacklevel=2)
