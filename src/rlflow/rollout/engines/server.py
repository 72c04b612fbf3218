"""ServerEngine: sampling from an OpenAI-compatible completions server (vLLM, SGLang, TGI, ...) over HTTP.

Each prompt is one ``POST /v1/completions`` request with the prompt as token ids, ``n`` samples and
``logprobs``; at most ``max_concurrency`` requests are in flight. A request that times out, cannot connect or
gets a 5xx/429 answer is sent again after ``backoff * 2**attempt`` seconds, up to ``retries`` times; its
result is stored under the prompt's index, so a retried request can neither lose nor duplicate samples.

Weights reach a vLLM server through its weight-transfer endpoints (``/init_weight_transfer_engine`` once, then
``/start_weight_update``, ``/update_weights`` per bucket, ``/finish_weight_update``) when it was started with
``--weight-transfer-config`` (:func:`~rlflow.rollout.server.vllm_server_command` does; on CPU the buckets
travel through shared memory, :mod:`rlflow.rollout.engines.weight_transfer`), then ``POST /reset_prefix_cache``.
Otherwise (said once) through the disk: the buckets are written as a checkpoint folder
(``checkpoint_dir``, which the server must be able to read), then the server reloads it in place. vLLM does
this with ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`` and
``POST /reset_prefix_cache`` (all of these only when the server runs with ``VLLM_SERVER_DEV_MODE=1``); SGLang with
``POST /update_weights_from_disk`` and ``POST /flush_cache`` (:class:`SGLangEngine`). A server without such an
endpoint is refused with a message that says so.

**Log-probs.** A server reports the distribution of its ``--logprobs-mode``: vLLM's default ``raw_logprobs``
is before temperature (equal to what the Policy recomputes at ``T = 1``), ``processed_logprobs`` is after
temperature *and* top-k/top-p truncation (equal when nothing is truncated). ``logprobs_mode`` tells the engine
which one the server uses; a combination that cannot match the Policy gets a warning.

**Requests kept across a weight update** (vLLM 0.32, for :class:`~rlflow.rollout.FullyAsyncRollout`):
``submit_kept`` sends one prompt's ``n`` samples to ``POST /inference/v1/generate`` (token ids in and out; the
server needs ``--enable-scale-out``); ``update_kept`` pauses the server with ``POST /pause?mode=keep`` (the
requests in flight are frozen, their KV cache kept), loads the weights as ``load_weights`` does, labels them
with rlflow's version (``/update_weight_version``) and resumes (``/resume``): the frozen requests go on under the
new weights. vLLM reports per response which label's weights sampled which tokens (``weight_versions`` spans),
so each token carries the version that sampled it, exactly, and its log-prob from those weights. The KV of the
tokens before the pause stays the old weights' (not recomputed: verl and vLLM accept that). Requests are salted
(``cache_salt``) with the version they were sent under, so a request sent after an update never reuses
prefix-cache blocks of older weights (``/reset_prefix_cache`` cannot drop them while requests hold blocks).
"""

from __future__ import annotations

import atexit
import json
import shutil
import time
import uuid
import urllib.error
import urllib.request
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rlflow.rollout.engines.base import Completion, Engine, SamplingParams, WeightBuckets
from rlflow.rollout.engines.weights_on_disk import barrier, shared_temp_dir, write_checkpoint, writes_checkpoints
from rlflow.rollout.engines.errors import ServerError  # noqa: F401 - importable from here, as before
from rlflow.rollout.engines.launch import VLLM_SERVER_ENV, ServerProcess
from rlflow.rollout.engines.weight_transfer import server_sender

RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
KEPT_PATH = "/inference/v1/generate"  # vLLM's token-in/token-out endpoint: it reports weight_versions per response


class ServerEngine(Engine):
    """Samples from an OpenAI-compatible ``/v1/completions`` server.

    Args:
        url: the server's base URL, e.g. ``http://127.0.0.1:8000``.
        model: the served model's name (default: the first of ``GET /v1/models``).
        max_concurrency: requests in flight at once.
        timeout: seconds to wait for one response.
        retries, backoff: re-sends of a failed request (time-out, refused connection, 5xx, 429), waiting
            ``backoff * 2**attempt`` seconds before attempt ``attempt + 1``.
        checkpoint_dir: where weights are written for the server to reload (default: a temporary folder;
            a server on another machine needs a shared path).
        eos_token_ids: stop tokens sent with every request besides the sampling parameters' own (default: the
            tokenizer's EOS, from :meth:`bind`; none when never bound).
        logprobs_mode: the server's ``--logprobs-mode`` (vLLM): ``"raw_logprobs"`` (vLLM's default) or
            ``"processed_logprobs"``.
        weight_transfer: ``"auto"`` (vLLM's weight-transfer protocol where the server takes it, else the disk),
            a backend name, or ``"reload"`` (always the disk).
        launch: a command that starts the server (:class:`~rlflow.rollout.engines.launch.ServerProcess`): started
            by :meth:`bind`, which waits until it answers; stopped by :meth:`close` and at exit.

    Nothing is contacted when the engine is built: :meth:`bind` (or the first request) starts the server it was
    given a ``launch`` for and asks the served model's name (``GET /v1/models``) unless ``model`` was given.
    """

    holds_own_weights = True
    remote = True  # it samples in the server: AsyncRollout drives it from a thread, not a child process
    generate_path = "/v1/completions"
    speaks_vllm_protocol = True

    def __init__(self, url: str, *, model: str | None = None, max_concurrency: int = 64, timeout: float = 600.0,
                 retries: int = 3, backoff: float = 0.5, checkpoint_dir: str | Path | None = None,
                 eos_token_ids: tuple[int, ...] | None = None, logprobs_mode: str = "raw_logprobs",
                 weight_transfer: str | None = "auto", launch: str | list[str] | None = None):
        self.url, self.launch, self.server = url.rstrip("/"), launch, None
        self.weight_transfer, self.sender = weight_transfer if self.speaks_vllm_protocol else None, None
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.given_eos = None if eos_token_ids is None else tuple(eos_token_ids)
        self.eos_token_ids, self.logprobs_mode = self.given_eos or (), logprobs_mode
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.own_dir = checkpoint_dir is None  # a temporary folder of ours: removed by close() (and at exit)
        atexit.register(self.close)
        self.pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="rlflow-server")
        self.stats = {"server/retries": 0.0}
        self.answered = False  # once it has, a refused connection means it died, not a wrong URL
        self.served = model  # the served model's name; asked from the server when first needed

    @property
    def model(self) -> str:
        """The served model's name (``model=``, else the first of ``GET /v1/models``, asked once)."""
        if self.served is None:
            self.served = self.served_model()
        return self.served

    def bind(self, model, tokenizer) -> None:
        """Start the server (``launch``) and wait until it answers, ask its model's name, and stop on the
        tokenizer's EOS (unless ``eos_token_ids`` were given). The server keeps its own weights: the rollout
        sends ``model``'s with :meth:`load_weights`."""
        self.start_server()
        if self.server is not None:
            self.server.wait()
        if self.given_eos is None and tokenizer is not None:
            eos = tokenizer.eos_token_id
            self.eos_token_ids = () if eos is None else (eos,)
        self.model  # an unreachable server is named now, not at the first request

    def start_server(self) -> None:
        """Start the ``launch`` command (once), without waiting for it (a fleet starts all its servers at once)."""
        if self.launch and self.server is None:
            self.server = ServerProcess(self.launch, self.url, env=VLLM_SERVER_ENV)

    # ------------------------------------------------------------------ HTTP
    def request(self, path: str, payload: dict | None = None, *, method: str = "POST", timeout: float | None = None,
                retries: int | None = None):
        """One JSON request with retries (``self.retries`` by default); returns the decoded answer (``None`` for
        an empty body)."""
        url, data = f"{self.url}{path}", None if payload is None else json.dumps(payload).encode()
        retries = self.retries if retries is None else retries
        for attempt in range(retries + 1):
            req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=timeout or self.timeout) as answer:
                    body = answer.read()
                self.answered = True
                return json.loads(body) if body.strip() else None
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")[:500]
                if e.code not in RETRY_STATUS or attempt == retries:
                    raise ServerError(f"{method} {url} failed: HTTP {e.code}: {detail}", e.code) from None
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                if attempt == retries:
                    reason = getattr(e, "reason", e)
                    hint = ("it answered earlier in this run, so it died or hung: check its log and its machine's "
                            "memory (several servers, a list of URLs, survive one's death)"
                            if self.answered else "is it running, and is the URL right?")
                    raise ServerError(f"cannot reach the server at {self.url} ({method} {path}: {reason}) after "
                                      f"{retries + 1} attempts: {hint}") from None
            self.stats["server/retries"] += 1
            time.sleep(self.backoff * 2**attempt)

    def served_model(self) -> str:
        models = self.request("/v1/models", method="GET", timeout=min(self.timeout, 30.0))
        try:
            return models["data"][0]["id"]
        except (TypeError, KeyError, IndexError):
            raise ServerError(f"GET {self.url}/v1/models did not list a model ({str(models)[:200]}); pass model=...")

    # ------------------------------------------------------------------ sampling
    def check_log_probs(self, params: SamplingParams) -> None:
        """Warn when the server's log-probs cannot be the temperature-scaled, untruncated ones."""
        raw_off = self.logprobs_mode == "raw_logprobs" and params.scale_temperature != 1.0
        processed_off = self.logprobs_mode == "processed_logprobs" and params.truncates
        if raw_off or processed_off:
            warnings.warn(f"the server at {self.url} reports {self.logprobs_mode}, which differ from the Policy's "
                          f"log-probs at temperature {params.temperature} with top_k={params.top_k}, "
                          f"top_p={params.top_p}: rollout_log_probs are approximate (see docs/rollout-engines.md)",
                          stacklevel=3)

    def payload(self, prompt: list[int], params: SamplingParams) -> dict:
        stops = list(self.eos_token_ids) + [t for t in params.stop_token_ids if t not in self.eos_token_ids]
        body = {"model": self.model, "prompt": prompt, "n": params.n, "max_tokens": params.max_new_tokens,
                "temperature": 0.0 if params.greedy else params.temperature, "top_p": params.top_p,
                "top_k": params.top_k, "logprobs": 0, "stop_token_ids": stops, "return_token_ids": True,
                "skip_special_tokens": False}
        if params.seed is not None:
            body["seed"] = params.seed
        return body

    def completions(self, answer: dict, params: SamplingParams) -> list[Completion]:
        """An OpenAI completions answer -> its ``n`` completions in order (token ids from ``token_ids``, vLLM's
        ``return_token_ids``, or from ``token_id:N`` strings)."""
        out = []
        for choice in sorted(answer["choices"], key=lambda c: c["index"]):
            lp = choice.get("logprobs") or {}
            ids = choice.get("token_ids")
            if ids is None:
                tokens = lp.get("tokens") or []
                if not all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
                    raise ServerError(f"{self.url} returned no token ids (it needs vLLM's return_token_ids or "
                                      "return_tokens_as_token_ids): rlflow cannot train on text alone")
                ids = [int(t.split(":", 1)[1]) for t in tokens]
            log_probs = lp.get("token_logprobs")
            if log_probs is None or len(log_probs) != len(ids):
                raise ServerError(f"{self.url} returned {len(log_probs or [])} log-probs for {len(ids)} tokens")
            reason = "length" if choice.get("finish_reason") == "length" else "stop"
            out.append(Completion(list(ids), [float(x) for x in log_probs], reason))
        return out

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        self.check_log_probs(params)
        self.stats = {"server/retries": 0.0}  # per call: the Trainer logs it with the step
        futures = [self.pool.submit(self.request, self.generate_path, self.payload(p, params)) for p in prompts]
        results = [self.completions(f.result(), params) for f in futures]  # in prompt order
        for i, per_prompt in enumerate(results):
            if len(per_prompt) != params.n:
                raise ServerError(f"{self.url} returned {len(per_prompt)} completions for prompt {i}, asked for {params.n}")
        return results

    # ------------------------------------------------------------------ weights
    def load_weights(self, buckets: WeightBuckets) -> dict[str, float]:
        """Send the buckets through vLLM's weight-transfer protocol, or write them as a checkpoint folder and
        have the server reload it (one process asks)."""
        start = time.perf_counter()
        if self.weight_transfer is not None and self.sender is None:  # decided once, at the first update
            self.sender = server_sender(self, self.weight_transfer) or False
        if self.sender:
            metrics = self.sender.send(buckets)
            if writes_checkpoints():
                self.request("/reset_prefix_cache", {})
            barrier()  # no process samples before the server holds the new weights
            return metrics | {"weight_sync/load_s": time.perf_counter() - start}
        if self.checkpoint_dir is None:  # created on first use, so a server that never trains writes nothing
            self.checkpoint_dir = shared_temp_dir("rlflow-server-weights-")
        metrics = write_checkpoint(buckets, self.checkpoint_dir)
        written = time.perf_counter()
        if writes_checkpoints():
            self.reload(str(self.checkpoint_dir.resolve()))
        barrier()  # no process samples before the server holds the new weights
        return metrics | {"weight_sync/write_s": written - start, "weight_sync/load_s": time.perf_counter() - written}

    # ------------------------------------------------------------------ requests kept across a weight update
    def keep_unavailable(self) -> str | None:
        """Why this server cannot keep requests across a weight update (``None``: it can): it needs vLLM's RL
        endpoints (``/pause``, ``VLLM_SERVER_DEV_MODE=1``) and ``/inference/v1/generate`` (``--enable-scale-out``)."""
        if not self.speaks_vllm_protocol:
            return f"{type(self).__name__} has no /pause?mode=keep"
        for path, payload, needs in (
                ("/is_paused", None, "vLLM's RL endpoints (/pause, /resume: VLLM_SERVER_DEV_MODE=1)"),
                (KEPT_PATH, {"token_ids": [0], "sampling_params": {"max_tokens": 1}},
                 f"{KEPT_PATH} (vLLM >= 0.32 started with --enable-scale-out)")):
            try:
                self.request(path, payload, method="GET" if payload is None else "POST", retries=0)
            except ServerError as e:
                return f"the server at {self.url} has no {needs}: {str(e)[:200]}"
        return None

    def submit_kept(self, prompt: list[int], params: SamplingParams, version: int):
        """One prompt's ``params.n`` samples as one request kept across weight updates: a future of
        ``(request_id, answer)``, read with :meth:`kept_completions`."""
        stops = list(self.eos_token_ids) + [t for t in params.stop_token_ids if t not in self.eos_token_ids]
        sampling = {"n": params.n, "max_tokens": params.max_new_tokens,
                    "temperature": 0.0 if params.greedy else params.temperature, "top_p": params.top_p,
                    "top_k": params.top_k, "logprobs": 0, "stop_token_ids": stops, "ignore_eos": params.ignore_eos,
                    "skip_special_tokens": False, "detokenize": False}
        if params.seed is not None:
            sampling["seed"] = params.seed
        rid = f"rlflow-{uuid.uuid4().hex}"
        body = {"token_ids": list(prompt), "sampling_params": sampling, "request_id": rid,
                "cache_salt": f"rlflow-v{version}"}  # no prefix-cache hit on blocks of other weights
        return rid, self.pool.submit(self.request, KEPT_PATH, body)

    def kept_completions(self, answer: dict) -> list[Completion]:
        """A ``/inference/v1/generate`` answer -> its completions, each with ``extras["token_versions"]``: per
        token, the version (the label ``update_kept`` gave) of the weights that sampled it."""
        out = []
        for choice in sorted(answer["choices"], key=lambda c: c["index"]):
            ids, content = choice["token_ids"] or [], (choice.get("logprobs") or {}).get("content") or []
            if len(content) != len(ids):
                raise ServerError(f"{self.url}{KEPT_PATH} returned {len(content)} log-probs for {len(ids)} tokens")
            versions: list[int | None] = [None] * len(ids)
            for span in choice.get("weight_versions") or []:
                try:
                    label = int(span["version"])
                except ValueError:
                    raise ServerError(f"{self.url} labelled tokens with weight version {span['version']!r}, not "
                                      "one of rlflow's (another client updated its weights?)") from None
                versions[span["start"]:span["end"]] = [label] * (span["end"] - span["start"])
            if None in versions:
                raise ServerError(f"{self.url} did not say which weights sampled every token (weight_versions: "
                                  f"{choice.get('weight_versions')}, {len(ids)} tokens)")
            if choice.get("finish_reason") == "abort":
                raise ServerError(f"{self.url} aborted a request (another client's /abort_requests or /pause?mode="
                                  "abort?): its samples are lost to this run")
            reason = "length" if choice.get("finish_reason") == "length" else "stop"
            out.append(Completion(list(ids), [float(c["logprob"]) for c in content], reason,
                                  extras={"token_versions": versions}))
        return out

    def label_version(self, version: int) -> None:
        """Name the server's current weights ``version`` (vLLM labels the tokens they sample with it)."""
        self.request("/update_weight_version", {"new_version": str(version)})

    def update_kept(self, buckets: WeightBuckets, version: int) -> dict[str, float]:
        """Load weights with the requests in flight frozen, their KV cache kept (``/pause?mode=keep``), and
        continue them under the new weights, labelled ``version``."""
        start = time.perf_counter()
        # clear_cache=false: with it, vLLM would preempt the frozen requests and recompute them instead
        self.request("/pause?mode=keep&clear_cache=false", {})
        try:
            metrics = self.load_weights(buckets)
            self.label_version(version)
        finally:
            self.request("/resume", {})
        return metrics | {"weight_sync/paused_s": time.perf_counter() - start}

    def abort_kept(self, request_ids: list[str]) -> None:
        """Stop requests nobody will read (a stopped run)."""
        if request_ids:  # vLLM 0.32 names a /inference/v1/generate request "generate-tokens-<ours>"
            ids = [i for rid in request_ids for i in (rid, f"generate-tokens-{rid}")]
            self.request("/abort_requests", {"request_ids": ids}, retries=0)

    def reload(self, folder: str) -> None:
        """vLLM (``VLLM_SERVER_DEV_MODE=1``): reload in place, then drop the prefix cache of the old weights."""
        try:
            self.request("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": folder}})
        except ServerError as e:
            if "HTTP 404" in str(e):
                raise ServerError(f"the server at {self.url} has no weight-update endpoint (/collective_rpc): start "
                                  "vLLM with VLLM_SERVER_DEV_MODE=1; servers without one (TGI, ...) cannot receive "
                                  "trained weights, so rlflow cannot train through them") from None
            raise
        self.request("/reset_prefix_cache", {})

    def close(self) -> None:
        """Close the connection pool and stop a server this engine started."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.server is not None:
            self.server.stop()
        if self.own_dir and self.checkpoint_dir is not None and writes_checkpoints():
            shutil.rmtree(self.checkpoint_dir, ignore_errors=True)
            self.checkpoint_dir = None


class SGLangEngine(ServerEngine):
    """An SGLang server: sampling through ``/generate`` (token ids in and out, with log-probs), weight updates
    through ``/update_weights_from_disk`` then ``/flush_cache``. Written from SGLang's documented API; not run
    in rlflow's tests (SGLang could not be installed on the CPU machines they run on)."""

    generate_path = "/generate"
    speaks_vllm_protocol = False  # weights through /update_weights_from_disk

    def served_model(self) -> str:
        info = self.request("/get_model_info", method="GET", timeout=min(self.timeout, 30.0))
        return str((info or {}).get("model_path", ""))

    def payload(self, prompt: list[int], params: SamplingParams) -> dict:
        stops = list(self.eos_token_ids) + [t for t in params.stop_token_ids if t not in self.eos_token_ids]
        sampling = {"n": params.n, "max_new_tokens": params.max_new_tokens,
                    "temperature": 0.0 if params.greedy else params.temperature, "top_p": params.top_p,
                    "top_k": params.top_k, "stop_token_ids": stops, "skip_special_tokens": False}
        if params.seed is not None:
            sampling["sampling_seed"] = params.seed
        return {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True}

    def completions(self, answer, params: SamplingParams) -> list[Completion]:
        out = []
        for sample in answer if isinstance(answer, list) else [answer]:
            meta = sample["meta_info"]
            pairs = meta["output_token_logprobs"]  # [[log_prob, token_id, text], ...]
            reason = (meta.get("finish_reason") or {}).get("type")
            out.append(Completion([int(p[1]) for p in pairs], [float(p[0]) for p in pairs],
                                  "length" if reason == "length" else "stop"))
        return out

    def reload(self, folder: str) -> None:
        try:
            answer = self.request("/update_weights_from_disk", {"model_path": folder})
        except ServerError as e:
            if "HTTP 404" in str(e):
                raise ServerError(f"the server at {self.url} has no /update_weights_from_disk endpoint") from None
            raise
        if not (answer or {}).get("success", False):
            raise ServerError(f"{self.url}/update_weights_from_disk refused the weights in {folder}: {answer}")
        self.request("/flush_cache", {})
