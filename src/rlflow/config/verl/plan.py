"""From a validated verl config to a :class:`Plan`: which rlflow classes to build, with which arguments.

Making the plan reads every key it honours and loads nothing heavy (no weights, no data), so the
dry run can print it. :mod:`rlflow.config.verl.build` then makes the objects from the plan, through the
same public constructors a Python user calls. Units follow verl: ``ppo_mini_batch_size`` counts
prompts, ``*_micro_batch_size_per_gpu`` counts trajectories (samples).
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, replace
from typing import Any, Callable


import rlflow
import rlflow.algorithms
import rlflow.rollout
from rlflow import registry
from rlflow.config.verl import tables
from rlflow.config.verl.agent import agent_plan
from rlflow.config.verl.algos import bypass_loss, gdpo_keys, ESTIMATOR_POOL, companions, loss_pool, pf_ppo
from rlflow.config.verl.asynchronous import async_plan, multi_turn_async, sync_cadence, v1_async_plan
from rlflow.config.verl.data_classes import data_generator, data_source_key, dataset_class, sampler_factory
from rlflow.config.verl.data_keys import data_extras
from rlflow.config.verl.devices import Devices, resolve_devices
from rlflow.config.verl.distillation import distillation_plan
from rlflow.config.verl.loading import ConfigError, VerlConfig
from rlflow.config.verl.determinism import determinism
from rlflow.config.verl.lora import critic_lora_argument, lora_argument
from rlflow.config.verl.modeldata import chat_template_kwargs, engine_loading, liger, model_loading, patch_size
from rlflow.config.verl.optim import optim_kwargs
from rlflow.config.verl.qat import qat_argument
from rlflow.config.verl.resolve import class_kwargs
from rlflow.config.verl.reward_class import manager_class
from rlflow.config.verl.replay_keys import replay_plan
from rlflow.config.verl.reward_section import user_names
from rlflow.config.verl.rewards import RewardPlan, reward_plan
from rlflow.config.verl.role_keys import SP_ENGINE_KEYS, model_paths, sequence_parallel_keys
from rlflow.config.verl.rollout import rollout_class, rollout_plan
from rlflow.config.verl.trace_keys import trace_plan
from rlflow.config.verl.trainer_extras import critic_warmup_steps, generation_callbacks, keep_checkpoints
from rlflow.config.verl.trainer_keys import checkpoint_callbacks, v1_mode
from rlflow.config.verl.validate import check

A, R, C = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "critic"
FG, OB = "algorithm.filter_groups", "reward_model.reward_kwargs.overlong_buffer_cfg"


@dataclass(frozen=True)
class Plan:
    """Everything the entry point will build; each ``*_kwargs`` is passed to the public constructor. A value:
    :func:`make_plan` computes every field first and makes it once; nothing changes it after (what building
    finds goes in notes of its own, :func:`rlflow.config.verl.build.run_notes`)."""

    cfg: VerlConfig
    devices: Devices
    model_path: str
    vision: bool                        # rollout.enable_vision: the model must be image-text-to-text
    chat_template: str | None
    policy_kwargs: dict
    ref_micro_batch_size: int | None
    ref_max_tokens: int | None          # ref.log_prob_use_dynamic_bsz: the reference's scoring token budget
    rollout_cls: type
    rollout_kwargs: dict
    val_sampling: dict
    reward: RewardPlan                  # the reward functions, the reward model and how they combine
    estimator_cls: type
    estimator_kwargs: dict
    loss_cls: type
    loss_kwargs: dict
    before: list[tuple[type, dict]]     # modules chained before the estimator (KL in reward, ReMax's baseline)
    after: list[tuple[type, dict]]      # ... and after it (rollout-correction weights)
    kl_controller: tuple | None         # (controller class, its kwargs) for the KL-in-reward module
    critic_path: str | None
    critic_kwargs: dict
    value_loss_kwargs: dict
    data_kwargs: dict
    trainer_kwargs: dict
    total_training_steps: int | None
    total_epochs: int
    warmup: tuple[int, float]           # (lr_warmup_steps, lr_warmup_steps_ratio)
    loggers: list[str]
    project: str
    experiment: str
    val_before_train: bool
    val_only: bool
    overlong: dict | None = None           # OverlongPenalty's kwargs around the reward (DAPO reward manager)
    dynamic_sampling: dict | None = None   # the FilterGroups stage's kwargs (filter_groups)
    lora: dict | str | None = None         # peft.LoraConfig's kwargs, or an adapter folder (rlflow.config.verl.lora)
    agent: dict | None = None              # AgentLoop's kwargs: it wraps the rollout (multi_turn.enable)
    async_rollout: dict | None = None      # AsyncRollout's kwargs around the rollout (trainer.async_weight_update)
    distillation: dict | None = None       # the teacher stage and the distillation loss (rlflow.config.verl.distillation)
    fully_async: dict | None = None        # FullyAsyncRollout's kwargs (trainer.v1.trainer_mode=*_async)
    replay: dict | None = None             # ReplayRollout's kwargs: dumped rollouts replayed (skip.*, skip_rollout)
    trace: dict | None = None              # TracedRollout's kwargs: rollout.trace.backend=mlflow|trackio
    determinism: dict | None = None        # full_determinism's kwargs (the *.full_determinism keys)
    critic_lora: dict | str | None = None  # the critic's LoRA, as lora (critic.model.lora_*)
    dataset_cls: type | None = None        # data.custom_cls: the user's dataset class the rows come from
    ref_model_path: str | None = None      # actor_rollout_ref.ref.model: the reference's own weights
    notes: tuple[str, ...] = ()            # about the keys, in the order they were read

    @property
    def reward_fn(self) -> Callable | None:
        """The (first) rule or custom reward function; None when the reward model alone scores."""
        return self.reward.functions[0][1] if self.reward.functions else None

    @property
    def custom_reward(self) -> bool:
        return self.reward.custom


def token_budget(cfg: VerlConfig, with_critic: bool) -> int | None:
    """verl's use_dynamic_bsz + ppo_max_token_len_per_gpu -> the Trainer's token budget per micro-batch."""
    roles = (A, C) if with_critic else (A,)
    pairs = [(cfg[f"{r}.use_dynamic_bsz"], cfg[f"{r}.ppo_max_token_len_per_gpu"]) for r in roles]
    budgets = [tokens for on, tokens in pairs if on]
    return min(budgets) if budgets else None


def scoring_split(cfg: VerlConfig, dynamic: str, tokens: str, per_gpu: str, global_: str,
                  processes: int) -> tuple[int | None, int | None]:
    """A scoring pass's (micro-batch rows, token budget): verl's ``*use_dynamic_bsz`` on -> the budget of
    ``tokens`` and no row count (verl ignores the micro sizes then), off -> the micro size and no budget."""
    if cfg[dynamic]:
        return None, cfg[tokens]
    return one_of(cfg, per_gpu, global_, processes), None


def reward_keys(cfg: VerlConfig, manager: str, reward_kwargs: dict, notes: list[str]) -> RewardPlan:
    """:func:`rlflow.config.verl.rewards.reward_plan`; a problem of a key set as verl 0.9's ``reward.*`` names it."""
    try:
        return reward_plan(cfg, manager, reward_kwargs, notes)
    except ConfigError as e:
        raise user_names([e], cfg.aliased)[0] from None


def sequence_parallel(cfg: VerlConfig, notes: list[str], with_critic: bool, processes: int) -> int:
    """verl's ``ulysses_sequence_parallel_size`` (actor, ref, critic) -> the Trainer's one size for all roles."""
    keys = sequence_parallel_keys(cfg.flat.get, cfg.is_provided, with_critic)  # verl 0.9: or the engine's key
    for role_key, engine_key in list(SP_ENGINE_KEYS.items())[:2 if with_critic else 1]:
        cfg[role_key], cfg[engine_key]  # read: both spellings decide the size
    size = cfg[keys[0]]
    others = {k: cfg[k] for k in keys[1:] if cfg[k] != size}
    if size > 1 and others:
        notes.append(f"{keys[0]}={size} applies to every role (the Trainer has one sequence-parallel size); "
                     f"ignored: {', '.join(f'{k}={v}' for k, v in others.items())}")
    return max(size, 1)  # validation checked that it divides the processes and that sequences are packed


def one_of(cfg: VerlConfig, per_gpu: str, global_: str, processes: int) -> int | None:
    """verl's per-GPU micro size, or its deprecated global form divided by the process count (validation
    made sure at most one is set)."""
    a, b = cfg[per_gpu], cfg[global_]
    return a if b is None else max(1, b // processes)


def shared(cfg: VerlConfig, notes: list[str], with_critic: bool, actor_keys: tuple[str, ...], actor_value: Any,
           critic_keys: tuple[str, ...], critic_value: Any) -> Any:
    """One value for actor and critic (rlflow's Trainer updates both with one mini-batching, schedule and
    clipping): the side the user set wins; both set and different is an error; any difference gets a note."""
    if not with_critic or critic_value == actor_value:
        return actor_value
    actor_set, critic_set = any(map(cfg.is_provided, actor_keys)), any(map(cfg.is_provided, critic_keys))
    if actor_set and critic_set:
        raise ConfigError(f"{critic_keys[0]}={critic_value!r} differs from {actor_keys[0]}={actor_value!r}: rlflow's "
                          "Trainer uses one value for actor and critic; set them equal")
    if not actor_set and not critic_set:  # both verl's defaults: nothing the user wrote to mention
        return actor_value
    if critic_set:
        notes.append(f"{critic_keys[0]}={critic_value!r} applies to the actor too: rlflow's Trainer uses one value "
                     f"for both ({actor_keys[0]} was verl's default {actor_value!r})")
        return critic_value
    notes.append(f"{critic_keys[0]}: the critic uses the actor's {actor_keys[0]}={actor_value!r} "
                 f"(verl's critic default is {critic_value!r})")
    return actor_value


def bad_images(cfg: VerlConfig) -> bool:
    """``data.bad_images``: a row with a missing or corrupt image stops the run (``error``) or is dropped and
    counted in a note (``skip``)."""
    value = str(cfg["data.bad_images"])
    if value not in ("error", "skip"):
        raise ConfigError(f"data.bad_images={value!r}: choose 'error' (stop, naming the file, row and image) or "
                          "'skip' (drop such rows and count them)")
    return value == "skip"


REF_SPLIT = ("log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu", "log_prob_micro_batch_size_per_gpu",
             "log_prob_micro_batch_size")  # the reference's scoring split (scoring_split's four keys)


def estimator_and_loss(cfg: VerlConfig, estimator_cls: type, notes: list[str]) -> tuple:
    """(modules before and after the estimator, the KL controller, the estimator's kwargs, the loss class, the
    bypass-mode loss kwargs)."""
    before, after, kl_controller = companions(cfg, estimator_cls)
    after += pf_ppo(cfg, estimator_cls, notes)  # last: it resamples whole rows, with their IS weights
    loss_cls, bypass = bypass_loss(cfg, registry.POLICY_LOSSES.resolve(cfg[f"{A}.policy_loss.loss_mode"]), notes)
    estimator_kwargs = class_kwargs(estimator_cls, ESTIMATOR_POOL, cfg)
    gdpo_keys(estimator_kwargs)
    return before, after, kl_controller, estimator_kwargs, loss_cls, bypass


def critic_on(cfg: VerlConfig, algo: str, estimator_cls: type) -> bool:
    """Whether the run has a critic: ``critic.enable``, or (unset) whether the estimator needs one. A registered
    estimator that needs one with ``critic.enable=False`` is refused here (validation knows rlflow's own)."""
    enable = cfg["critic.enable"]
    with_critic = bool(estimator_cls.needs_critic) if enable is None else bool(enable)
    if estimator_cls.needs_critic and not with_critic:
        raise ConfigError(f"algorithm.adv_estimator={algo} needs a critic, but critic.enable=False")
    return with_critic


def critic_keys(cfg: VerlConfig, notes: list[str], procs: int, micro: int | None, devices: Devices) -> tuple:
    """The critic's keys -> (its model path, ``Critic.from_pretrained``'s kwargs, ``ValueLoss``'s kwargs, the one
    micro-batch size of actor and critic)."""
    critic_micro = one_of(cfg, f"{C}.ppo_micro_batch_size_per_gpu", f"{C}.ppo_micro_batch_size", procs)
    fwd_micro, fwd_tokens = scoring_split(cfg, f"{C}.use_dynamic_bsz", f"{C}.forward_max_token_len_per_gpu",
                                          f"{C}.forward_micro_batch_size_per_gpu", f"{C}.forward_micro_batch_size",
                                          procs)
    if critic_micro is not None and critic_micro != micro:
        notes.append(f"{C}.ppo_micro_batch_size_per_gpu={critic_micro} and the actor's {micro}: the Trainer "
                     f"uses one micro-batch size, {min(x for x in (micro, critic_micro) if x)}; gradients "
                     "do not depend on it")
        micro = min(x for x in (micro, critic_micro) if x)
    kwargs = {"micro_batch_size": fwd_micro if fwd_micro is not None or fwd_tokens else critic_micro,
              "max_tokens_per_micro_batch": fwd_tokens,
              "gradient_checkpointing": cfg[f"{C}.model.enable_gradient_checkpointing"],
              "remove_padding": cfg[f"{C}.model.use_remove_padding"], **model_loading(cfg, C),
              **({"activation_offload": True} if cfg[f"{C}.model.enable_activation_offload"] else {}),
              **model_paths(cfg, f"{C}.model"), **liger(cfg, devices, C)}  # critic.model.hf_config_path
    value_loss = {"clip_range": cfg[f"{C}.cliprange_value"], "agg": cfg[f"{C}.loss_agg_mode"],
                  "loss_scale_factor": cfg[f"{C}.loss_scale_factor"]}
    return cfg[f"{C}.model.path"], kwargs, value_loss, micro


def policy_keys(cfg: VerlConfig, temperature: float, procs: int, loading: dict) -> dict:
    """``Policy.from_pretrained``'s kwargs (beside the model path and LoRA)."""
    M = "actor_rollout_ref.model"
    micro, tokens = scoring_split(cfg, f"{R}.log_prob_use_dynamic_bsz", f"{R}.log_prob_max_token_len_per_gpu",
                                  f"{R}.log_prob_micro_batch_size_per_gpu", f"{R}.log_prob_micro_batch_size", procs)
    return {"temperature": temperature, "micro_batch_size": micro, "max_tokens_per_micro_batch": tokens,
            "gradient_checkpointing": cfg[f"{M}.enable_gradient_checkpointing"],
            "remove_padding": cfg[f"{M}.use_remove_padding"],
            **({"activation_offload": True} if cfg[f"{M}.enable_activation_offload"] else {}),
            **{k: cfg[f"data.{k}"] for k in ("min_pixels", "max_pixels") if cfg[f"data.{k}"]},
            **loading, **model_paths(cfg, M),  # model.tokenizer_path, model.hf_config_path
            **({"freeze_vision_tower": True} if cfg[f"{A}.freeze_vision_tower"] else {})}


def data_keys(cfg: VerlConfig, notes: list[str], template_kwargs: dict, agent: dict | None, procs: int) -> dict:
    """``PromptData``'s kwargs."""
    return {"train": cfg["data.train_files"], "val": cfg["data.val_files"], "prompt_key": cfg["data.prompt_key"],
            "max_prompt_length": cfg["data.max_prompt_length"], "truncation": cfg["data.truncation"],
            "shuffle": cfg["data.shuffle"], "seed": cfg["data.seed"],
            "filter_overlong_prompts": cfg["data.filter_overlong_prompts"],
            "missing_ground_truth": cfg["data.missing_ground_truth"],
            "image_key": cfg["data.image_key"], "skip_bad_images": bad_images(cfg),
            "image_patch_size": patch_size(cfg),
            **({"chat_template_kwargs": template_kwargs} if template_kwargs else {}),
            **data_extras(cfg, agent), **data_source_key(cfg, notes),
            **({"sampler": s} if (s := sampler_factory(cfg, procs)) else {}),
            **({"datagen": g} if (g := data_generator(cfg, procs)) else {})}


def reward_and_shaping(cfg: VerlConfig, notes: list[str]) -> tuple[RewardPlan, dict | None]:
    """The reward keys -> the reward plan and DAPO's overlong shaping (OverlongPenalty's kwargs, or None)."""
    crf = cfg["custom_reward_function"]
    manager, manager_kwargs = cfg["reward_model.reward_manager"], dict(cfg["reward_model.reward_kwargs"])
    user_class = manager_class(cfg, manager_kwargs)
    if user_class is not None:  # the class takes reward_kwargs; the function (compute_score) gets its own
        plan = reward_keys(cfg, "naive", dict(crf["reward_kwargs"]), notes)
        if plan.model is not None:
            raise ConfigError("reward_model.enable=True with a reward-manager class from a file: not supported yet "
                              "(score with the reward model inside the class, or drop one)")
        return replace(plan, manager=user_class), None
    overlong = overlong_penalty(manager, manager_kwargs, cfg[f"{R}.response_length"])
    if manager in ("prime", "dapo"):
        notes.append(f"reward_model.reward_manager={manager}: scores like 'naive' (rlflow runs reward calls on "
                     f"threads with a timeout){'; overlong shaping: OverlongPenalty' if overlong else ''}")
    return reward_keys(cfg, manager, {**manager_kwargs, **crf["reward_kwargs"]}, notes), overlong


def around_the_rollout(cfg: VerlConfig, notes: list[str], devices: Devices, after: list, sampling: dict | None,
                       template_kwargs: dict) -> tuple:
    """The plans of what goes around the rollout and the loss: (the agent loop, distillation, fully asynchronous
    generation, asynchronous generation); multi_turn_async checks what the agent loop combines with."""
    agent = agent_plan(cfg, notes)
    if agent is not None and template_kwargs:
        agent = agent | {"template_kwargs": template_kwargs}
    v1_mode(cfg, notes)
    distill = distillation_plan(cfg, notes)
    if distill is not None:  # the loss by name -> its class
        loss_cls = getattr(rlflow.algorithms, distill["loss"])
        distill = {k: v for k, v in distill.items() if k != "loss"} | {"loss_cls": loss_cls}
    sync_cadence(cfg, notes)
    fully_async = v1_async_plan(cfg, notes, devices, after, sampling)
    asynchronous = async_plan(cfg, notes, devices, after, sampling)
    if agent:
        multi_turn_async(cfg, notes, asynchronous, fully_async, rollout_class(cfg).__name__)
    return agent, distill, fully_async, asynchronous


def loop_and_run_keys(cfg: VerlConfig, notes: list[str], with_critic: bool, loggers: list[str], resume) -> dict:
    """The Trainer's validation, checkpoint and callback settings (its ``Loop`` and ``RunDir`` groups)."""
    return {"val_every": max(cfg["trainer.test_freq"], 0), "val_n": cfg[f"{R}.val_kwargs"]["n"],
            "save_every": max(cfg["trainer.save_freq"], 0), "run_dir": cfg["trainer.default_local_dir"],
            "resume": resume, "seed": cfg["data.seed"], "keep_checkpoints": keep_checkpoints(cfg, notes, with_critic),
            "critic_warmup_steps": critic_warmup_steps(cfg, notes, with_critic),
            "callbacks": generation_callbacks(cfg, notes) + checkpoint_callbacks(cfg),
            "progress": "console" not in loggers}


def make_plan(cfg: VerlConfig) -> Plan:
    """Resolve every honoured key (after :func:`rlflow.config.verl.validate.check`: every problem at once)."""
    if not cfg.validated:
        check(cfg)
        cfg.validated = True
    notes: list[str] = []
    estimator_cls = registry.ESTIMATORS.resolve(algo := cfg["algorithm.adv_estimator"])
    with_critic = critic_on(cfg, algo, estimator_cls)
    devices = resolve_devices(cfg, notes, with_critic)
    for k, _, _ in tables.not_supported(cfg.flat):  # checked by validation; read: none is reported as unused
        cfg[k]
    procs = devices.processes

    def same(name: str, actor_value: Any = None, critic_value: Any = None, aliases: tuple[str, ...] = (),
             critic_aliases: tuple[str, ...] = ()) -> Any:
        a, c = f"{A}.{name}", f"{C}.{name}"
        return shared(cfg, notes, with_critic, (a,) + aliases, cfg[a] if actor_value is None else actor_value,
                      (c,) + critic_aliases, cfg[c] if critic_value is None and with_critic else critic_value)

    # validation checked that the batch splits into mini-batches of this size (the critic's, when only it is set)
    # and those into micro-batches (rlflow.config.verl.validate.batch_units)
    n, bs, mini = cfg[f"{R}.n"], cfg["data.train_batch_size"], same("ppo_mini_batch_size")
    micro = one_of(cfg, f"{A}.ppo_micro_batch_size_per_gpu", f"{A}.ppo_micro_batch_size", procs)
    temperature, do_sample = cfg[f"{R}.temperature"], cfg[f"{R}.do_sample"]
    temperature = 1.0 if not do_sample and temperature == 0 else temperature  # greedy: the unscaled distribution
    optimizer = optim_kwargs(cfg, notes, with_critic, same, devices)  # lr, schedule, clipping, shuffling
    ppo_epochs, warmup = same("ppo_epochs"), (same("optim.lr_warmup_steps"), same("optim.lr_warmup_steps_ratio"))
    critic_path, critic_kwargs, value_loss_kwargs, micro = (critic_keys(cfg, notes, procs, micro, devices)
                                                            if with_critic else (None, {}, {}, micro))
    before, after, kl_controller, estimator_kwargs, loss_cls, bypass = estimator_and_loss(cfg, estimator_cls, notes)
    reward, overlong = reward_and_shaping(cfg, notes)
    sampling = dynamic_sampling(cfg, notes)
    template_kwargs, policy_loading = chat_template_kwargs(cfg), model_loading(cfg, "actor_rollout_ref")
    policy_loading |= liger(cfg, devices, "actor_rollout_ref")
    agent, distill, fully_async, asynchronous = around_the_rollout(cfg, notes, devices, after, sampling,
                                                                   template_kwargs)
    sp_size = sequence_parallel(cfg, notes, with_critic, procs)
    loggers, resume = logger_names(cfg, notes), resume_arg(cfg)
    rollout_cls, rollout_kwargs = rollout_plan(cfg, devices, notes, n, temperature, do_sample)
    policy_loading |= qat_argument(cfg, notes, A, rollout_cls.__name__)  # quantization-aware training
    critic_kwargs |= qat_argument(cfg, notes, C) if with_critic else {}
    if rollout_cls.__name__ == "VLLMRollout":
        engine_loading(rollout_kwargs, policy_loading)
    import_external_lib(cfg)
    ref_micro, ref_tokens = scoring_split(cfg, *(f"actor_rollout_ref.ref.{k}" for k in REF_SPLIT), procs)
    return Plan(
        cfg=cfg, devices=devices, model_path=cfg["actor_rollout_ref.model.path"],
        vision=bool(cfg[f"{R}.enable_vision"]),
        chat_template=cfg["actor_rollout_ref.model.custom_chat_template"],
        policy_kwargs=policy_keys(cfg, temperature, procs, policy_loading),
        ref_micro_batch_size=ref_micro, ref_max_tokens=ref_tokens,
        rollout_cls=rollout_cls, rollout_kwargs=rollout_kwargs,
        val_sampling=val_sampling(cfg),
        reward=reward,
        estimator_cls=estimator_cls, estimator_kwargs=estimator_kwargs,
        loss_cls=loss_cls, loss_kwargs=class_kwargs(loss_cls, loss_pool(cfg), cfg, fixed=bypass or (
            {"is_weights": True} if any(c.__name__ == tables.ROLLOUT_IS for c, _ in after) else None)),
        before=before, after=after, kl_controller=kl_controller,
        critic_path=critic_path, critic_kwargs=critic_kwargs, value_loss_kwargs=value_loss_kwargs,
        data_kwargs=data_keys(cfg, notes, template_kwargs, agent, procs),
        trainer_kwargs={
            "batch_size": bs, "mini_batch_size": mini, "micro_batch_size": micro, "ppo_epochs": ppo_epochs,
            **optimizer, **loop_and_run_keys(cfg, notes, with_critic, loggers, resume),
            "async_save": bool(same("checkpoint.async_save")),
            "max_tokens_per_micro_batch": token_budget(cfg, with_critic),
            "sequence_parallel_size": sp_size, "balance_batch": cfg["trainer.balance_batch"],
            "accelerator": devices.accelerator, "devices": devices.per_node, "num_nodes": devices.nnodes,
            "strategy": devices.strategy, "precision": devices.precision},
        total_training_steps=cfg["trainer.total_training_steps"], total_epochs=cfg["trainer.total_epochs"],
        warmup=warmup,
        loggers=loggers, project=cfg["trainer.project_name"], experiment=cfg["trainer.experiment_name"],
        val_before_train=cfg["trainer.val_before_train"], val_only=cfg["trainer.val_only"],
        overlong=overlong, dynamic_sampling=sampling, lora=lora_argument(cfg, notes), agent=agent,
        async_rollout=asynchronous, fully_async=fully_async, distillation=distill,
        replay=replay_plan(cfg, notes, asynchronous is not None or fully_async is not None),
        trace=trace_plan(cfg, notes),
        determinism=determinism(cfg, notes, devices.accelerator),
        critic_lora=critic_lora_argument(cfg, notes) if with_critic else None,
        dataset_cls=dataset_class(cfg, notes), ref_model_path=ref_model(cfg, notes), notes=tuple(notes),  # last
    )


def import_external_lib(cfg: VerlConfig) -> None:
    """``model.external_lib``: verl imports it to register custom model classes; so does rlflow."""
    if cfg["actor_rollout_ref.model.external_lib"]:
        importlib.import_module(cfg["actor_rollout_ref.model.external_lib"])


def val_sampling(cfg: VerlConfig) -> dict:
    """Validation's sampling settings (``rollout.val_kwargs``); greedy validation samples the unscaled distribution."""
    val = cfg[f"{R}.val_kwargs"]
    return {"n": val["n"], "do_sample": val["do_sample"], "top_p": val["top_p"], "top_k": val["top_k"],
            "temperature": val["temperature"] if val["do_sample"] else 1.0}


def ref_model(cfg: VerlConfig, notes: list[str]) -> str | None:
    """``actor_rollout_ref.ref.model``: a model folder or hub id (or ``{path: ...}``) for the frozen reference
    in place of a copy of the initial policy; None when unset."""
    key, value = "actor_rollout_ref.ref.model", cfg["actor_rollout_ref.ref.model"]
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"path"})
        if unknown:
            raise ConfigError(f"{key}.{unknown[0]}: the reference model takes only a path here (its tokenizer, "
                              "precision and placement are the policy's)")
        value = value.get("path")
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{key}={value!r}: must be a model folder or hub id (or {{path: ...}})")
    notes.append(f"{key}={value}: the KL reference (when a KL loss or KL in the reward reads it) is this model, "
                 "frozen and scored with the policy's tokenizer, not a copy of the initial policy")
    return value


def overlong_penalty(manager: str, manager_kwargs: dict, response_length: int) -> dict | None:
    """verl's DAPO reward-manager arguments (``overlong_buffer_cfg``, ``max_resp_len``; taken out of
    ``manager_kwargs``, they are not the scorer's) -> OverlongPenalty's kwargs, or None when off.
    (Validation checked the buffer: only with the dapo manager, ``len`` in ``(0, max_resp_len]``.)"""
    if manager != "dapo":
        return None
    buffer, max_len = manager_kwargs.pop("overlong_buffer_cfg", None) or {}, manager_kwargs.pop("max_resp_len", None)
    if not buffer.get("enable"):
        return None
    max_len = max_len or response_length
    return {"max_response_length": max_len, "buffer_len": buffer["len"],
            "penalty_factor": buffer.get("penalty_factor", 1.0)}


def dynamic_sampling(cfg: VerlConfig, notes: list[str]) -> dict | None:
    """verl's ``algorithm.filter_groups`` -> the FilterGroups stage's kwargs, or None when off."""
    if not cfg[f"{FG}.enable"]:
        return None
    metric, cap = cfg[f"{FG}.metric"], cfg[f"{FG}.max_num_gen_batches"]  # metric: checked by validation
    if cap <= 0:
        notes.append(f"{FG}.max_num_gen_batches={cap}: no cap, as in verl (a step generates until "
                     "data.train_batch_size prompts have informative groups)")
    kwargs = {"metric": tables.FILTER_METRICS.get(metric, metric), "max_gen_batches": cap if cap > 0 else sys.maxsize}
    notes.append(f"{FG}: the experience stream gets the stage FilterGroups("
                 f"metric={kwargs['metric']!r}, max_gen_batches={cap if cap > 0 else 'unlimited'}) (DAPO's dynamic "
                 "sampling)")
    return kwargs


def logger_names(cfg: VerlConfig, notes: list[str]) -> list[str]:
    """verl's logger names -> rlflow's (validation checked them), always with ``jsonl``: every run writes
    ``metrics.jsonl`` in its run folder. verl's default wandb is skipped with a note when it is not installed
    (wandb named by the user and not installed was a validation error)."""
    names = []
    for name in cfg["trainer.logger"]:
        if name == "wandb" and tables.wandb_install():
            notes.append("trainer.logger: wandb (in verl's default [console, wandb]) is not installed, so nothing "
                         f"is sent to W&B; `{tables.wandb_install()}` to log there. The metrics are written to "
                         f"{cfg['trainer.default_local_dir']}/metrics.jsonl")
            continue
        if tables.LOGGERS[name] not in names:
            names.append(tables.LOGGERS[name])
    return names if "jsonl" in names else names + ["jsonl"]


def resume_arg(cfg: VerlConfig):
    """auto -> "auto", disable -> None, resume_path -> the path (validation checked the mode and path)."""
    mode, path = cfg["trainer.resume_mode"], cfg["trainer.resume_from_path"]
    return {"auto": "auto", "disable": None}.get(mode, path)
