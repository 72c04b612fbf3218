"""Deprecated: this module is now :mod:`rlflow.strategies.megatron.weight_buckets` (Megatron shards -> weight buckets)."""

from __future__ import annotations

import warnings

from rlflow.strategies.megatron.weight_buckets import DEFAULT_BUCKET_BYTES, WeightExporter, gather_full  # noqa: F401

warnings.warn("rlflow.strategies.megatron.export is now rlflow.strategies.megatron.weight_buckets; import it from "
              "there", DeprecationWarning, stacklevel=2)
