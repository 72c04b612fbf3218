"""FleetEngine: one engine over several servers, with load balancing, health checks and failover.

Each member is a :class:`~rlflow.rollout.engines.server.ServerEngine` (one URL). A call's prompts are
dispatched one request each to the usable server with the fewest requests in flight (its queue depth), at
most ``max_concurrency`` per server, so a slower server gets fewer. While requests are in flight, every
server holding some is probed (``GET /health``, answered within ``health_timeout``) every
``health_interval`` seconds. A server that fails a probe, or whose request failed after its own retries
(a refused request, HTTP 4xx, is the request's fault and raises as it would with one server), is
**taken out**: its in-flight requests are sent again to the others, and whatever it answers later is
ignored. Results are kept by prompt index and only the answer of a prompt's current request is accepted,
so every prompt's ``n`` samples come back exactly once, in order, whichever server sampled them.

**Weights.** ``load_weights`` writes the buckets once, as a checkpoint folder (``checkpoint_dir``, which
every server must be able to read), then asks each server to reload it (the member's own ``reload``). With
``weight_transfer="rlflow_gloo"`` no folder is written: global rank 0 and the workers of every server that
answers ``/health`` form one gloo group and each bucket is broadcast once to all of them, every server's
``/update_weights`` running in a thread meanwhile
(:class:`~rlflow.rollout.engines.weight_transfer_gloo.FleetBroadcast`); when the servers that answer are
not the group's members, the group is built again over them (new port). A server that cannot take the
update is taken out as *stale*: it never samples with old weights. A server taken out for any reason comes
back only after it holds the newest weights: at the next update, or, in a single-process run through a
folder, at the start of the next call once it answers its health check again (it is reloaded first; a
restarted server would otherwise sample with the weights it started from). By gloo the bytes exist only
during an update, so a returning server rejoins at the next update. A server that fails *during* a gloo
round fails it for every server of the round (each holds part of the buckets, which are not kept to be sent
again): all are taken out until the next update, and with none left the update raises. In a multi-process run
every process keeps its own view of which servers answer, but which servers hold the newest weights is
decided by global rank 0 at each update and shared, so no process samples from a stale server; a returning
server is reloaded only at an update there (all processes must agree on it). A server out that still does
not answer is probed again at the start of every call (all such probes at once): a hung one costs up to
``health_timeout`` per call, a dead one (refused connection) nothing.

**Requests kept across a weight update** (for :class:`~rlflow.rollout.FullyAsyncRollout`, where every member can
keep them: vLLM servers with ``/pause`` and ``/inference/v1/generate``): ``submit_kept`` sends a prompt's
request to the usable member with the fewest kept requests in flight and remembers which member holds it;
``update_kept`` pauses every member with ``/pause?mode=keep`` (requests frozen, KV cache kept), loads the
weights as ``load_weights`` does (a member that misses the update, or could not be paused, is taken out), labels
the usable members with the new version and resumes every member it paused; each answer is read with its own
member. A member taken out keeps sampling its kept requests with the weights it holds, and vLLM labels their
tokens with that version, so a token's version stays the one that sampled it; new requests go to the others. A
kept request is not failed over: a member that dies fails the run with its requests.

Metrics of each call (``stats``): ``rollout/servers_healthy`` (servers usable at the end of the call),
``rollout/failovers`` (requests sent again to another server), ``rollout/server{i}/requests`` (requests
sent to server ``i``, the index in the URL list), ``server/retries`` (all servers' own retries); each
update adds ``rollout/servers_synced``.
"""

from __future__ import annotations

import shutil
import threading
import time
import urllib.request
import warnings
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch.distributed as dist

from rlflow.rollout.engines.base import Completion, Engine, SamplingParams, WeightBuckets
from rlflow.rollout.engines.weights_on_disk import distributed, shared_temp_dir, write_checkpoint, writes_checkpoints
from rlflow.rollout.engines.server import RETRY_STATUS, ServerEngine, ServerError
from rlflow.rollout.engines.weight_transfer_gloo import GLOO, FleetBroadcast

PAUSE = "/pause?mode=keep&clear_cache=false"  # clear_cache=false: vLLM would otherwise recompute the frozen requests


class FleetEngine(Engine):
    """Samples from several servers as one engine (see the module docstring).

    Args:
        servers: one engine per server (all serving the same model), in the order of their URLs.
        max_concurrency: requests in flight at once per server.
        health_interval: seconds between health probes of a server with requests in flight.
        health_timeout: seconds a health probe may take before the server counts as hung.
        checkpoint_dir: where weights are written for the servers to reload (default: a temporary folder).
        weight_transfer: ``"rlflow_gloo"``: weights by one gloo broadcast to every server (no folder); anything
            else: through ``checkpoint_dir``.
    """

    holds_own_weights = True
    remote = True  # it samples in the servers: AsyncRollout drives it from a thread, not a child process

    def __init__(self, servers: list[ServerEngine], *, max_concurrency: int = 64, health_interval: float = 1.0,
                 health_timeout: float = 10.0, checkpoint_dir=None, weight_transfer: str | None = None):
        if len(servers) < 1:
            raise ValueError("a fleet needs at least one server")
        if max_concurrency < 1 or health_interval <= 0 or health_timeout <= 0:
            raise ValueError(f"max_concurrency ({max_concurrency}), health_interval ({health_interval}) and "
                             f"health_timeout ({health_timeout}) must be positive")
        self.servers, self.max_concurrency = list(servers), max_concurrency
        self.health_interval, self.health_timeout = health_interval, health_timeout
        self.urls = [s.url for s in self.servers]
        self.checkpoint_dir, self.own_dir = checkpoint_dir, checkpoint_dir is None
        # why each server is out ("" when it is usable); it comes back only with the newest weights
        self.out_reason = [""] * len(self.servers)
        self.version = 0  # weight updates sent so far
        self.lock = threading.Lock()  # weights and server states: a reload never races a re-sync
        self.probes = ThreadPoolExecutor(max_workers=len(self.servers), thread_name_prefix="rlflow-fleet-health")
        self.stats: dict[str, float] = {}
        self.gloo, self.broadcast = weight_transfer == GLOO, None  # rlflow_gloo: global rank 0's FleetBroadcast
        self.kept_by: dict[str, int] = {}  # kept request id -> the member that holds it, until it answers

    @property
    def model(self) -> str:
        return self.servers[0].model

    def bind(self, model, tokenizer) -> None:
        """Start every server given a ``launch`` command at once, then bind each (waiting until it answers)."""
        for server in self.servers:
            server.start_server()
        for server in self.servers:
            server.bind(model, tokenizer)

    # ------------------------------------------------------------------ health
    def usable(self) -> list[int]:
        return [i for i, reason in enumerate(self.out_reason) if not reason]

    def healthy(self, i: int) -> bool:
        """Whether server ``i`` answers ``GET /health`` with 200 within ``health_timeout``."""
        try:
            with urllib.request.urlopen(f"{self.urls[i]}/health", timeout=self.health_timeout) as answer:
                return answer.status == 200
        except OSError:  # refused, reset, timed out, HTTP error
            return False

    def take_out(self, i: int, reason: str) -> None:
        if not self.out_reason[i]:
            warnings.warn(f"rollout server {self.urls[i]} taken out of the fleet: {reason}", stacklevel=3)
        self.out_reason[i] = reason

    def bring_back(self) -> None:
        """Servers out that answer again rejoin after reloading the newest weights (single-process runs only:
        in a multi-process run the processes must agree, so they rejoin at the next update)."""
        out = [i for i, reason in enumerate(self.out_reason) if reason]
        if not out or distributed() or (self.gloo and self.version):  # by gloo, weights come only with an update
            return
        with self.lock:
            fresh = self.reload if self.version else (lambda i: "" if self.healthy(i) else "no answer")
            for i, error in zip(out, self.probes.map(fresh, out)):
                if not error:  # otherwise it stays out for the reason it was taken out
                    self.out_reason[i] = ""

    def nobody_left(self) -> ServerError:
        why = "; ".join(f"{url}: {reason}" for url, reason in zip(self.urls, self.out_reason))
        return ServerError(f"no server of the fleet can sample ({why})")

    # ------------------------------------------------------------------ sampling
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 multi_modal=None) -> list[list[Completion]]:
        self.servers[0].check_log_probs(params)
        self.bring_back()
        for s in self.servers:
            s.stats = {"server/retries": 0.0}
        requests, failovers = [0] * len(self.servers), 0
        results: list[list[Completion] | None] = [None] * len(prompts)
        todo = deque(range(len(prompts)))
        pending: dict[Future, tuple[int, int]] = {}  # request -> (prompt index, server index)
        probing: dict[int, Future] = {}  # server -> its health probe in flight
        probed: dict[int, float] = {}  # server -> when its last probe was sent

        def fail_over(i: int, reason: str) -> None:
            nonlocal failovers
            self.take_out(i, reason)
            for future, (p, s) in list(pending.items()):
                if s == i:  # abandoned: a late answer is never read, so the prompt is sampled once
                    del pending[future]
                    todo.appendleft(p)
                    failovers += 1

        while todo or pending:
            depth = [0] * len(self.servers)
            for _, s in pending.values():
                depth[s] += 1
            while todo:
                room = [i for i in self.usable() if depth[i] < self.max_concurrency]
                if not room:
                    break
                i = min(room, key=lambda k: (depth[k], requests[k]))  # queue depth, then spread ties
                p = todo.popleft()
                server = self.servers[i]
                pending[server.pool.submit(server.request, server.generate_path, server.payload(prompts[p], params))] = (p, i)
                depth[i] += 1
                requests[i] += 1
            if todo and not pending:
                raise self.nobody_left()
            done, _ = wait(list(pending), timeout=self.health_interval, return_when=FIRST_COMPLETED)
            for future in done:
                if future not in pending:  # its server was taken out while this loop ran
                    continue
                p, i = pending.pop(future)
                try:
                    per_prompt = self.servers[i].completions(future.result(), params)
                except ServerError as e:
                    if e.status is not None and 400 <= e.status < 500 and e.status not in RETRY_STATUS:
                        raise  # the request's fault (too long, bad options): another server would refuse it too
                    todo.appendleft(p)
                    failovers += 1
                    fail_over(i, f"a request failed: {e}")
                    continue
                if len(per_prompt) != params.n:
                    raise ServerError(f"{self.urls[i]} returned {len(per_prompt)} completions for prompt {p}, "
                                      f"asked for {params.n}")
                results[p] = per_prompt
            self.check_health(pending, probing, probed, fail_over)
        self.stats = {"rollout/servers_healthy": float(len(self.usable())), "rollout/failovers": float(failovers),
                      "server/retries": sum(s.stats.get("server/retries", 0.0) for s in self.servers),
                      **{f"rollout/server{i}/requests": float(n) for i, n in enumerate(requests)}}
        return results

    def check_health(self, pending: dict, probing: dict, probed: dict, fail_over) -> None:
        """Probe each server that holds requests, one probe at a time and at most every ``health_interval``;
        a probe that fails (or takes longer than ``health_timeout``) takes the server out."""
        for i, future in list(probing.items()):
            if future.done():
                del probing[i]
                if not future.result() and not self.out_reason[i]:
                    fail_over(i, f"no answer to GET /health within {self.health_timeout:g} s (dead or hung)")
        now = time.monotonic()
        for i in {s for _, s in pending.values()}:
            if i not in probing and now - probed.get(i, -float("inf")) >= self.health_interval:
                probing[i], probed[i] = self.probes.submit(self.healthy, i), now

    # ------------------------------------------------------------------ weights
    def load_weights(self, buckets: WeightBuckets) -> dict[str, float]:
        """Send the buckets to every server (one gloo broadcast, or a folder written once that each reloads);
        a server that misses the update is taken out."""
        start = time.perf_counter()
        with self.lock:
            errors, metrics, written = [""] * len(self.servers), {}, start
            if self.gloo:
                errors, metrics = self.broadcast_weights(buckets)
            else:
                if self.checkpoint_dir is None:
                    self.checkpoint_dir = shared_temp_dir("rlflow-fleet-weights-")
                metrics = write_checkpoint(buckets, self.checkpoint_dir)
                written = time.perf_counter()
                metrics["weight_sync/write_s"] = written - start
                if writes_checkpoints():
                    errors = list(self.probes.map(self.reload, range(len(self.servers))))
            if distributed():  # rank 0's view decides, so that no process samples from a stale server
                shared = [errors]
                dist.broadcast_object_list(shared, src=0)
                errors = shared[0]
            if self.version == 0 and any(errors):  # at bind: a server that refuses weights is a setup error
                raise ServerError("; ".join(e for e in errors if e))
            self.version += 1
            for i, error in enumerate(errors):
                if error:
                    self.take_out(i, f"missed weight update {self.version}: {error}")
                else:
                    self.out_reason[i] = ""
            if not self.usable():
                raise self.nobody_left()
        return metrics | {"weight_sync/load_s": time.perf_counter() - written,
                          "rollout/servers_synced": float(len(self.usable()))}

    def broadcast_weights(self, buckets: WeightBuckets) -> tuple[list[str], dict[str, float]]:
        """rlflow_gloo: global rank 0 sends the buckets by one broadcast each to the servers that answer
        ``/health`` now (a dead one is left out before the round, and the group is built again without it);
        the other processes only iterate the buckets (gathering sharded weights is collective)."""
        if (dist.get_rank() if distributed() else 0) != 0:
            for _ in buckets:
                pass
            return [""] * len(self.servers), {}
        if self.broadcast is None:
            self.broadcast = FleetBroadcast(self.servers)
        answers = list(self.probes.map(self.healthy, range(len(self.servers))))
        errors = ["" if ok else f"no answer to GET /health within {self.health_timeout:g} s" for ok in answers]
        sent, metrics = self.broadcast.send([i for i, ok in enumerate(answers) if ok], buckets, str(self.version + 1))
        return [e or s for e, s in zip(errors, sent)], metrics | {
            "weight_sync/groups_built": float(self.broadcast.groups_built)}

    def reload(self, i: int) -> str:
        """Have server ``i`` reload the newest weights (its own ``reload``); why it could not (``""``: done).
        A server that does not answer its health check is not asked: a hung one would hold the update up."""
        if not self.healthy(i):
            return f"no answer to GET /health within {self.health_timeout:g} s"
        try:
            self.servers[i].reload(str(self.checkpoint_dir.resolve()))
        except ServerError as e:
            return str(e) or "its reload failed"
        return ""

    # ------------------------------------------------------------------ requests kept across a weight update
    def keep_unavailable(self) -> str | None:
        """``None`` when every member can keep requests across a weight update, else the first one's reason."""
        return next((why for why in (s.keep_unavailable() for s in self.servers) if why), None)

    def submit_kept(self, prompt: list[int], params: SamplingParams, version: int):
        """One prompt's request, on the usable member with the fewest kept requests in flight (then the fewest
        sent): ``(request_id, future of (member, answer))``."""
        with self.lock:
            usable = self.usable()
            if not usable:
                raise self.nobody_left()
            depth = [0] * len(self.servers)
            for i in self.kept_by.values():
                depth[i] += 1
            i = min(usable, key=lambda k: depth[k])
            rid, answer = self.servers[i].submit_kept(prompt, params, version)
            self.kept_by[rid] = i
        held: Future = Future()

        def answered(future: Future) -> None:
            with self.lock:
                self.kept_by.pop(rid, None)
            if future.exception() is not None:
                held.set_exception(future.exception())
            else:
                held.set_result((i, future.result()))

        answer.add_done_callback(answered)
        return rid, held

    def kept_completions(self, answer: tuple[int, dict]) -> list[Completion]:
        member, body = answer
        return self.servers[member].kept_completions(body)

    def label_version(self, version: int) -> None:
        for i in self.usable():
            self.servers[i].label_version(version)

    def update_kept(self, buckets: WeightBuckets, version: int) -> dict[str, float]:
        """Pause every member with its requests kept, load the weights into every member (one that misses them
        or could not be paused is taken out), label the usable ones ``version`` and resume every paused member."""
        start, members = time.perf_counter(), range(len(self.servers))
        # every member: one taken out earlier may still sample its kept requests, and its reload would change
        # the weights under them
        pause_errors = list(self.probes.map(self.ask, members, [PAUSE] * len(self.servers)))
        try:
            metrics = self.load_weights(buckets)
            for i in self.usable():
                if pause_errors[i]:  # its requests ran on while its weights changed: their labels are unsure
                    self.take_out(i, f"could not pause for weight update {self.version}: {pause_errors[i]}")
                    continue
                try:
                    self.servers[i].label_version(version)
                except ServerError as e:
                    self.take_out(i, f"could not label weight update {self.version}: {e}")
        finally:
            held = [i for i in members if not pause_errors[i]]
            for i, error in zip(held, self.probes.map(self.ask, held, ["/resume"] * len(held))):
                if error:
                    self.take_out(i, f"could not resume after weight update {self.version}: {error}")
        if not self.usable():
            raise self.nobody_left()
        return metrics | {"weight_sync/paused_s": time.perf_counter() - start}

    def ask(self, i: int, path: str) -> str:
        """``POST path`` to server ``i`` (once and within ``health_timeout`` if it is out: a dead or hung one
        costs little); why it failed (``""``: done)."""
        out = bool(self.out_reason[i])
        try:
            self.servers[i].request(path, {}, retries=0 if out else None, timeout=self.health_timeout if out else None)
        except ServerError as e:
            return str(e) or f"POST {path} failed"
        return ""

    def abort_kept(self, request_ids: list[str]) -> None:
        """Stop requests nobody will read, each on its member."""
        with self.lock:
            by_member = [[rid for rid in request_ids if self.kept_by.get(rid) == i] for i in range(len(self.servers))]
        for server, rids in zip(self.servers, by_member):
            server.abort_kept(rids)

    def close(self) -> None:
        for server in self.servers:
            server.close()
        self.probes.shutdown(wait=False, cancel_futures=True)
        self.broadcast = None  # its gloo group and store (the servers' workers drop theirs at the next init)
        if self.own_dir and self.checkpoint_dir is not None and writes_checkpoints():
            shutil.rmtree(self.checkpoint_dir, ignore_errors=True)
            self.checkpoint_dir = None
