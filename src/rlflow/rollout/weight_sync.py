"""Weight sync from training weights to a generation engine's copy: what is sent, and copying it in.

The buckets themselves (size-bounded ``(name, tensor)`` lists; FSDP2's sharded DTensors gathered bucket by
bucket, CPU-offloaded shards moved to a device the collective's backend serves) are :mod:`rlflow.weights`'s,
re-exported here under their old names. This module picks which weights go (:func:`update_buckets`: all of
them, or a LoRA policy's adapter or merged layers) and copies buckets into a model.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from rlflow.models.policy import lora_module
from rlflow.weights import (DEFAULT_BUCKET_BYTES, collective_device, full_weight_buckets,  # noqa: F401  (old home)
                            gather_full, gather_row_sharded, hf_weight_buckets, pick_device, tensor_buckets)


def update_buckets(trained: nn.Module, engine_model: nn.Module | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                   changed_only: bool = False) -> Iterator[list[tuple[str, Tensor]]]:
    """``trained``'s weights in the form the engine holds them, in buckets.

    A plain model: every parameter, tied ones under all their names (``hf_weight_buckets``). A LoRA policy
    (``rlflow.models.lora``): for an engine holding a PEFT copy (``engine_model`` is one), PEFT names, and
    with ``changed_only`` the adapter alone; for any other engine (a plain transformers copy, vLLM, ...), the
    merged weights ``W + s B A`` under Hugging Face names, and with ``changed_only`` those of the adapted
    layers alone. ``changed_only`` is for an engine that already holds this model's weights: the frozen
    base weights have not moved since.
    """
    lora = lora_module(trained)
    if lora is None:
        return hf_weight_buckets(trained, bucket_bytes)
    if lora.is_lora(engine_model):
        return lora.adapter_buckets(trained, bucket_bytes) if changed_only else hf_weight_buckets(trained, bucket_bytes)
    return lora.merged_weight_buckets(trained, bucket_bytes, only_adapted=changed_only)


@torch.no_grad()
def load_bucket(model: nn.Module, bucket: list[tuple[str, Tensor]]) -> None:
    """Copy one bucket into ``model``'s parameters (cast to their dtype and device; tied ones under any name)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, tensor in bucket:
        if name not in params:
            raise KeyError(f"weight sync: the engine's model has no parameter '{name}'")
        params[name].copy_(tensor)


def sync_weights(source: nn.Module, target: nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 changed_only: bool = False) -> dict[str, float]:
    """Copy ``source``'s weights into ``target`` bucket by bucket (:func:`update_buckets`); returns counts for the logs."""
    buckets = nbytes = 0
    for bucket in update_buckets(source, target, bucket_bytes, changed_only):
        load_bucket(target, bucket)
        buckets += 1
        nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
    return {"weight_sync/buckets": float(buckets), "weight_sync/gb": nbytes / 1e9}
