"""Weight buckets written as a Hugging Face checkpoint folder, for engines that read weights from disk.

vLLM starts from a folder (its loader initialises buffers, rotary caches and packed kernels correctly only
from real weights), and a server reloads from one (``reload_weights(weights_path=...)``,
SGLang's ``update_weights_from_disk``). One safetensors file per bucket, in Hugging Face naming; the
buckets come from :func:`rlflow.weights.full_weight_buckets`, so sharded (FSDP2) parameters
are gathered bucket by bucket and no process holds more than one bucket beyond its own shards.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path

import torch.distributed as dist

from rlflow.rollout.engines.base import WeightBuckets


def writes_checkpoints() -> bool:
    """One process per node writes (local rank 0); the others gather with it and then read its files."""
    return int(os.environ.get("LOCAL_RANK", "0")) == 0


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def shared_temp_dir(prefix: str) -> Path:
    """A new temporary folder with the same path on every process of a node (its local rank 0 creates it)."""
    token = [uuid.uuid4().hex[:12]]
    if distributed():
        dist.broadcast_object_list(token, src=0)
    path = Path(tempfile.gettempdir()) / f"{prefix}{token[0]}"
    if writes_checkpoints():
        path.mkdir(parents=True, exist_ok=True)
    barrier()
    return path


def barrier() -> None:
    if distributed():
        dist.barrier()


def write_checkpoint(buckets: WeightBuckets, folder: str | Path, config=None) -> dict[str, float]:
    """Write ``buckets`` (and ``config``) to ``folder`` as ``model-NNNNN.safetensors`` files, replacing any
    earlier weights there. Every process must call it (gathering sharded weights is collective); local rank 0
    writes, and all return after the files are complete. Returns ``weight_sync/buckets`` and ``weight_sync/gb``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    writer = writes_checkpoints()
    if writer:
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("*.safetensors*"):
            old.unlink()
        if config is not None:
            config.save_pretrained(folder)
    count, nbytes = 0, 0
    for count, bucket in enumerate(buckets, start=1):
        tensors, seen = {}, set()
        for name, t in bucket:  # a tied parameter under a second name is written again (safetensors shares nothing)
            tensors[name] = t.detach().to("cpu").clone() if id(t) in seen else t.detach().to("cpu").contiguous()
            nbytes += 0 if id(t) in seen else t.numel() * t.element_size()
            seen.add(id(t))
        if writer:
            save_file(tensors, str(folder / f"model-{count:05d}.safetensors"), metadata={"format": "pt"})
    barrier()
    return {"weight_sync/buckets": float(count), "weight_sync/gb": nbytes / 1e9}


def model_folder(model) -> Path | None:
    """The local folder a transformers model was loaded from, when it holds weights (``from_pretrained``)."""
    path = Path(str(getattr(model, "name_or_path", "") or "")).expanduser()
    if path.is_dir() and (path / "config.json").exists() and (any(path.glob("*.safetensors")) or any(path.glob("*.bin"))):
        return path
    return None
