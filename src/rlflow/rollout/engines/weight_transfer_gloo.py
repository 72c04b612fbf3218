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
- the bucket goes down the group as a chain (:func:`relay`: rank 0 -> 1 -> 2 ..., in 4 MiB pieces), so it
  leaves the trainer once however many workers receive it; gloo's own broadcast (a binomial tree) sent two
  copies from the trainer to two servers, measured;
- a fleet of servers is one group too (:class:`FleetBroadcast`: each server's workers after the previous
  server's, its ``rank_offset``), every server's ``/update_weights`` made from a thread of its own while the
  trainer sends; the group is built again over the servers left when one is taken out.

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
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

GLOO = "rlflow_gloo"
MODULE = "rlflow.rollout.engines.weight_transfer_gloo"
ALIGN = 64  # every tensor starts on a 64-byte boundary, so a uint8 view can be viewed as any dtype
TIMEOUT_S = 600.0  # a broadcast that waits longer than this has lost its receiver
PIECE = 4 * 2**20  # a bucket goes down the chain in pieces: each hop passes one on while the next arrives


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


def relay(group, flat: torch.Tensor) -> None:
    """Broadcast ``flat`` from rank 0 down the chain 0 -> 1 -> ... -> size - 1: each rank receives every piece
    from the rank before it and passes it to the rank after, so the bytes leave each rank (the trainer
    included) once whatever the group's size. gloo's own broadcast is a binomial tree whose root sends
    log2(size) copies: measured, 2 copies of the weights from the trainer to a fleet of 2 servers."""
    rank, size = group.rank(), group.size()
    sends = []
    for start in range(0, flat.numel(), PIECE):
        piece = flat[start : start + PIECE]
        if rank > 0:
            group.recv([piece], rank - 1, 0).wait()
        if rank + 1 < size:
            sends.append(group.send([piece], rank + 1, 0))
    for work in sends:
        work.wait()


def unique_bytes(bucket) -> int:
    """The bytes of a bucket's tensors, a tensor tied under several names counted once."""
    return sum(t.numel() * t.element_size() for t in {id(t): t for _, t in bucket}.values())


def pack(bucket, alloc=lambda n: torch.empty(n, dtype=torch.uint8)) -> tuple[torch.Tensor, dict]:
    """One bucket (``[(name, tensor), ...]``) -> a flat byte tensor from ``alloc(nbytes)`` (memory; ``rlflow_shm``
    maps a file) holding each tensor 64-byte aligned, and its layout (the update payload)."""
    where, nbytes = {}, 0
    for _, t in bucket:  # a tied tensor under several names is sent once
        if id(t) not in where:
            where[id(t)] = nbytes
            nbytes += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    flat = alloc(max(nbytes, 1))
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


class CallsFailed(Exception):
    """Some of :func:`beside`'s calls failed (or hung): ``failures`` maps each one's index to its error."""

    def __init__(self, failures: dict[int, BaseException]):
        super().__init__("; ".join(f"call {k}: {e}" for k, e in sorted(failures.items())))
        self.failures = failures


def beside(call, collective: Callable[[], object], what: str):
    """Run the HTTP ``call`` (or each of a list of calls) in a thread while this thread runs ``collective``
    (which returns a gloo ``Work`` or blocks); the first error is raised, so a refused call does not leave the
    collective waiting. With a list, the error is a :class:`CallsFailed` naming which calls failed (a call still
    running when the collective times out counts as failed: its server did not receive)."""
    calls = call if isinstance(call, list) else [call]
    failed: dict = {}  # call index (or "collective") -> its error
    result: list = []

    def run(fn, into, key):
        try:
            into.append(fn())
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
            failed.setdefault(key, e)

    def error():
        if not isinstance(call, list):
            return next(iter(failed.values()))
        calls_failed = {k: e for k, e in failed.items() if k != "collective"}
        return CallsFailed(calls_failed) if calls_failed else failed["collective"]

    threads = [threading.Thread(target=run, args=(fn, [], k), name=f"rlflow-gloo-{what}", daemon=True)
               for k, fn in enumerate(calls)]
    for thread in threads:
        thread.start()
    joined = threading.Thread(target=run, args=(collective, result, "collective"), daemon=True)
    joined.start()  # a group's constructor blocks until every rank has joined: a thread too, to watch the calls
    while joined.is_alive() and not failed:
        joined.join(0.05)
    if failed:
        raise error()
    work = result[0] if result else None
    deadline = time.monotonic() + TIMEOUT_S
    while isinstance(work, dist.Work) and not work.is_completed():
        if failed:
            raise error()
        if time.monotonic() > deadline:
            hung = TimeoutError(f"rlflow_gloo {what}: the server's workers did not receive within {TIMEOUT_S:.0f} s")
            if isinstance(call, list):
                raise CallsFailed({k: hung for k, t in enumerate(threads) if t.is_alive()} or {0: hung})
            raise hung
        time.sleep(0.002)
    if isinstance(work, dist.Work):
        work.wait()
    for thread in threads:
        thread.join()
    if failed:
        raise error()
    return result[0]


class FleetBroadcast:
    """Rank 0's side of ``rlflow_gloo`` over a fleet: one gloo group of the trainer (rank 0) and every member's
    workers (member ``ids[k]``'s after those of the members before it: its ``rank_offset``), one broadcast per
    bucket reaching them all while each member's ``/update_weights`` runs in a thread of its own, so a bucket
    leaves the trainer once, not once per server.

    ``send(ids, buckets, version)`` updates members ``ids`` (indices into ``members``, the fleet's
    :class:`~rlflow.rollout.engines.server.ServerEngine` s); when ``ids`` differ from the group's members (a
    server was taken out, or came back) the group is built again over them, on a new port. It returns, per
    member, why it missed the update (``""``: it has it). A member that fails during a round fails the round for
    every member (the others hold part of the buckets); the group is then dropped, to be built at the next round.
    """

    def __init__(self, members):
        self.members = members
        self.store = self.group = None
        self.joined: tuple[int, ...] = ()  # the members in the group, in rank order
        self.worlds: dict[int, int] = {}  # member -> its workers (asked once)
        self.groups_built, self.broadcasts, self.sent_bytes = 0, 0, 0  # over all rounds

    def ask(self, i: int, path: str, payload: dict):
        return self.members[i].request(path, payload, retries=0)  # one attempt: the broadcast cannot be replayed

    def build(self, ids: tuple[int, ...]) -> None:
        self.store = self.group = None
        self.joined = ()
        for i in ids:
            if i not in self.worlds:
                self.worlds[i] = int(self.members[i].request("/get_world_size", method="GET", retries=0)["world_size"])
        host = urllib.parse.urlsplit(self.members[ids[0]].url).hostname or "127.0.0.1"
        address = address_towards(host)
        port, world = free_port(address), 1 + sum(self.worlds[i] for i in ids)
        offsets = [1 + sum(self.worlds[j] for j in ids[:k]) for k in range(len(ids))]
        calls = [lambda i=i, off=off: self.ask(i, "/init_weight_transfer_engine", {"init_info": {
            "master_address": address, "master_port": port, "world_size": world, "rank_offset": off}})
            for i, off in zip(ids, offsets)]
        self.store, self.group = beside(calls, lambda: join(address, port, 0, world), "init")
        self.joined, self.groups_built = tuple(ids), self.groups_built + 1

    def send(self, ids, buckets, version: str) -> tuple[list[str], dict[str, float]]:
        """Update members ``ids`` with ``buckets``: ``(errors per member, weight_sync/* metrics)``."""
        ids, errors = tuple(ids), [""] * len(self.members)
        totals = {"weight_sync/buckets": 0.0, "weight_sync/gb": 0.0, "weight_sync/broadcast_gb": 0.0}
        buckets = iter(buckets)
        try:
            if not ids:
                raise RuntimeError("no server to update")
            if ids != self.joined:
                self.build(ids)
            beside([lambda i=i: self.ask(i, "/start_weight_update", {}) for i in ids], lambda: None, "start")
            for bucket in buckets:
                flat, layout = pack(bucket)
                beside([lambda i=i, layout=layout: self.ask(i, "/update_weights", {"update_info": layout}) for i in ids],
                       lambda flat=flat: relay(self.group, flat), "update_weights")
                self.broadcasts, self.sent_bytes = self.broadcasts + 1, self.sent_bytes + flat.numel()
                totals["weight_sync/buckets"] += 1
                totals["weight_sync/broadcast_gb"] += flat.numel() / 1e9  # what left the trainer, padding included
                totals["weight_sync/gb"] += unique_bytes(bucket) / 1e9
            beside([lambda i=i: self.ask(i, "/finish_weight_update", {"weight_version": version}) for i in ids],
                   lambda: None, "finish")
            beside([lambda i=i: self.ask(i, "/reset_prefix_cache", {}) for i in ids], lambda: None, "reset")
        except Exception as e:  # noqa: BLE001 - named per member; the fleet takes them out
            failures = e.failures if isinstance(e, CallsFailed) else {}
            for k, i in enumerate(ids):
                why = failures.get(k)
                errors[i] = f"rlflow_gloo: {why}" if why is not None else f"rlflow_gloo round failed: {str(e)[:300]}"
            self.store = self.group = None
            self.joined = ()
            for _ in buckets:  # every process iterates the buckets (gathering sharded weights is collective)
                pass
        return errors, totals


def send_buckets(engine, buckets, weight_version: str | None, send_bucket) -> dict[str, float]:
    """A trainer engine's ``send_weights``: vLLM's start / update per bucket / finish calls, made by the sender
    alone with ``send_bucket(bucket) -> bytes``; every rank iterates the buckets (gathering sharded weights is
    collective). Shared by this module's engine and ``rlflow_shm``'s."""
    totals = {"weight_sync/buckets": 0.0, "weight_sync/gb": 0.0}
    if engine.is_sender:
        engine.client.start_weight_update()
    for bucket in buckets:
        totals["weight_sync/buckets"] += 1
        if engine.is_sender:
            totals["weight_sync/gb"] += send_bucket(bucket) / 1e9
    if engine.is_sender:
        engine.client.finish_weight_update(weight_version)
    return totals


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
            return send_buckets(self, buckets, weight_version, self._send_bucket)

        def _send_bucket(self, bucket) -> int:
            flat, layout = pack(bucket)
            beside(lambda: self.client.update_weights(layout), lambda: relay(self.group, flat), "update_weights")
            return unique_bytes(bucket)

    return GlooTrainerEngine, GlooTrainerInitInfo


def __getattr__(name: str):  # vLLM's factory loads the class by name
    classes = ("GlooTrainerEngine", "GlooTrainerInitInfo")
    if name in classes:
        found = dict(zip(classes, _trainer_classes()))
        globals().update(found)
        return found[name]
    raise AttributeError(name)
