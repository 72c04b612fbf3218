"""verl's Megatron keys -> a :class:`~rlflow.strategies.megatron.MegatronStrategy`.

(Translating verl's keys is config's job, so this lives under ``config/``: ``strategies/`` never imports
``config/``. It was ``rlflow.strategies.megatron.verl``, a name kept as a deprecated alias.)

``actor_rollout_ref.actor.strategy=megatron`` (or the seed's ``actor_rollout_ref.model.backend=megatron``)
selects it. The parallel sizes come from verl's ``actor_rollout_ref.actor.megatron.*`` keys or the
seed's spellings ``actor_rollout_ref.actor.{tensor,pipeline}_model_parallel_size`` (either; both set
and different is an error). The reference and the critic use the same layout (one strategy): their
``megatron`` sizes must agree. Every other verl Megatron key is honoured or gets a note saying why it
changes nothing here.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from rlflow.config.verl.loading import ConfigError, NotSupportedError, VerlConfig
from rlflow.config.report import gib, line
from rlflow.models import mimo

if TYPE_CHECKING:
    from rlflow.strategies.megatron.layout import ParallelLayout

A = "actor_rollout_ref.actor"
M = f"{A}.megatron"
ROLL = "actor_rollout_ref.rollout"
SIZES = {  # ParallelLayout field -> verl key under megatron
    "tensor": "tensor_model_parallel_size", "pipeline": "pipeline_model_parallel_size",
    "context": "context_parallel_size", "expert": "expert_model_parallel_size",
    "expert_tensor": "expert_tensor_parallel_size", "virtual_pipeline": "virtual_pipeline_model_parallel_size",
}
SEED_ALIASES = {"tensor": f"{A}.tensor_model_parallel_size", "pipeline": f"{A}.pipeline_model_parallel_size"}


def wants_megatron(cfg: VerlConfig) -> bool:
    """``actor.strategy=megatron`` or the seed's ``model.backend=megatron`` (both set and different: an error)."""
    strategy, backend = cfg[f"{A}.strategy"], cfg["actor_rollout_ref.model.backend"]
    if backend == "megatron" and strategy != "megatron" and cfg.is_provided(f"{A}.strategy"):
        raise ConfigError(f"actor_rollout_ref.model.backend=megatron but {A}.strategy={strategy}: set "
                          f"{A}.strategy=megatron (or drop the backend key)")
    if strategy == "megatron" and backend not in (None, "megatron"):
        raise ConfigError(f"{A}.strategy=megatron but actor_rollout_ref.model.backend={backend}")
    return "megatron" in (strategy, backend)


def check_no_megatron_sizes(cfg: VerlConfig) -> None:
    """Without the Megatron strategy, a model-parallel size > 1 is a mistake: say which key to set."""
    keys = [SEED_ALIASES["tensor"], SEED_ALIASES["pipeline"]] + [f"{M}.{k}" for k in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
        "expert_model_parallel_size")]
    wrong = [f"{k}={cfg[k]}" for k in keys if (cfg[k] or 1) > 1]
    if wrong:
        raise ConfigError(f"{', '.join(wrong)} splits the model, which needs {A}.strategy=megatron "
                          f"(now {cfg[f'{A}.strategy']})")


def _size(cfg: VerlConfig, field: str) -> int | None:
    verl_key = f"{M}.{SIZES[field]}"
    alias = SEED_ALIASES.get(field)
    if alias is not None and cfg.is_provided(alias):
        if cfg.is_provided(verl_key) and cfg[verl_key] != cfg[alias]:
            raise ConfigError(f"{alias}={cfg[alias]} and {verl_key}={cfg[verl_key]} disagree; set only one")
        return cfg[alias]
    return cfg[verl_key]


def _same_layout(cfg: VerlConfig, with_critic: bool) -> None:
    roles = ["actor_rollout_ref.ref"] + (["critic"] if with_critic else [])
    for role in roles:
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                    "expert_model_parallel_size", "virtual_pipeline_model_parallel_size"):
            theirs, ours = f"{role}.megatron.{key}", f"{M}.{key}"
            if cfg.is_provided(theirs) and cfg[theirs] != cfg[ours]:
                raise ConfigError(f"{theirs}={cfg[theirs]} differs from {ours}={cfg[ours]}: rlflow trains every role "
                                  "with one Megatron layout; set them equal")


def _notes(cfg: VerlConfig, notes: list[str], on_cpu: bool, layout: ParallelLayout, spec: str) -> dict:
    """Read the remaining keys; return the TransformerConfig overrides to pass on."""
    if cfg[f"{M}.sequence_parallel"] and layout.tensor > 1 and spec == "local":
        notes.append(f"{M}.sequence_parallel=True (verl's default) is off: megatron-core's local layer spec (used "
                     "without Transformer Engine) has no sequence-parallel norm")
    if cfg[f"{M}.use_distributed_optimizer"]:
        notes.append(f"{M}.use_distributed_optimizer=True (verl's default): each rank keeps the full optimizer state "
                     "of its shards (the Trainer's AdamW); Megatron's distributed optimizer is opt-in from Python "
                     "(MegatronStrategy(distributed_optimizer=True), GPUs, no checkpoints yet)")
    if cfg[f"{M}.override_ddp_config"] or cfg[f"{M}.override_mcore_model_config"]:
        notes.append(f"{M}.override_ddp_config / override_mcore_model_config: Megatron's DDP wrapper and model "
                     "builder are not used (rlflow reduces gradients itself and builds the model from the Hugging "
                     "Face config)")
    for key, why in (("use_mbridge", "rlflow converts Hugging Face <-> Megatron weights itself"),
                     ("vanilla_mbridge", "rlflow converts Hugging Face <-> Megatron weights itself"),
                     ("seed", "the weights come from the Hugging Face model; data.seed seeds the run"),
                     ("forward_only", "rlflow decides per role whether a model trains"),
                     ("dtype", "parameters stay float32; trainer.precision sets the compute dtype")):
        if cfg.is_provided(f"{M}.{key}"):
            notes.append(f"{M}.{key}={cfg[f'{M}.{key}']!r} has no effect: {why}")
        cfg[f"{M}.{key}"]
    if on_cpu and cfg["actor_rollout_ref.model.enable_gradient_checkpointing"]:
        notes.append("actor_rollout_ref.model.enable_gradient_checkpointing=True is off under Megatron on CPU (its "
                     "recomputation saves CUDA RNG states); on GPUs it is Megatron's full recomputation")
    overrides = dict(cfg[f"{M}.override_transformer_config"])
    if on_cpu:
        dropped = {k: overrides.pop(k) for k in list(overrides) if k.startswith("recompute") or k in (
            "attention_backend", "moe_token_dispatcher_type")}
        if dropped:
            notes.append(f"{M}.override_transformer_config: {dropped} not applied on CPU (Megatron's recomputation "
                         "needs CUDA RNG states; the all-to-all dispatcher a CUDA stream; attention is "
                         "megatron-core's)")
    return overrides


OFFLOAD_KEYS = {"params": "param_offload", "grads": "grad_offload", "optimizer": "optimizer_offload"}
OFFLOAD_ROLES = {A: ("policy", ("params", "grads", "optimizer")), "actor_rollout_ref.ref": ("reference", ("params",)),
                 "critic": ("critic", ("params", "optimizer"))}  # the keys verl's tree has for each role


def offload(cfg: VerlConfig, notes: list[str], on_cpu: bool, with_critic: bool) -> dict[str, list[str]]:
    """``*.megatron.{param,grad,optimizer}_offload`` -> ``MegatronStrategy(offload={role: kinds})``
    (:mod:`rlflow.strategies.megatron.offload`): as verl, each role's tensors wait in host memory while other roles
    run. On CPU they are there already: the same bookkeeping runs, moving nothing."""
    roles = {}
    for verl_role, (role, kinds) in OFFLOAD_ROLES.items():
        if role == "critic" and not with_critic:
            continue
        on = [kind for kind in kinds if cfg[f"{verl_role}.megatron.{OFFLOAD_KEYS[kind]}"]]
        if on:
            roles[role] = on
            keys = ", ".join(f"{verl_role}.megatron.{OFFLOAD_KEYS[k]}" for k in on)
            notes.append(f"{keys}=True: " + ("on trainer.device=cpu the states already live in CPU memory (nothing "
                                             "to move)" if on_cpu else f"the {role}'s {', '.join(on)} wait in pinned "
                                             "host memory while other roles run (rlflow.strategies.megatron.offload)"))
    return roles


def router_replay(cfg: VerlConfig, notes: list[str]) -> str | bool:
    """``megatron.router_replay.mode`` -> ``MegatronStrategy(router_replay=...)``: ``R2`` (the update replays the
    routing of the old-log-prob pass) or ``R3`` (every pass replays the routing the rollout recorded, which needs
    ``rollout.enable_rollout_routing_replay=True``: verl's scripts set both); ``False`` when disabled."""
    key, recorded = f"{M}.router_replay", f"{ROLL}.enable_rollout_routing_replay"
    mode = cfg[f"{key}.mode"]
    if cfg[f"{key}.replay_file"]:
        raise NotSupportedError(f"{key}.replay_file", cfg[f"{key}.replay_file"], "MoE routing replay from a file")
    if cfg[f"{key}.record_file"]:
        notes.append(f"{key}.record_file has no effect: rlflow keeps the recorded routing in memory")
    if mode not in (None, "disabled", "R2", "R3"):
        raise ConfigError(f"{key}.mode={mode!r}: choose disabled, R2 or R3")
    if mode == "R3" and not cfg[recorded]:
        raise ConfigError(f"{key}.mode=R3 replays the routing the rollout recorded: set {recorded}=True (as verl's "
                          f"scripts do), or {key}.mode=R2 for the old-log-prob pass's routing")
    if mode != "R3" and cfg[recorded]:
        notes.append(f"{recorded}=True: the rollout's routing is recorded but not replayed ({key}.mode={mode!r}; R3 "
                     "replays it)")
    if mode == "R2":
        notes.append(f"{key}.mode=R2: the policy's updates route each token to the experts its old-log-prob pass chose "
                     "(no effect on a model without MoE layers)")
    if mode == "R3":
        notes.append(f"{key}.mode=R3: every pass of the policy routes each token to the experts the rollout routed it "
                     "to (no effect on a model without MoE layers)")
    return mode if mode in ("R2", "R3") else False


def mtp_options(cfg: VerlConfig, notes: list[str]) -> dict | None:
    """``actor_rollout_ref.model.mtp`` -> ``MegatronStrategy(mtp=...)`` (``MTPOptions``' fields), ``None`` when
    ``enable`` is off (verl then builds no MTP block either). validate.multi_token_prediction refused the rest."""
    key = "actor_rollout_ref.model.mtp"
    if not cfg[f"{key}.enable"]:
        return None
    options = dict(train=bool(cfg[f"{key}.enable_train"]), detach_encoder=bool(cfg[f"{key}.detach_encoder"]),
                   loss_scaling_factor=float(cfg[f"{key}.mtp_loss_scaling_factor"]))
    notes.append(f"{key}.enable=True: the checkpoint's MTP layers run in megatron-core's MTP block ("
                 + (f"trained: {options['loss_scaling_factor']} x their response-token cross-entropy joins the actor's "
                    "loss, logged as actor/mtp_losses/mtp_1_loss" + (", stopped at the decoder's states and the token "
                    "embeddings (detach_encoder)" if options["detach_encoder"] else "") if options["train"]
                    else "carried and checkpointed, not trained: enable_train=False")
                 + "); weight sync leaves them out (no speculative decoding)")
    return options


def check_mtp_layers(plan, config) -> None:
    """``mtp.enable=True`` needs a checkpoint with MTP layers (``config``: the policy's), as in verl."""
    if getattr(plan.trainer_kwargs.get("strategy"), "mtp", None) is not None and not mimo.mtp_layer_count(config):
        raise ConfigError(f"actor_rollout_ref.model.mtp.enable=True but actor_rollout_ref.model.path={plan.model_path} "
                          "has no multi-token prediction layers (its config's num_nextn_predict_layers is 0 or absent), "
                          "as verl refuses too: use a checkpoint with them (MiMo) or mtp.enable=False")


def _lora(cfg: VerlConfig) -> bool:
    """LoRA on the policy, in any of its spellings (rlflow.config.verl.lora)."""
    M_ = "actor_rollout_ref.model"
    return bool(cfg[f"{M_}.lora_adapter_path"] or cfg[f"{A}.lora.enabled"] or (cfg[f"{M_}.lora_rank"] or 0) > 0
                or (cfg[f"{M_}.lora.rank"] or 0) > 0)


DIST_ROLES = {A: "policy", "actor_rollout_ref.ref": "reference", "critic": "critic"}  # verl role -> strategy role


def dist_checkpoints(cfg: VerlConfig, notes: list[str], with_critic: bool,
                     check_folder: Callable[[str, str], Path]) -> tuple[dict[str, str], str]:
    """``*.megatron.use_dist_checkpointing`` + ``dist_checkpointing_path`` -> ``MegatronStrategy(dist_checkpoints=...,
    dist_checkpoint_prefix=...)``: the roles that start from a Megatron dist checkpoint instead of
    ``actor_rollout_ref.model.path``'s weights (which still give the architecture), as in verl. The folder is
    checked now (``check_folder``: :func:`rlflow.strategies.megatron.dist_checkpoint.check_folder`, passed in by the
    caller, which imports the strategies late); a path without ``use_dist_checkpointing`` is ignored by verl, and
    gets a note here."""
    folders, prefixes = {}, {}
    for verl_role, role in DIST_ROLES.items():
        key = f"{verl_role}.megatron"
        use, path, prefix = (cfg[f"{key}.{k}"] for k in ("use_dist_checkpointing", "dist_checkpointing_path",
                                                          "dist_checkpointing_prefix"))
        if not use:
            if path:
                notes.append(f"{key}.dist_checkpointing_path={path!r} has no effect without "
                             f"{key}.use_dist_checkpointing=True (as in verl)")
            continue
        if role == "critic" and not with_critic:
            notes.append(f"{key}.use_dist_checkpointing=True has no effect: this run has no critic")
            continue
        if not path:
            raise ConfigError(f"{key}.use_dist_checkpointing=True needs {key}.dist_checkpointing_path: the folder of "
                              "the Megatron dist checkpoint to start from (verl's converter_hf_to_mcore.py writes one)")
        try:
            folders[role] = str(check_folder(path, f"{key}.dist_checkpointing_path"))
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(str(e)) from None
        prefixes[f"{key}.dist_checkpointing_prefix"] = prefix or ""
    if len(set(prefixes.values())) > 1:
        raise ConfigError(f"{', '.join(f'{k}={v!r}' for k, v in prefixes.items())}: rlflow reads every role's dist "
                          "checkpoint with one key prefix; set them equal")
    if folders:
        notes.append(f"use_dist_checkpointing: {sorted(folders)} start from Megatron dist checkpoints; rlflow's own "
                     "checkpoints (trainer.save_freq) stay its sharded format in transformers' names (resumable at "
                     "any layout, rlflow export), not verl's model/dist_ckpt folders")
    return folders, next(iter(prefixes.values()), "")


def megatron_strategy(cfg: VerlConfig, notes: list[str], processes: int, accelerator: str, with_critic: bool):
    """The strategy of a verl config that asks for Megatron (see the module docstring), and the keyword arguments
    it was made with."""
    # rlflow.strategies imports Lightning and torch: not before a Megatron run is planned (validation stays light)
    from rlflow.strategies.megatron import MegatronStrategy, ParallelLayout, check_dist_checkpoint

    for role in ("critic",) if with_critic else ():
        if cfg[f"{role}.strategy"] != "megatron":
            if cfg.is_provided(f"{role}.strategy"):
                raise ConfigError(f"{role}.strategy={cfg[f'{role}.strategy']} with {A}.strategy=megatron: rlflow "
                                  "trains every role with one strategy; set critic.strategy=megatron")
            notes.append(f"{role}.strategy: the critic trains with the actor's Megatron strategy")
    _same_layout(cfg, with_critic)
    sizes = {field: _size(cfg, field) for field in SIZES}
    on_cpu = accelerator == "cpu"
    spec = "transformer_engine" if not on_cpu and importlib.util.find_spec("transformer_engine") else "local"
    if spec != "local" and _lora(cfg):
        spec = "local"  # rlflow.strategies.megatron.lora hooks megatron-core's own linear layers
        notes.append("LoRA under the Megatron strategy uses megatron-core's local layer spec, not Transformer Engine's")
    try:
        layout = ParallelLayout(
            tensor=sizes["tensor"], pipeline=sizes["pipeline"], context=sizes["context"], expert=sizes["expert"],
            expert_tensor=sizes["expert_tensor"] or 1, virtual_pipeline=sizes["virtual_pipeline"],
            sequence_parallel=bool(cfg[f"{M}.sequence_parallel"]) and spec != "local")
        layout.check_world(processes)
    except ValueError as e:
        raise ConfigError(f"{M}.*: {e} (trainer.n_gpus_per_node x trainer.nnodes = {processes})") from None
    if layout.context > 1 and spec == "local":
        raise NotSupportedError(f"{M}.context_parallel_size", layout.context, "context parallelism without "
                                "Transformer Engine", "It needs a GPU with transformer_engine installed.")
    overrides = _notes(cfg, notes, on_cpu, layout, spec)
    optimizer = optimizer_overrides(cfg, notes, on_cpu, with_critic)
    folders, prefix = dist_checkpoints(cfg, notes, with_critic, check_dist_checkpoint)
    replay = router_replay(cfg, notes)
    mtp = mtp_options(cfg, notes)
    offloaded = offload(cfg, notes, on_cpu, with_critic)
    kwargs = dict(tensor_parallel=layout.tensor, pipeline_parallel=layout.pipeline, context_parallel=layout.context,
                  expert_parallel=layout.expert, sequence_parallel=layout.sequence_parallel, layer_spec=spec,
                  transformer_overrides=overrides, optimizer_overrides=optimizer, dist_checkpoints=folders,
                  dist_checkpoint_prefix=prefix, router_replay=replay, **({"mtp": mtp} if mtp else {}),
                  **({"offload": offloaded} if offloaded else {}))
    try:  # the object (checked; the dry run reads its layout) and its arguments (the tree's hardware.strategy node)
        return MegatronStrategy(**kwargs), kwargs
    except ValueError as e:
        raise ConfigError(f"{A}.optim.override_optimizer_config: {e}") from None


PRECISION_KEYS = ("use_precision_aware_optimizer", "main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
# OptimizerConfig's precision-aware fields (rlflow.strategies.megatron.precision_aware.FIELDS, not imported: torch)
PRECISION_FIELDS = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")


def precision_aware_keys(cfg: VerlConfig, with_critic: bool) -> dict:
    """verl's ``optim.use_precision_aware_optimizer`` and, with it on, ``optim.{main_grads_dtype, exp_avg_dtype,
    exp_avg_sq_dtype}`` (McoreOptimizerConfig) as ``OptimizerConfig`` fields, as verl's ``init_megatron_optim_config``
    passes them; the critic's must agree (one strategy)."""
    roles = (A, "critic") if with_critic else (A,)
    values = {}
    for role in roles:  # the dtypes are read only with the switch on (else their keys get verl's "no effect" note)
        on = bool(cfg[f"{role}.optim.use_precision_aware_optimizer"])
        values[role] = [True] + [cfg[f"{role}.optim.{k}"] for k in PRECISION_KEYS[1:]] if on else [False]
    if with_critic and cfg.is_provided("critic.optim.use_precision_aware_optimizer") and values["critic"] != values[A]:
        raise ConfigError(f"critic.optim.{{{', '.join(PRECISION_KEYS)}}}={values['critic']} differ from {A}.optim's "
                          f"{values[A]}: rlflow trains every role with one Megatron strategy; set them equal")
    return dict(zip(PRECISION_KEYS, values[A])) if values[A][0] else {}


def optimizer_overrides(cfg: VerlConfig, notes: list[str], on_cpu: bool, with_critic: bool = False) -> dict:
    """``optim.override_optimizer_config`` (over ``optim.use_precision_aware_optimizer`` and its dtypes, which it
    overrides, as in verl) -> megatron-core ``OptimizerConfig`` fields (checked by the strategy: an unknown field is an
    error naming it). The verl entry point trains with the Trainer's AdamW per shard (see
    ``use_distributed_optimizer``'s note): the precision-aware optimizer's fields make it rlflow's
    ``PrecisionAwareAdamW``; the others are for Megatron's distributed optimizer: on CPU the state is already in CPU
    memory; on a GPU the CPU offload they ask for is refused."""
    key = f"{A}.optim.override_optimizer_config"
    overrides = precision_aware_keys(cfg, with_critic) | dict(cfg[key] or {})
    if not overrides:
        return {}
    if overrides.get("optimizer_cpu_offload") and not on_cpu:
        raise NotSupportedError(f"{key}.optimizer_cpu_offload", True, "offloading the optimizer to the CPU from the "
                                "verl entry point", "It needs Megatron's distributed optimizer: from Python, "
                                "MegatronStrategy(distributed_optimizer=True, optimizer_overrides={...}).")
    precision = {k: v for k, v in overrides.items() if k in ("use_precision_aware_optimizer", *PRECISION_FIELDS)}
    others = {k: v for k, v in overrides.items() if k not in precision}
    if precision.get("use_precision_aware_optimizer"):
        notes.append(f"{A}.optim.use_precision_aware_optimizer: {precision} make the Trainer's AdamW rlflow's "
                     "PrecisionAwareAdamW (megatron-core's precision-aware optimizer on any device: gradients, master "
                     "weights and moments stored in those dtypes; rlflow.strategies.megatron.precision_aware)")
    if others:
        notes.append(f"{key}: {others} go to megatron-core's OptimizerConfig, used by Megatron's distributed optimizer "
                     "(MegatronStrategy(distributed_optimizer=True), GPUs); the Trainer's AdamW "
                     + ("on trainer.device=cpu keeps its state in CPU memory" if on_cpu else
                        "per shard does not read them"))
    return overrides


def _short(dtype) -> str:
    """verl's name of a torch dtype (``bf16``)."""
    return {"float32": "float32", "bfloat16": "bf16", "float16": "fp16"}.get(str(dtype).removeprefix("torch."), "fp8")


def dry_run_section(plan, config, seq_len: int) -> list[str]:
    """The dry run's Megatron lines: the layout, the batch per data-parallel rank and memory per rank."""
    from rlflow.strategies.megatron.memory import optimizer_dtypes, rank_memory  # torch, as above
    from rlflow.strategies.megatron.lora import check_targets
    from rlflow.strategies.megatron.model import architecture
    from rlflow.strategies.megatron.vision import language_config

    try:  # a model the conversion does not cover is refused here, not at build
        architecture(config, plan.devices.strategy.layout)
    except ValueError as e:
        raise NotSupportedError("actor_rollout_ref.actor.strategy", "megatron", f"this model ({e})") from None
    check_mtp_layers(plan, config)
    config = language_config(config)  # a vision-language model: its language model's (its tower is not counted)
    if isinstance(plan.lora, dict):
        try:
            check_targets(config, plan.lora["target_modules"])
        except ValueError as e:
            raise ConfigError(str(e)) from None
    layout, world = plan.devices.strategy.layout, plan.devices.processes
    t, n = plan.trainer_kwargs, plan.rollout_kwargs["n"]
    dp = layout.data_parallel(world)
    mini = t["mini_batch_size"] * n
    micro = t["micro_batch_size"] or max(1, mini // dp)
    lora = (plan.lora["r"], plan.lora["target_modules"]) if isinstance(plan.lora, dict) else None
    dtypes, per_param = optimizer_dtypes(plan.devices.strategy.optimizer_overrides)
    mem = rank_memory(config, layout, world, micro, seq_len, lora=lora, trained_bytes=per_param)
    reference = (plan.loss_kwargs.get("kl_coef", 0) > 0 or plan.kl_controller is not None) and lora is None
    kind = "float32; the Trainer's AdamW per shard" if dtypes is None else ", ".join(
        ["float32 weights", f"{_short(dtypes['main_grads_dtype'])} gradients"]
        + ([f"{_short(dtypes['main_params_dtype'])} master weights"] if dtypes["main_params_dtype"].itemsize != 4 else [])
        + [f"{_short(dtypes[k])} {k.removesuffix('_dtype')}" for k in ("exp_avg_dtype", "exp_avg_sq_dtype")]) \
        + ": precision-aware AdamW"
    states = (f"4 B/param frozen + {per_param} B/adapter param (LoRA: only the adapters train"
              + ("" if dtypes is None else f"; {kind}") + ")" if lora else
              f"{per_param} B/param ({kind})")
    L = config.num_hidden_layers
    engine = mem.total_parameters * 4
    return [
        f"Megatron: {layout.describe(world)}",
        line("replicas (data parallel)", f"{world} processes / (TP {layout.tensor} x CP {layout.context} x PP "
                                              f"{layout.pipeline})", f"{dp}"),
        line("layers per stage", f"{L} layers / PP {layout.pipeline}", f"{L // layout.pipeline}"),
        line("trajectories per replica", f"{mini} per mini-batch / DP {dp}",
             f"{mini // dp} (every rank of a replica trains on them)"),
        line("parameters per rank", "largest stage: layers x (matrices / TP + norms) + vocabulary / TP",
             f"{mem.parameters / 1e9:.3g} B of {mem.total_parameters / 1e9:.3g} B"),
        *([line("LoRA adapters / rank", f"r={lora[0]} on {lora[1]}",
                f"{mem.adapter_parameters / 1e6:.3g} M")] if lora else []),
        line("weights+grads+AdamW / rank", states, gib(mem.model_states)),
        line("  distributed optimizer", f"(4 + 12 / DP {dp}) B/{'adapter ' if lora else ''}param (Megatron's, "
             "opt-in on GPUs)",
             gib(mem.distributed_optimizer)),
        *([line("frozen reference / rank", "4 B/param (float32, same layout)", gib(mem.reference))]
          if reference else []),
        line("activations / micro-batch", f"{micro} x {seq_len} tokens, no recompute, 16-bit (Korthikanti eq. 2)",
             gib(mem.activations)),
        line("peak per rank (training)", "model states + activations (the reference waits on the host: "
             "ref.megatron.param_offload)" if reference and "reference" in plan.devices.strategy.offload else
             "model states + reference + activations",
             gib(mem.peak(reference and "reference" not in plan.devices.strategy.offload))),
        f"  generation: the {plan.rollout_cls.__name__} engine holds {gib(engine)} of float32 weights per process"
        + (" (HF generation keeps a full copy on every rank: for a model this size use an engine with its own "
           "tensor parallelism)" if plan.rollout_cls.__name__ == "HFRollout" else ""),
    ]
