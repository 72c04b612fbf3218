"""verl 0.9.1's keys beyond the tree rlflow first mirrored: what each one does here.

Every leaf key of verl 0.9.1's tree (``config/verl/``) can be set. Those that rlflow reads are honoured
where they are read; the rest are listed here, merged into :mod:`rlflow.config.verl.tables`:

- ``INERT``: accepted, and a note at start-up says the key changes nothing here, and why (an engine,
  placement or profiling knob of a system rlflow does not run);
- ``NOT_SUPPORTED``: accepted at verl's default; set otherwise, refused with the feature it asks for,
  because ignoring it would change what the user gets (another algorithm, another model).

Keys are dotted; ``*`` matches any run of characters (``fnmatch``), so one row covers a subtree.
"""

from __future__ import annotations

from typing import Any, Callable

from rlflow.config.verl.configs import FOREIGN_BLOCKS


def _truthy(v: Any) -> bool:
    return bool(v)


def _not(*ok: Any) -> Callable[[Any], bool]:
    return lambda v: v not in ok


# ------------------------------------------------------------------ actor_rollout_ref.* and critic.*
# Honoured where the plan is built, so not listed here: actor.freeze_vision_tower (Policy), rollout.seed (the vLLM
# engine's seed), model.tokenizer_path / model.hf_config_path and critic.model.hf_config_path (what is loaded),
# actor.fsdp_config.ulysses_sequence_parallel_size and critic.fsdp.ulysses_sequence_parallel_size (verl 0.9's
# names of the sequence-parallel size), critic.fsdp.{param,optimizer}_offload / offload_policy (as
# critic.model.fsdp_config's), critic.loss_scale_factor (ValueLoss).
AR, ACT, ROLL, MOD = "actor_rollout_ref", "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.model"
_ROLES = (ACT, "critic")
_ENGINES = (f"{ACT}.fsdp_config", "critic.fsdp")  # verl 0.9's FSDP engine blocks of the actor and the critic
_REF_ENGINE = f"{AR}.ref.fsdp_config"  # the reference's (tables.INERT notes its other keys: placed like the policy)
_FSDP2 = "an FSDP tuning knob; rlflow's FSDP2 shards every decoder layer with torch's defaults"
_PACKED_OWN = "rlflow computes log-probs and entropy on response tokens only, in its own chunks (rlflow.models.logprobs)"
_SHAPES = "a kernel-shape setting (speed only): rlflow packs each micro-batch to its exact length"
_MEGATRON_SCHEDULE = ("only used with Megatron's schedule: optim.lr_decay_style other than constant, lr_warmup_init "
                      "above 0 or weight_decay_incr_style other than constant (rlflow.trainer.schedule.ParamSchedule)")
_PRECISION_AWARE = ("only used with optim.use_precision_aware_optimizer=True (Megatron's precision-aware optimizer, "
                    "under actor.strategy=megatron); rlflow keeps float32 gradients and AdamW states")
_PRECISION_AWARE_OPTIMIZER = ("only used with actor.strategy=megatron (Megatron's precision-aware optimizer: "
                              "rlflow.strategies.megatron.precision_aware)")
_QAT_ONLY = "only used with this block's qat.enable=True (quantization-aware training: rlflow.config.verl.qat)"
_QAT_ROLLOUT = ("the rollout's copy of the actor's QAT block (verl's vLLM server reads it for NVFP4 kernels); with "
                "actor QAT on, rlflow sends the engine the quantized-dequantized weights, which it runs in its own dtype")
_QAT_OBSERVER = "only used with qat.mode=w4a4 (4-bit activations), which rlflow refuses"
_QAT_VLLM_CONFIG = ("vLLM's NVFP4 quantization config (real FP4 kernels on Blackwell GPUs); rlflow sends the engine "
                    "the quantized-dequantized weights, which it runs in its own dtype (no FP4 kernels)")
_QAT_CRITIC_EXPORT = "a vLLM quantization config for exported weights; the critic is never sent to an engine"
_QAT_REF = ("verl's reference engine is forward-only, where QAT is not applied: the reference scores with the "
            "initial weights unquantized, here as in verl")
_MTP_ROLLOUT = ("the rollout's copy of actor_rollout_ref.model.mtp (verl's engines read enable_rollout and the "
                "speculative keys from it); rlflow reads actor_rollout_ref.model.mtp")
_MTP_DRAFT = ("only used with mtp.enable_rollout=True (speculative decoding drafted by the MTP layers), which rlflow "
              "refuses")
_MTP_CRITIC = "only used with critic.model.mtp.enable=True (a critic with MTP layers), which rlflow refuses"
_MLORA_ONLY = ("only used with model.lora.rank > 0 (verl's Megatron LoRA block, rlflow.config.verl.megatron_lora), which "
               "reads the keys it has a counterpart for")
_TILED = ("a memory setting (TiledMLP computes the same MLP in slices); rlflow runs each MLP whole, and "
          "enable_gradient_checkpointing is its memory knob")
_ROLLOUT_PLACE = ("placement of a separate rollout pool: with a Ray cluster running, rollout.nnodes>0 starts vLLM "
                  "servers on nodes of their own (docs/multi-node.md); without one, rlflow generates on the training "
                  "processes (trainer.n_gpus_per_node x trainer.nnodes), or on a server (rollout.server.url)")

ROLE_INERT: dict[str, str] = {
    # the optimizer: Megatron's scheduler and optimizer knobs (verl's Megatron tree)
    **{f"{r}.optim.{k}": _MEGATRON_SCHEDULE for r in _ROLES
       for k in ("lr_decay_steps", "min_lr", "lr_wsd_decay_style", "lr_wsd_decay_steps")},
    **{f"{r}.optim.use_checkpoint_opt_param_scheduler": "rlflow resumes the LR schedule at the checkpoint's step"
       for r in _ROLES},
    **{f"{r}.optim.{k}": _PRECISION_AWARE for r in _ROLES for k in ("main_grads_dtype", "exp_avg_dtype",
                                                                     "exp_avg_sq_dtype")},
    **{f"{r}.optim.use_precision_aware_optimizer": _PRECISION_AWARE_OPTIMIZER for r in _ROLES},
    **{f"{r}.optim.use_layer_wise_distributed_optimizer": (
        "a memory setting of Megatron's distributed optimizer; rlflow's Trainer keeps each rank's AdamW state "
        "(see megatron.use_distributed_optimizer)") for r in _ROLES},
    **{f"{r}.optim.muon_*": "only used with optim.optimizer=muon (Megatron's Muon), which rlflow does not have"
       for r in _ROLES},
    # the actor and the reference
    f"{ACT}.rollout_n": "filled in from actor_rollout_ref.rollout.n",
    f"{AR}.ref.rollout_n": "filled in from actor_rollout_ref.rollout.n",
    f"{ACT}.policy_loss.dro_beta": "only used with policy_loss.loss_mode=dro, not supported yet",
    f"{ACT}.calculate_entropy": "rlflow always computes the entropy in the update pass and logs actor/entropy",
    f"{ACT}.calculate_sum_pi_squared": ("only used by the optimal-token-baseline estimators "
                                        "(algorithm.adv_estimator=optimal_token_baseline), not supported yet"),
    f"{ACT}.use_prefix_grouper": ("a speed setting (same results): rlflow's padded log-prob passes "
                                  "(model.use_remove_padding=False) run each distinct prompt once "
                                  "(rlflow.models.shared_prompt)"),
    f"{ACT}.use_remove_padding": "filled in from actor_rollout_ref.model.use_remove_padding, which rlflow reads",
    **{f"{r}.entropy_from_logits_chunk_size": _PACKED_OWN for r in (ACT, f"{AR}.ref")},
    **{f"{r}.pad_to_length": _SHAPES for r in (ACT, f"{AR}.ref")},
    # verl 0.9's FSDP engine blocks (actor.fsdp_config.*, critic.fsdp.*); the offload keys are read
    **{f"{e}.{k}": v for e in _ENGINES + (_REF_ENGINE,) for k, v in {
        "use_orig_params": "an FSDP1 setting; rlflow's FSDP2 (fully_shard) always keeps the original parameters",
        "seed": "rlflow seeds every role from data.seed, its one seed (with full_determinism too)",
        "entropy_from_logits_with_chunking": _PACKED_OWN, "entropy_from_logits_chunk_size": _PACKED_OWN,
        "entropy_checkpointing": _PACKED_OWN,
        "use_torch_compile": "rlflow's chunked log-prob kernel is not compiled",
        "use_no_sync_for_gradient_accumulation": ("a gradient-sync timing setting (speed and memory only): rlflow's "
                                                  "FSDP2 reduces the gradients of every micro-batch, as verl's "
                                                  "default does"),
        "pad_to_length": _SHAPES, "pad_to_length_bucket": _SHAPES,
        "forward_only": "verl sets it for scoring-only engines; rlflow's reference is a frozen copy of the policy",
        "strategy": "taken from the role's strategy key (verl overwrites it the same way)",
        "dtype": "the compute precision is trainer.precision (bf16-mixed on GPU, 32-true on CPU)",
        "qat.*": _QAT_ONLY,
        "turbo_config.*": "only used by verl's fsdp_turbo engine, which rlflow refuses (strategy=fsdp_turbo)",
    }.items()},
    **{f"critic.fsdp.{k}": _FSDP2 for k in ("wrap_policy.*", "reshard_after_forward", "fsdp_size",
                                             "forward_prefetch")},
    "critic.fsdp.model_dtype": "parameters stay float32; trainer.precision sets compute",
    f"{_REF_ENGINE}.model_dtype": "the reference is a frozen copy of the policy, in the policy's dtype",
    f"{_REF_ENGINE}.optimizer_offload": "the frozen reference has no optimizer",
    f"{ACT}.qat.*": _QAT_ONLY, f"{ROLL}.qat.*": _QAT_ROLLOUT,
    **{f"{b}.qat.*": _QAT_ONLY for b in (f"{ACT}.megatron", "critic.megatron")},
    **{f"{b}.qat.{k}": v for b in (ACT, f"{ACT}.fsdp_config", f"{ACT}.megatron", "critic.fsdp", "critic.megatron")
       for k, v in (("activation_observer", _QAT_OBSERVER), ("quantization_config_path", _QAT_VLLM_CONFIG
                                                               if b.startswith(ACT) else _QAT_CRITIC_EXPORT))},
    **{f"{AR}.ref.{e}.qat.*": _QAT_REF for e in ("fsdp_config", "megatron")},
    # the rollout
    f"{ROLL}.seed": ("with name=vllm, the engine's seed; the HF rollout samples from the trainer's random stream, "
                     "seeded by data.seed (rlflow's one seed)"),
    f"{ROLL}.nnodes": _ROLLOUT_PLACE, f"{ROLL}.n_gpus_per_node": _ROLLOUT_PLACE,
    f"{ROLL}.logprobs_mode": ("rlflow's engines always report the temperature-scaled, untruncated log-probs the "
                              "Policy recomputes (rlflow.rollout.engines)"),
    f"{ROLL}.scheduling_policy": ("vLLM's request order; rlflow submits each generation as one batch, so its "
                                  "results do not depend on it"),
    f"{ROLL}.router_config_path": ("verl's router across rollout server replicas; rlflow's server rollout balances "
                                   "the servers listed in rollout.server.url itself"),
    f"{ROLL}.checkpoint_engine.engine_kwargs": ("arguments of verl's own checkpoint engines; rlflow's weight transfer "
                                                "(checkpoint_engine.backend=naive or nccl) takes none"),
    f"{ROLL}.checkpoint_engine.custom_backend_module": ("a module registering verl checkpoint engines; "
                                                        "checkpoint_engine.backend names rlflow's (naive or nccl)"),
    f"{ROLL}.engine_kwargs.trtllm": "TensorRT-LLM's engine arguments; rlflow has no TensorRT-LLM rollout (name=trtllm)",
    f"{ROLL}.multi_turn.num_repeat_rollouts": "verl 0.9.1 itself never reads it; samples per prompt are rollout.n",
    **{f"{r}.profiler.*": "profiling is not supported yet" for r in (ACT, f"{AR}.ref", ROLL, "critic")},
    f"{ROLL}.skip_tokenizer_init": "rlflow's vLLM engine always starts with skip_tokenizer_init=True (token ids in and out)",
    f"{ROLL}.moe_load_balance_metrics_interval": ("verl's MoE load-balance metrics of the rollout's routing: rlflow "
                                                  "logs none"),
    f"{ROLL}.prometheus.*": ("rlflow exports no Prometheus metrics of its rollout engine; its metrics go to "
                             "trainer.logger"),
    f"{ROLL}.quantization_config_file": ("only used with rollout.quantization=torchao (a torchao config), which rlflow "
                                         "does not roll out; fp8 takes no file"),
    f"{ROLL}.mtp.*": _MTP_ROLLOUT,
    f"{ROLL}.disaggregation.*": "only used with disaggregation.enabled=True, which rlflow refuses",
    # the models
    f"{MOD}.tiled_mlp.*": _TILED, "critic.model.tiled_mlp.*": _TILED,
    # model.mtp.{enable, enable_train, detach_encoder, mtp_loss_scaling_factor}: read by megatron.mtp_options under
    # the Megatron strategy (validate.multi_token_prediction refuses enable=True otherwise, and enable_rollout)
    f"{MOD}.mtp.*": "only used with actor_rollout_ref.actor.strategy=megatron (megatron-core's MTP block)",
    **{f"{MOD}.mtp.{k}": _MTP_DRAFT for k in ("speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
                                             "speculative_num_draft_tokens", "method", "num_speculative_tokens")},
    "critic.model.mtp.*": _MTP_CRITIC,
    f"{MOD}.lora.*": _MLORA_ONLY, "critic.model.lora.*": _MLORA_ONLY,
    "critic.model.custom_chat_template": ("the critic scores the policy's token ids; prompts are rendered once, with "
                                          "actor_rollout_ref.model.custom_chat_template"),
    "critic.model.exclude_modules": "only used with LoRA on the critic: critic.model.lora_rank > 0",
    "critic.nccl_timeout": "process groups use rlflow's own time-out (rlflow.strategies.DEFAULT_TIMEOUT)",
}

ROLE_NOT_SUPPORTED: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "critic.model.mtp.enable": ("multi-token prediction layers on the critic (verl trains them on the actor only)",
                                _truthy),
    f"{ROLL}.disaggregation.enabled": ("prefill/decode disaggregation (rollout.disaggregation: separate prefill "
                                       "and decode replicas of SGLang/vLLM servers on GPUs, their KV caches moved "
                                       "by a transfer backend such as NIXL over RDMA)", _truthy),
}

# ------------------------------------------ data, reward_model, algorithm, trainer and the other sections
_RM_SERVER = ("a setting of verl's reward-model servers (the legacy name of reward.reward_model.*); rlflow's "
              "reward model (reward_model.model.path) scores in the training processes with transformers")
_TEACHER_PLACE = ("placement of verl's teacher pool; rlflow's teacher runs in the training processes "
                  "(trainer.n_gpus_per_node x trainer.nnodes), as the reference does")
_V1_ASYNC = ("only used with that trainer.v1.trainer_mode (colocate_async / separate_async: FullyAsyncRollout's "
             "num_warmup_batches)")
RUN_INERT: dict[str, str] = {
    "data.audio_key": "audio inputs are not supported yet (images are: data.image_key)",
    **{f"reward_model.{k}": _RM_SERVER for k in ("enable_resource_pool", "n_gpus_per_node", "nnodes", "rollout.*")},
    **{f"reward_model.reward_loop_{k}": "only used with reward_model.reward_loop_source=importlib"
       for k in ("module_path", "class_name")},
    **{f"sandbox_fusion.{k}": "only used with a SandboxFusion url (sandbox_fusion.url, reward.sandbox_fusion.url)"
       for k in ("max_concurrent", "memory_limit_mb")},
    "algorithm.filter_groups.max_inflight_gen_batches": (
        "bounds how many prompt batches verl's V1 trainer generates at once for DAPO (surplus groups are "
        "discarded); rlflow's DynamicSampling generates one data.train_batch_size batch at a time, as verl's default 1"),
    "distillation.*": "only used with distillation.enabled=True",
    **{f"distillation.{k}": _TEACHER_PLACE for k in ("n_gpus_per_node", "nnodes")},
    "distillation.distillation_loss.topk": "only used with distillation_loss.loss_mode=forward_kl_topk",
    "distillation.distillation_loss.log_prob_min_clamp": (
        "only used with distillation_loss.loss_mode=forward_kl_topk (it clamps the top-k log-probs); the "
        "single-token estimators (k1, k3, ...) do not read it, there as in verl"),
    "distillation.distillation_loss.distillation_loss_coef": (
        "only used with distillation_loss.use_task_rewards=True (the distillation term alone has weight 1, as in verl)"),
    **{f"distillation.distillation_loss.{k}": "only used with distillation_loss.use_policy_gradient=True"
       for k in ("policy_loss_mode", "clip_ratio", "clip_ratio_low", "clip_ratio_high")},
    "transfer_queue.*": "verl's TransferQueue is a Ray data store between its workers; rlflow passes batches in memory",
    "trainer.v1.sync": "verl V1's sync mode takes no options",
    "trainer.v1.colocate_async.*": _V1_ASYNC, "trainer.v1.separate_async.*": _V1_ASYNC,
    "trainer.v1.separate_async.parameter_sync_step": (
        "rlflow pushes weights once per step of data.train_batch_size prompts, which verl's invariant "
        "train_batch_size = parameter_sync_step x ppo_mini_batch_size makes the same cadence; the step's mini-batches "
        "are trained once its batch is complete, not streamed one by one"),
    "trainer.v1.separate_async.hybrid_rollout.*": ("lends idle trainer GPUs to generation; rlflow's trainer and "
                                                   "engine keep their own devices"),
    "trainer.v1.sampler.max_off_policy_*": ("verl V1's staleness bound for its asynchronous modes (FullyAsyncRollout); "
                                            "in sync mode every sample comes from the current weights"),
    "trainer.v1.sampler.sync_refill_failed_groups": ("replaces groups whose generation failed; rlflow's rollout "
                                                     "returns every group (a failing generation stops the step)"),
    "skip.*": "only used with skip.*.enable=True (replaying dumped rollouts: rlflow.rollout.ReplayRollout)",
}
RUN_NOT_SUPPORTED: dict[str, tuple[str, Callable[[Any], bool]]] = {}  # sandbox_fusion.* is read (config.verl.rewards)

# ------------------------------------------------------------------ verl's other engines and open blocks
_PRECISION = "parameters stay float32; trainer.precision sets the compute precision (FSDP2's mixed precision follows it)"
OTHER_INERT: dict[str, str] = {
    "*.mixed_precision": _PRECISION, "*.mixed_precision.*": _PRECISION,
    **{block: f"only used by verl's {name} engine, which rlflow does not have" for block, name in FOREIGN_BLOCKS.items()},
    "distillation.teacher_models.*": "only used with distillation.enabled=True",
    "distillation.teacher_models.*.num_replicas": _TEACHER_PLACE,
    "distillation.teacher_models.*.inference.*": (
        "a setting of verl's teacher inference servers; rlflow's teacher scores the samples with transformers in "
        "the training processes, one forward pass like the reference's (rlflow.models.teacher)"),
}
OTHER_NOT_SUPPORTED: dict[str, tuple[str, Callable[[Any], bool]]] = {
    f"{block}.*": (f"settings of verl's {name} engine, a backend rlflow does not have (rlflow trains with "
                   "fsdp/fsdp2 or megatron)", lambda v: True) for block, name in FOREIGN_BLOCKS.items()
}

INERT = ROLE_INERT | RUN_INERT | OTHER_INERT
NOT_SUPPORTED = ROLE_NOT_SUPPORTED | RUN_NOT_SUPPORTED | OTHER_NOT_SUPPORTED
