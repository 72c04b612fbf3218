"""Weights through vLLM's own weight-transfer protocol, with a CPU backend of rlflow's registered in vLLM's factory.

vLLM (0.32) updates a running engine in four calls: ``init_weight_transfer_engine`` (once),
``start_weight_update``, ``update_weights`` (once per chunk) and ``finish_weight_update``; the data plane is
a *weight-transfer engine* chosen by ``weight_transfer_config={"backend": ...}`` and created inside the
worker by ``vllm.distributed.weight_transfer.WeightTransferEngineFactory``. Its built-in engines (NCCL, CUDA
IPC, ...) need a GPU. This module registers one more, ``rlflow_shm``, that runs on vLLM's CPU worker:

- the trainer writes each bucket once, packed and 64-byte aligned, into a file under ``/dev/shm`` (shared
  memory: no disk) and sends its layout (names, dtypes, shapes, offsets) as the ``update_weights`` payload,
  plain JSON, so the same payload goes through ``LLM.update_weights`` in-process and through the server's
  ``POST /update_weights``;
- the worker maps the file (no copy), hands views of it to ``model.load_weights`` inside vLLM's layerwise
  reload (``start``/``finish``, as vLLM's IPC engine does), and the trainer unlinks it once the call returns.

Why shared memory first: the in-process engine lives in the trainer's own process (a two-rank group would
need two threads of one process to rendezvous), and a file in ``/dev/shm`` is written once and mapped, not
sent. The price is that trainer and engine share a machine, which ``init_weight_transfer_engine`` checks (the
worker reads a probe file the trainer wrote). A server on another machine fails that check, and with
``weight_transfer="auto"`` the trainer then moves to ``rlflow_gloo``
(:mod:`rlflow.rollout.engines.weight_transfer_gloo`: the same buckets broadcast over a gloo group beside
each ``update_weights`` call); the worker engine here takes both init infos, so the same server serves
either. A server without the protocol falls back to the disk path with a message instead of failing at the
first update. vLLM's base ``update_weights`` calls ``torch.accelerator.synchronize()``, which raises on a
machine without an accelerator; this engine overrides it.

A server creates its worker in a spawned engine process, where this process's registration does not exist:
:func:`server_arguments` names :mod:`rlflow.rollout.engines.vllm_extension` as the worker extension, whose
import registers ``rlflow_shm`` there.

On CUDA ``backend="auto"`` picks vLLM's own engines through its trainer-side factory: ``ipc`` for the
in-process engine (same GPU), ``nccl`` for a server. Those paths are wired but were not run here (no GPU);
``tests/rollout/test_vllm_gpu.py`` runs them where one is present.

The prefix cache is not part of the protocol: callers still reset it after ``finish_weight_update``.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import tempfile
import urllib.parse
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from rlflow.rollout.engines import weight_transfer_gloo
from rlflow.rollout.engines.errors import ServerError
from rlflow.rollout.engines.weight_transfer_gloo import GLOO, join, pack, relay, send_buckets, unique_bytes, unpack
from rlflow.rollout.engines.weights_on_disk import distributed

log = logging.getLogger("rlflow.rollout.weight_transfer")

SHM = "rlflow_shm"
MODULE = "rlflow.rollout.engines.weight_transfer"


def shm_directory() -> Path:
    """Where buckets are written: ``/dev/shm`` (memory) where it exists, else the temporary folder."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def protocol_missing() -> str | None:
    """Why the installed vLLM cannot take weights through its weight-transfer protocol, or None when it can."""
    try:
        import vllm
        from vllm.distributed.weight_transfer import WeightTransferEngineFactory  # noqa: F401
    except ImportError as e:
        return f"this vLLM has no weight-transfer protocol ({e})"
    if not all(hasattr(vllm.LLM, m) for m in ("init_weight_transfer_engine", "start_weight_update",
                                               "update_weights", "finish_weight_update")):
        return f"vLLM {getattr(vllm, '__version__', '?')}'s LLM lacks the weight-transfer calls"
    return None


def choose_backend(requested: str | None, *, on_gpu: bool, server: bool, where: str) -> str | None:
    """The weight-transfer backend to use, or None for the reload path (logged once, naming ``where``).

    ``requested``: ``"auto"`` (``rlflow_shm`` on CPU; on CUDA ``ipc`` in-process, ``nccl`` for a server), a
    backend registered in vLLM's factory, or ``None`` / ``"reload"`` for the reload path."""
    if requested in (None, "reload"):
        log.info("%s: weights go through reload_weights (weight_transfer=%r)", where, requested)
        return None
    missing = protocol_missing()
    if missing is not None:
        log.warning("%s: %s; weights go through reload_weights instead", where, missing)
        return None
    if requested == "auto":
        requested = ("nccl" if server else "ipc") if on_gpu else SHM
    register()
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    if requested not in WeightTransferEngineFactory._registry:
        raise ValueError(f"weight_transfer={requested!r}: not a vLLM weight-transfer backend; choose 'auto', "
                         f"'reload' or one of {sorted(WeightTransferEngineFactory._registry)}")
    log.info("%s: weights go through vLLM's weight-transfer protocol (backend %s)", where, requested)
    return requested


# ---------------------------------------------------------------------------------------------- worker side
@functools.cache
def _worker_classes():
    """The worker-side engine and the trainer side's, defined on first use so that importing this module does not
    import vLLM: ``(SharedMemoryWeightTransferEngine, SharedMemoryTrainerEngine, SharedMemoryTrainerInitInfo)``."""
    return (_worker_engine(), *_trainer_engine())


def _worker_infos():
    """The worker's init infos (``rlflow_shm``'s, ``rlflow_gloo``'s) and its update info, as vLLM dataclasses."""
    from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

    @dataclass
    class SharedMemoryInitInfo(WeightTransferInitInfo):
        probe: str  # a file the trainer wrote: the worker reads it to show both sides share a machine
        token: str

    @dataclass
    class GlooInitInfo(WeightTransferInitInfo):  # rlflow_gloo (weight_transfer_gloo): the group to join
        master_address: str
        master_port: int
        world_size: int
        rank_offset: int = 1  # this server's first rank: 1 alone, after the servers before it in a fleet's group

    @dataclass
    class SharedMemoryUpdateInfo(WeightTransferUpdateInfo):
        nbytes: int
        names: list[str]
        dtype_names: list[str]
        shapes: list[list[int]]
        offsets: list[int]
        path: str | None = None  # None: the bytes come by broadcast over the gloo group

    return SharedMemoryInitInfo, GlooInitInfo, SharedMemoryUpdateInfo


def _worker_engine():
    """The worker-side engine class, taking the infos of :func:`_worker_infos`."""
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    SharedMemoryInitInfo, GlooInitInfo, SharedMemoryUpdateInfo = _worker_infos()

    class SharedMemoryWeightTransferEngine(WeightTransferEngine[SharedMemoryInitInfo, SharedMemoryUpdateInfo]):
        """Receives buckets from files in shared memory (see the module docstring), or by broadcast over a gloo
        group with a trainer on another machine (the init info says which: ``rlflow_gloo``'s has an address)."""

        init_info_cls = SharedMemoryInitInfo
        update_info_cls = SharedMemoryUpdateInfo

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.ready, self.rounds, self.received_bytes, self.gloo = False, 0, 0, None

        def parse_init_info(self, init_dict: dict[str, Any]):
            if "master_address" in init_dict:
                try:
                    return GlooInitInfo(**init_dict)
                except TypeError as e:
                    raise ValueError(f"Invalid init_info for rlflow_gloo: {e}") from e
            return super().parse_init_info(init_dict)

        def init_transfer_engine(self, init_info) -> None:
            self.gloo = None  # a new trainer (or the same one again) replaces the last one's group
            if isinstance(init_info, GlooInitInfo):
                rank = init_info.rank_offset + self.parallel_config.rank  # the trainer is rank 0
                self.gloo = join(init_info.master_address, init_info.master_port, rank, init_info.world_size)
                self.ready = True
                return
            try:
                seen = Path(init_info.probe).read_text()
            except OSError as e:
                seen = f"unreadable ({e})"
            if seen != init_info.token:
                raise ValueError(f"rlflow_shm weight transfer: this worker cannot read the trainer's shared memory "
                                 f"({init_info.probe}: {seen[:60]!r}); trainer and engine must share a machine")
            self.ready = True

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            if not self.ready:
                raise RuntimeError("rlflow_shm weight transfer: call init_weight_transfer_engine first")
            initialize_layerwise_reload(self.model)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            self.receive_weights(self.parse_update_info(update_info))  # no accelerator sync: it raises on CPU
            if self.device.type != "cpu":
                torch.accelerator.synchronize()

        def receive_weights(self, update_info: SharedMemoryUpdateInfo) -> None:
            if update_info.path is None:  # rlflow_gloo: the trainer broadcasts the bucket while this call runs
                if self.gloo is None:
                    raise RuntimeError("rlflow_gloo weight transfer: no gloo group (init_weight_transfer_engine with "
                                       "master_address first)")
                flat = torch.empty(update_info.nbytes, dtype=torch.uint8)
                relay(self.gloo[1], flat)  # from the rank before, on to the rank after
            else:  # MAP_PRIVATE: the views share the trainer's pages; layerwise reload may keep some until its
                # layer is complete, which the mapping survives (the trainer's unlink only drops the name).
                flat = torch.from_file(update_info.path, shared=False, size=update_info.nbytes, dtype=torch.uint8)
            self.model.load_weights(unpack(flat, update_info.names, update_info.dtype_names, update_info.shapes,
                                           update_info.offsets))
            self.received_bytes += update_info.nbytes

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
            self.rounds += 1

        def shutdown(self) -> None:
            self.ready, self.gloo = False, None

    return SharedMemoryWeightTransferEngine


def _trainer_engine():
    """The trainer-side engine class of ``rlflow_shm`` and its init info."""
    from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

    @dataclass
    class SharedMemoryTrainerInitInfo(TrainerInitInfo):
        backend: ClassVar[str] = SHM

    class SharedMemoryTrainerEngine(TrainerWeightTransferEngine[SharedMemoryTrainerInitInfo]):
        """The trainer side: writes buckets to shared memory and drives the four calls through ``client``.
        Every rank iterates the buckets (gathering sharded weights is collective); rank 0 alone writes and sends."""

        init_info_cls = SharedMemoryTrainerInitInfo

        @classmethod
        def trainer_init(cls, init_info, *, client, source=None):
            engine = cls(client=client, source=source, is_sender=init_info.is_sender)
            if engine.is_sender:
                probe, token = shm_directory() / f"rlflow-wt-probe-{uuid.uuid4().hex}", uuid.uuid4().hex
                probe.write_text(token)
                try:
                    client.init_weight_transfer_engine({"probe": str(probe), "token": token})
                finally:
                    probe.unlink(missing_ok=True)
            return engine

        def send_weights(self, buckets=(), weight_version: str | None = None) -> dict[str, float]:
            return send_buckets(self, buckets, weight_version, self._send_bucket)

        def _send_bucket(self, bucket) -> int:
            path = shm_directory() / f"rlflow-wt-{os.getpid()}-{uuid.uuid4().hex}"

            def mapped(nbytes: int) -> torch.Tensor:  # the bucket's bytes in shared memory, not in this process
                with open(path, "wb") as f:
                    f.truncate(nbytes)
                return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)

            try:
                flat, layout = pack(bucket, mapped)
                del flat
                self.client.update_weights({"path": str(path), **layout})
            finally:
                path.unlink(missing_ok=True)
            return unique_bytes(bucket)

    return SharedMemoryTrainerEngine, SharedMemoryTrainerInitInfo


def register() -> None:
    """Register ``rlflow_shm`` with vLLM's worker- and trainer-side factories (once per process)."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if SHM not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(SHM, MODULE, "SharedMemoryWeightTransferEngine")
    if SHM not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(SHM, MODULE, "SharedMemoryTrainerEngine")
    if GLOO not in WeightTransferEngineFactory._registry:  # the same worker engine takes both (its docstring)
        WeightTransferEngineFactory.register_engine(GLOO, MODULE, "SharedMemoryWeightTransferEngine")
    if GLOO not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(GLOO, weight_transfer_gloo.MODULE, "GlooTrainerEngine")


def __getattr__(name: str):  # the factories' lazy loaders look the classes up by name
    classes = ("SharedMemoryWeightTransferEngine", "SharedMemoryTrainerEngine", "SharedMemoryTrainerInitInfo")
    if name in classes:
        found = dict(zip(classes, _worker_classes()))
        globals().update(found)
        return found[name]
    raise AttributeError(name)


# ---------------------------------------------------------------------------------------------- trainer side
class LLMClient:
    """vLLM's ``VLLMWeightSyncClient`` over an in-process ``vllm.LLM`` (its ``RLOfflineMixin`` methods)."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


class HTTPClient:
    """The same four calls over a vLLM server's RL endpoints (``VLLM_SERVER_DEV_MODE=1``), through
    ``request(path, payload)`` (a :class:`~rlflow.rollout.engines.server.ServerEngine`'s, with its retries)."""

    def __init__(self, request):
        self.request = request

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.request("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.request("/start_weight_update", {})

    def update_weights(self, update_info) -> None:
        self.request("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.request("/finish_weight_update", {"weight_version": weight_version})


class BucketSource:
    """vLLM's ``WeightSource`` over one round's buckets (for its NCCL / IPC trainer engines, which replay a
    source each round): ``set`` it before every ``send_weights``. Holds the round's tensors until the next."""

    def __init__(self):
        self.pairs: list[tuple[str, torch.Tensor]] = []

    def set(self, buckets) -> dict[str, float]:
        buckets = list(buckets)
        self.pairs = [pair for bucket in buckets for pair in bucket]
        return {"weight_sync/buckets": float(len(buckets)), "weight_sync/gb": unique_bytes(self.pairs) / 1e9}

    def metadata(self):
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.pairs]

    def __iter__(self):
        return iter(self.pairs)


class Sender:
    """Sends buckets through one backend: ``send(buckets, weight_version)`` -> ``weight_sync/*`` metrics."""

    def __init__(self, backend: str, client, *, rank: int = 0, server_world_size: int = 1, address: str = "127.0.0.1",
                 server_host: str = "127.0.0.1"):
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

        self.backend, self.rounds = backend, 0
        if backend == SHM:
            info, self.source = _worker_classes()[2](rank=rank), None
        elif backend == GLOO:  # buckets as payload-less broadcasts: no WeightSource either
            info, self.source = weight_transfer_gloo.GlooTrainerInitInfo(
                rank=rank, server_host=server_host, server_world_size=server_world_size), None
        else:  # vLLM's GPU engines replay a WeightSource each round
            from vllm.distributed.weight_transfer.base import WeightSource

            self.source = type("RoundSource", (BucketSource, WeightSource), {})()
            if backend == "ipc":
                from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

                info = IPCTrainerInitInfo(rank=rank)
            elif backend == "nccl":
                from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

                with socket.socket() as s:
                    s.bind((address, 0))
                    port = s.getsockname()[1]
                info = NCCLTrainerInitInfo(rank=rank, master_address=address, master_port=port,
                                           world_size=1 + server_world_size)
            else:
                raise ValueError(f"weight_transfer={backend!r}: rlflow drives 'rlflow_shm', 'rlflow_gloo', 'ipc' and 'nccl'")
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=self.source)

    def send(self, buckets) -> dict[str, float]:
        self.rounds += 1
        if self.source is None:
            return self.engine.send_weights(buckets, weight_version=str(self.rounds))
        metrics = self.source.set(buckets)
        self.engine.send_weights()
        self.source.set(())
        return metrics


def server_sender(engine, requested: str | None) -> Sender | None:
    """A :class:`Sender` to ``engine``'s server (a :class:`~rlflow.rollout.engines.server.ServerEngine`), or
    None when the server does not take weights through the protocol: no RL endpoints (an older vLLM, no
    ``VLLM_SERVER_DEV_MODE``, another server), started without ``--weight-transfer-config``, or unable to read
    this machine's shared memory. Said once, as a warning; the caller then keeps its disk path. In a
    multi-process trainer, rank 0 asks and every rank follows its answer (all ranks gather the buckets)."""
    import torch.distributed as dist

    where = f"the server at {engine.url}"
    backend = choose_backend(requested, on_gpu=torch.cuda.is_available(), server=True, where=where)
    if backend is None:
        return None
    rank = dist.get_rank() if distributed() else 0
    host = urllib.parse.urlsplit(engine.url).hostname or "127.0.0.1"
    answer = [None, backend]  # (why not, the backend used): rank 0 decides, every rank follows
    if rank == 0:
        client = HTTPClient(lambda path, payload: engine.request(path, payload, retries=0))
        try:  # one attempt each: a refusal here is an answer, not a fault to retry
            world = engine.request("/get_world_size", method="GET", retries=0)["world_size"] if backend in (
                "nccl", GLOO) else 1
            try:
                sender = Sender(backend, client, server_world_size=world, server_host=host)
            except ServerError as e:  # it has the protocol (no 404) but refused the probe: another machine
                if backend != SHM or e.status != 500 or requested != "auto":
                    raise
                log.info("%s is not on this machine (%s): weights go by gloo broadcast (rlflow_gloo)", where,
                         str(e)[:200])
                world = engine.request("/get_world_size", method="GET", retries=0)["world_size"]
                sender, answer[1] = Sender(GLOO, client, server_world_size=world, server_host=host), GLOO
        except (ServerError, ValueError, KeyError, TypeError) as e:
            answer[0] = str(e)[:300]
    if distributed():
        dist.broadcast_object_list(answer, src=0)
    if answer[0] is not None:
        log.warning("%s does not take weights through vLLM's weight-transfer protocol (%s); weights go through "
                    "its reload from a checkpoint folder instead", where, answer[0])
        return None
    if rank == 0:  # printed: which path the weights take is what a user checks first when a sync is slow
        print(f"[rlflow] weights to {where}: vLLM's weight-transfer protocol, backend {sender.backend}", flush=True)
        return sender
    return Sender(answer[1], HTTPClient(engine.request), rank=rank)


def server_arguments(weight_transfer: str | None) -> list[str]:
    """vLLM server arguments for weights through ``weight_transfer`` (``"auto"``: ``rlflow_shm`` on CPU,
    ``nccl`` on CUDA): ``--weight-transfer-config``, and for ``rlflow_shm`` the worker extension whose import
    registers it in the server's engine process (:mod:`rlflow.rollout.engines.vllm_extension`). Nothing where
    the protocol is off or missing."""
    if weight_transfer in (None, "reload") or protocol_missing() is not None:
        return []
    import json

    backend = ("nccl" if torch.cuda.is_available() else SHM) if weight_transfer == "auto" else weight_transfer
    extension = ["--worker-extension-cls", "rlflow.rollout.engines.vllm_extension.WeightTransferExtension"]
    return ["--weight-transfer-config", json.dumps({"backend": backend})] + (
        extension if backend in (SHM, GLOO) else [])
