"""``actor_rollout_ref.rollout.*`` -> the rollout class and its constructor arguments.

``rollout.name`` picks the class (``tables.ROLLOUT_ENGINES``: hf, vllm in-process, sglang; with
``rollout.server.url`` set, vllm and sglang mean a server rollout, ``tables.SERVER_ROLLOUTS``). Every engine
key verl's vLLM rollout reads is either passed to the engine or noted with the reason it changes nothing
here (keys the HF engine has no use for get the notes of ``tables.INERT``).
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

import rlflow
import rlflow.rollout
from rlflow.config.verl import tables
from rlflow.config.verl.devices import Devices
from rlflow.config.verl.loading import ConfigError, NotSupportedError, VerlConfig
from rlflow.rollout.engines.quantization import NEEDS_CUDA, QUANTIZATIONS, server_flags

R = "actor_rollout_ref.rollout"
INSTALL = tables.ENGINE_INSTALL


def rollout_class(cfg: VerlConfig) -> type:
    """The class ``rollout.name`` (and ``rollout.server.url``) ask for; vllm not installed fails at once."""
    name, server = cfg[f"{R}.name"], cfg[f"{R}.server.url"]
    if name not in tables.ROLLOUT_ENGINES:
        raise ConfigError(f"{R}.name={name!r}: unknown engine; choose from {', '.join(tables.ROLLOUT_ENGINES)}")
    package, cls_name = tables.ROLLOUT_ENGINES[name]
    if server:
        if name not in tables.SERVER_ROLLOUTS:
            raise ConfigError(f"{R}.server.url is set but {R}.name={name!r} has no server rollout; use "
                              f"{' or '.join(tables.SERVER_ROLLOUTS)}")
        package, cls_name = None, tables.SERVER_ROLLOUTS[name]
    elif name in tables.SERVER_ROLLOUTS and package is None:
        raise ConfigError(f"{R}.name={name}: rlflow talks to a running {name} server; set {R}.server.url=http://HOST:PORT "
                          f"(and {R}.server.launch='command' to have rlflow start it)")
    if package is not None and importlib.util.find_spec(package) is None:
        raise ConfigError(f"{R}.name={name}: {package} is not installed here. Install it: {INSTALL}. "
                          f"Or generate with transformers: {R}.name=hf")
    cls = getattr(rlflow.rollout, cls_name, None) or getattr(rlflow, cls_name, None)
    if cls is None:
        raise NotSupportedError(f"{R}.name", name, f"the {name} rollout engine", f"Use {R}.name=hf.")
    return cls


def bucket_bytes(cfg: VerlConfig) -> int:
    """verl's weight-update bucket size (MB): ``checkpoint_engine.*`` when set, else ``rollout.*``."""
    newer = f"{R}.checkpoint_engine.update_weights_bucket_megabytes"
    mb = cfg[newer] if cfg.is_provided(newer) else cfg[f"{R}.update_weights_bucket_megabytes"]
    return int(mb * 2**20)


def _note_if_set(cfg: VerlConfig, notes: list[str], key: str, unused: Callable[[Any], bool], reason: str) -> Any:
    value = cfg[key]
    if cfg.is_provided(key) and unused(value):
        notes.append(f"{key}={value!r}: {reason}")
    return value


def vllm_kwargs(cfg: VerlConfig, devices: Devices, notes: list[str]) -> dict:
    """verl's vLLM keys -> ``VLLMRollout``'s engine arguments (or a note saying why one changes nothing)."""
    on_gpu = devices.accelerator == "cuda"
    extra = dict(cfg[f"{R}.engine_kwargs.vllm"] or {})
    for key in ("tensor_model_parallel_size", "tensor_parallel_size", "data_parallel_size", "expert_parallel_size",
                "pipeline_model_parallel_size"):
        _note_if_set(cfg, notes, f"{R}.{key}", lambda v: v is not None and v > 1,
                     "rlflow runs one in-process vLLM engine per training process (each generates for its own "
                     "prompts); engines spanning devices run as a server: set rollout.server.url "
                     "(docs/rollout-engines.md)")
    _note_if_set(cfg, notes, f"{R}.load_format", lambda v: True,
                 "the engine starts from the policy's weights (its folder, or written once) and then receives every "
                 "update in place; vLLM's dummy start would leave rotary caches random after an in-place reload")
    for key, reason in (("multi_stage_wake_up", "the engine wakes in one stage"),
                        ("layered_summon", "weights are gathered in size-bounded buckets "
                                           "(rollout.update_weights_bucket_megabytes)"),
                        ("disable_log_stats", "the in-process engine never logs vLLM statistics")):
        _note_if_set(cfg, notes, f"{R}.{key}", lambda v: True, reason)
    memory = cfg[f"{R}.gpu_memory_utilization"]
    if not on_gpu:
        _note_if_set(cfg, notes, f"{R}.gpu_memory_utilization", lambda v: True,
                     "a fraction of GPU memory; on CPU the KV cache is engine_kwargs.vllm.kv_cache_memory_bytes "
                     "(default 256 MiB)")
    free = _note_if_set(cfg, notes, f"{R}.free_cache_engine", lambda v: v and not on_gpu,
                        "sleeping between generations frees GPU memory; vLLM's CPU backend has no sleep mode")
    capture = cfg[f"{R}.cudagraph_capture_sizes"]
    if capture is not None:
        extra.setdefault("compilation_config", {})["cudagraph_capture_sizes"] = list(capture)
    max_len = cfg[f"{R}.max_model_len"] or cfg["data.max_prompt_length"] + cfg[f"{R}.response_length"]
    return {"dtype": cfg[f"{R}.dtype"], "max_model_len": max_len,
            "gpu_memory_utilization": memory if on_gpu else None, "enforce_eager": cfg[f"{R}.enforce_eager"],
            "max_num_batched_tokens": cfg[f"{R}.max_num_batched_tokens"], "max_num_seqs": cfg[f"{R}.max_num_seqs"],
            "enable_chunked_prefill": cfg[f"{R}.enable_chunked_prefill"],
            "enable_prefix_caching": cfg[f"{R}.enable_prefix_caching"], "free_cache_engine": free,
            "engine_seed": engine_seed(cfg), **({"engine_kwargs": extra} if extra else {})}


def engine_seed(cfg: VerlConfig) -> int:
    """The vLLM engine's seed: verl's ``rollout.seed`` when set, else rlflow's one seed, ``data.seed``."""
    return cfg[f"{R}.seed"] if cfg.is_provided(f"{R}.seed") else cfg["data.seed"]


# engine settings that belong to the server's own command line when the rollout is a server's client
SERVER_SIDE = ("dtype", "gpu_memory_utilization", "enforce_eager", "cudagraph_capture_sizes", "free_cache_engine",
               "tensor_model_parallel_size", "tensor_parallel_size", "data_parallel_size", "expert_parallel_size",
               "pipeline_model_parallel_size", "max_num_batched_tokens", "max_model_len", "max_num_seqs",
               "enable_chunked_prefill", "enable_prefix_caching", "load_format", "engine_kwargs.vllm",
               "engine_kwargs.sglang")


def server_kwargs(cfg: VerlConfig, devices: Devices, notes: list[str]) -> dict:
    """``rollout.server.*`` -> ``ServerRollout``'s arguments; engine settings get a note (they are the server's)."""
    for key in SERVER_SIDE:
        _note_if_set(cfg, notes, f"{R}.{key}", lambda v: True,
                     "a setting of the server: give it to the server's own command line (rollout.server.launch)")
    s = f"{R}.server"
    urls, launch = cfg[f"{s}.url"], cfg[f"{s}.launch"]
    count = len(urls.split(",")) if isinstance(urls, str) else len(urls)
    if count > 1 and launch is not None and (isinstance(launch, str) or len(launch) != count):
        raise ConfigError(f"{s}.url lists {count} servers, so {s}.launch must be a list of {count} commands (null for "
                          f"a server already running), got {launch!r}")
    return {"url": urls, "launch": launch, "max_concurrency": cfg[f"{s}.max_concurrency"],
            "timeout": cfg[f"{s}.timeout"], "retries": cfg[f"{s}.retries"], "checkpoint_dir": cfg[f"{s}.checkpoint_dir"],
            "weight_transfer": cfg[f"{s}.weight_transfer"]}


def checkpoint_engine(cfg: VerlConfig, devices: Devices, notes: list[str], rollout: str) -> str | None:
    """verl's ``rollout.checkpoint_engine.backend`` -> the rollout's ``weight_transfer`` (None: rlflow's default).

    ``naive`` (colocated trainer and rollout) is what rlflow's default transfer does; ``nccl`` (weights broadcast
    over NCCL to a rollout on other GPUs) is vLLM's ``nccl`` weight-transfer backend for a vLLM server, which needs
    CUDA GPUs; the other engines need hardware or a transfer library rlflow's weight transfer does not use, and are
    refused naming it."""
    key = f"{R}.checkpoint_engine.backend"
    backend = cfg[key]
    if backend in tables.CHECKPOINT_ENGINES_ELSEWHERE:
        raise NotSupportedError(key, backend, f"verl's {backend} checkpoint engine, which needs "
                                f"{tables.CHECKPOINT_ENGINES_ELSEWHERE[backend]},",
                                f"rlflow moves weights with vLLM's weight-transfer protocol: use {key}=naive "
                                "(rlflow's default) or nccl (on CUDA GPUs).")
    if backend not in tables.CHECKPOINT_ENGINES:
        raise ConfigError(f"{key}={backend!r}: unknown checkpoint engine; choose from "
                          f"{', '.join([*tables.CHECKPOINT_ENGINES, *tables.CHECKPOINT_ENGINES_ELSEWHERE])}")
    transfer = tables.CHECKPOINT_ENGINES[backend]
    if transfer is None:
        return None
    if devices.accelerator != "cuda":
        raise NotSupportedError(key, backend, "weight transfer over NCCL without CUDA GPUs (NCCL needs them)",
                                f"On CPU use {key}=naive: rlflow's default transfer sends the weights through shared "
                                "memory, or over a gloo group to a server on another machine (rlflow_gloo).")
    if rollout != "ServerRollout":  # the HF rollout and the in-process engine share the trainer's GPU
        where = {"HFRollout": "the HF rollout, which generates with the policy's own module,",
                 "VLLMRollout": "the in-process vLLM engine, which shares the trainer's GPU (it takes them through "
                                "CUDA IPC),",
                 "SGLangRollout": "an SGLang server, which rlflow updates from disk (/update_weights_from_disk),"}
        raise NotSupportedError(key, backend, f"weights over NCCL to {where.get(rollout, rollout)}",
                                f"Use {key}=naive, or a vLLM server on GPUs of its own ({R}.name=vllm, "
                                f"{R}.server.url) for nccl.")
    chosen = f"{R}.server.weight_transfer"
    if cfg.is_provided(chosen) and cfg[chosen] not in ("auto", transfer):
        raise ConfigError(f"{key}={backend} asks for weights over NCCL but {chosen}={cfg[chosen]!r}; set one of them")
    notes.append(f"{key}={backend}: weights go to the vLLM server over NCCL through vLLM's weight-transfer protocol "
                 f"({chosen}={transfer!r}, which auto also picks for a server on CUDA), as verl's nccl engine "
                 "broadcasts them")
    return transfer


QUANTIZED_ELSEWHERE = {"torchao": "torchao's quantized layers (verl's rollout.quantization=torchao, configured by "
                                  "rollout.quantization_config_file)",
                       "ascend": "Ascend NPUs (verl's rollout.quantization=ascend)"}


def quantization(cfg: VerlConfig, devices: Devices, notes: list[str], rollout: str) -> str | None:
    """verl's ``rollout.quantization`` -> ``VLLMRollout(quantization=...)`` (``fp8``, on CUDA GPUs); for a server, a
    note with the flags its command line takes; refused naming what it needs elsewhere."""
    key = f"{R}.quantization"
    value = cfg[key]
    if not value:
        return None
    if value in QUANTIZED_ELSEWHERE:
        raise NotSupportedError(key, value, f"quantized rollouts with {QUANTIZED_ELSEWHERE[value]}",
                                f"rlflow rolls out {', '.join(QUANTIZATIONS)} (on CUDA GPUs).")
    if value not in QUANTIZATIONS:
        raise ConfigError(f"{key}={value!r}: unknown quantization; rlflow rolls out {', '.join(QUANTIZATIONS)} "
                          f"(verl also names {', '.join(QUANTIZED_ELSEWHERE)})")
    if rollout in ("ServerRollout", "SGLangRollout"):
        notes.append(f"{key}={value!r}: a setting of the server: give it to the server's own command line "
                     f"(rollout.server.launch); a vLLM server takes {' '.join(server_flags(value))} "
                     f"(vllm_server_command(..., quantization={value!r}))")
        return None
    if rollout != "VLLMRollout":
        raise NotSupportedError(key, value, f"quantized rollouts with {rollout} (it generates with the policy's own "
                                "weights)", f"{R}.name=vllm rolls out fp8 weights (on CUDA GPUs).")
    if devices.accelerator != "cuda":
        raise NotSupportedError(key, value, "quantized rollouts without a CUDA GPU (trainer.device=cuda)",
                                NEEDS_CUDA.format(missing=f"this run is on {devices.accelerator}") +
                                f". Set {key}=null to roll out in the model's dtype.")
    notes.append(f"{key}={value!r}: vLLM samples from fp8 weights (128x128 blocks, MoE routers kept, as verl) and "
                 "quantizes every weight update itself; the trainer keeps its precision")
    return value


# the engine arguments of each rollout class, by class name
ENGINE_KWARGS: dict[str, Callable[[VerlConfig, Devices, list[str]], dict]] = {
    "VLLMRollout": vllm_kwargs, "ServerRollout": server_kwargs, "SGLangRollout": server_kwargs}


def rollout_plan(cfg: VerlConfig, devices: Devices, notes: list[str], n: int, temperature: float,
                 do_sample: bool) -> tuple[type, dict]:
    """The rollout class and its constructor arguments."""
    cls = rollout_class(cfg)
    kwargs = {"n": n, "temperature": temperature, "top_p": cfg[f"{R}.top_p"], "top_k": cfg[f"{R}.top_k"],
              "max_new_tokens": cfg[f"{R}.response_length"], "do_sample": do_sample}
    if cls.__name__ in ENGINE_KWARGS:
        kwargs |= ENGINE_KWARGS[cls.__name__](cfg, devices, notes) | {"bucket_bytes": bucket_bytes(cfg)}
    quantized = quantization(cfg, devices, notes, cls.__name__)
    if quantized is not None:
        kwargs["quantization"] = quantized
    transfer = checkpoint_engine(cfg, devices, notes, cls.__name__)
    if transfer is not None:
        kwargs["weight_transfer"] = transfer
    if cfg[f"{R}.ignore_eos"]:
        if cls.__name__ != "HFRollout":
            raise NotSupportedError(f"{R}.ignore_eos", True, f"generation past EOS with {cls.__name__}",
                                    f"{R}.name=hf generates past EOS (HFRollout(ignore_eos=True)).")
        kwargs["ignore_eos"] = True
    if cfg[f"{R}.enable_rollout_routing_replay"]:  # validate.rollout_routing refused the rest
        kwargs["return_routed_experts"] = True
        notes.append(f"{R}.enable_rollout_routing_replay=True: the rollout records the MoE experts each token is routed "
                     "to (prompt_routed_experts, routed_experts); the Megatron policy replays them with "
                     "actor.megatron.router_replay.mode=R3")
    return cls, kwargs
