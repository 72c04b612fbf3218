"""``rlflow_gloo``: weights to a vLLM server on another machine, in buckets broadcast over a gloo group.

The second rlflow backend in vLLM's ``WeightTransferEngineFactory`` (beside ``rlflow_shm``, which needs the
trainer's shared memory and so its machine). It follows vLLM's NCCL engine, over TCP instead of NCCL:

- ``init_weight_transfer_engine`` sends ``master_address`` / ``master_port`` (an address of the trainer's
  machine that reaches the server, a free port there) and ``world_size`` (1 + the server's workers); the
  trainer (rank 0, the TCPStore's master) and each worker (rank 1 + its rank) then join one gloo process
  group, built on that store alone: neither side's default ``torch.distributed`` group (the trainer's FSDP
  group, the vLLM worker's own) is touched;
- each bucket is packed into one flat byte tensor (64-byte aligned, a tied tensor once) and its layout
  (names, dtypes, shapes, offsets) is the ``update_weights`` payload; the HTTP call only returns once the
  worker has received, so the trainer makes it from a thread while it broadcasts the bucket (vLLM's NCCL
  pattern), and an HTTP error ends the wait at once instead of leaving the broadcast to time out.

The worker side is ``rlflow_shm``'s engine (:mod:`rlflow.rollout.engines.weight_transfer`), which takes
either init info: a server started for shared memory also takes gloo, so the trainer can move to gloo when
the probe says the server is on another machine, without restarting it. This module imports no vLLM at
import time (the factory loads the trainer class by name, :func:`__getattr__`).
"""

from __future__ import annotations

import datetime
import functools
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

GLOO = "rlflow_gloo"
MODULE = "rlflow.rollout.engines.weight_transfer_gloo"
ALIGN = 64  # every tensor starts on a 64-byte boundary, so a uint8 view can be viewed as any dtype
TIMEOUT_S = 600.0  # a broadcast that waits longer than this has lost its receiver


def address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (what the server connects back to); no packet is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((socket.gethostbyname(host), 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def join(address: str, port: int, rank: int, world_size: int, timeout: float = TIMEOUT_S):
    """``(store, group)``: a gloo group of ``world_size`` over a TCPStore at ``address:port`` (rank 0 hosts
    it); blocks until every rank has joined. Keep the store alive as long as the group."""
    wait = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(address, port, world_size, is_master=rank == 0, wait_for_workers=False, timeout=wait)
    return store, dist.ProcessGroupGloo(dist.PrefixStore(GLOO, store), rank, world_size, wait)


def pack(bucket) -> tuple[torch.Tensor, dict]:
    """One bucket (``[(name, tensor), ...]``) -> a flat byte tensor and its layout (the update payload)."""
    where, nbytes = {}, 0
    for _, t in bucket:  # a tied tensor under several names is sent once
        if id(t) not in where:
            where[id(t)] = nbytes
            nbytes += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    flat = torch.empty(max(nbytes, 1), dtype=torch.uint8)
    for t in {id(t): t for _, t in bucket}.values():
        start = where[id(t)]
        flat[start : start + t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t.detach())
    layout = {"nbytes": int(flat.numel()), "names": [n for n, _ in bucket],
              "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
              "shapes": [list(t.shape) for _, t in bucket], "offsets": [where[id(t)] for _, t in bucket]}
    return flat, layout


def unpack(flat: torch.Tensor, names, dtype_names, shapes, offsets) -> list[tuple[str, torch.Tensor]]:
    """Views of ``flat`` by a bucket's layout (no copy)."""
    out = []
    for name, dtype, shape, offset in zip(names, dtype_names, shapes, offsets):
        dtype = getattr(torch, dtype)
        out.append((name, flat[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)))
    return out


def beside(call: Callable[[], object], collective: Callable[[], object], what: str):
    """Run the HTTP ``call`` in a thread while this thread runs ``collective`` (which returns a gloo ``Work``
    or blocks); the first error of either is raised, so a refused call does not leave the collective waiting."""
    failed: list[BaseException] = []

    result: list = []

    def run(fn, into):
        try:
            into.append(fn())
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
            failed.append(e)

    thread = threading.Thread(target=run, args=(call, []), name=f"rlflow-gloo-{what}", daemon=True)
    thread.start()
    joined = threading.Thread(target=run, args=(collective, result), daemon=True)
    joined.start()  # a group's constructor blocks until every rank has joined: a thread too, to watch `call`
    while joined.is_alive() and not failed:
        joined.join(0.05)
    if failed:
        raise failed[0]
    work = result[0] if result else None
    deadline = time.monotonic() + TIMEOUT_S
    while isinstance(work, dist.Work) and not work.is_completed():
        if failed:
            raise failed[0]
        if time.monotonic() > deadline:
            raise TimeoutError(f"rlflow_gloo {what}: the server's workers did not receive within {TIMEOUT_S:.0f} s")
        time.sleep(0.002)
    if isinstance(work, dist.Work):
        work.wait()
    thread.join()
    if failed:
        raise failed[0]
    return result[0]


@functools.cache
def _trainer_classes():
    """The trainer-side engine, defined on first use (it subclasses vLLM's base)."""
    from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

    @dataclass
    class GlooTrainerInitInfo(TrainerInitInfo):
        backend: ClassVar[str] = GLOO
        server_host: str = "127.0.0.1"  # to pick the trainer's address the server can reach
        server_world_size: int = 1

    class GlooTrainerEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
        """Rank 0 joins a gloo group with the server's workers and broadcasts each bucket; every rank
        iterates the buckets (gathering sharded weights is collective)."""

        init_info_cls = GlooTrainerInitInfo

        @classmethod
        def trainer_init(cls, init_info, *, client, source=None):
            engine = cls(client=client, source=source, is_sender=init_info.is_sender)
            engine.store = engine.group = None
            if engine.is_sender:
                address = address_towards(init_info.server_host)
                port, world = free_port(address), 1 + init_info.server_world_size
                info = {"master_address": address, "master_port": port, "world_size": world}
                engine.store, engine.group = beside(lambda: client.init_weight_transfer_engine(info),
                                                    lambda: join(address, port, 0, world), "init")
                engine.address = f"{address}:{port}"
            return engine

        def send_weights(self, buckets=(), weight_version: str | None = None) -> dict[str, float]:
            totals = {"weight_sync/buckets": 0.0, "weight_sync/gb": 0.0}
            if self.is_sender:
                self.client.start_weight_update()
            for bucket in buckets:
                totals["weight_sync/buckets"] += 1
                if self.is_sender:
                    flat, layout = pack(bucket)
                    beside(lambda layout=layout: self.client.update_weights(layout),
                           lambda flat=flat: self.group.broadcast(flat, 0), "update_weights")
                    totals["weight_sync/gb"] += sum(t.numel() * t.element_size()
                                                    for t in {id(t): t for _, t in bucket}.values()) / 1e9
            if self.is_sender:
                self.client.finish_weight_update(weight_version)
            return totals

    return GlooTrainerEngine, GlooTrainerInitInfo


def __getattr__(name: str):  # vLLM's factory loads the class by name
    classes = ("GlooTrainerEngine", "GlooTrainerInitInfo")
    if name in classes:
        found = dict(zip(classes, _trainer_classes()))
        globals().update(found)
        return found[name]
    raise AttributeError(name)
