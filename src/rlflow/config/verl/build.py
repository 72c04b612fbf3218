"""Make the objects of a :class:`~rlflow.config.verl.plan.Plan` through rlflow's public constructors.

This is the one path: what the verl entry point runs is ``Trainer(policy=Policy.from_pretrained(...),
rollout=HFRollout(...), reward=FunctionReward(...), estimator=GRPO(...), loss=PPOLoss(...), ...)``,
exactly what a Python user writes.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from rlflow.algorithms import GreedyBaseline, ValueLoss
from rlflow.config.verl.distillation import check_routes
from rlflow.config.verl.data_classes import data_node, dataset_rows
from rlflow.config.verl.loading import ConfigError
from rlflow.config.verl.lora import make_lora
from rlflow.config.verl.plan import Plan
from rlflow.config.verl.resolve import Fill, instantiate
from rlflow.config.verl.reward_fn import check_data_sources
from rlflow.config.verl.rewards import build_reward as make_reward
from rlflow.data import keys as K
from rlflow.data.prompts import DataError, PromptData
from rlflow.models.checks import ModelFolderError, check_model_folder, check_tokenizer
from rlflow.models.critic import Critic, load_causal_lm
from rlflow.models.hf_config import OverrideError, load_config
from rlflow.models.hub import ModelNotFoundError, locate_model
from rlflow.models.policy import Policy
from rlflow.models.teacher import Teacher
from rlflow.models.vision import load_processor
from rlflow.module import Chain
from rlflow.rewards import OverlongPenalty
from rlflow.rollout import AsyncRollout, FullyAsyncRollout
from rlflow.rollout.agent import AgentLoop
from rlflow.rollout.stream import Experience, FilterGroups
from rlflow.trainer.loggers import make_loggers
from rlflow.trainer.options import groups
from rlflow.trainer.trainer import Trainer


def local_model(path: str, key: str) -> str:
    """What transformers should load for the model at ``key``: a local folder, a cached hub model when
    offline, or the hub id itself when the hub is reachable (see :mod:`rlflow.models.hub`)."""
    try:
        return locate_model(path, key).path
    except ModelNotFoundError as e:
        raise ConfigError(str(e)) from None


def model_files(plan: Plan) -> dict[str, str]:
    """What transformers loads for the policy: its model, and its tokenizer and config (verl's
    ``model.tokenizer_path`` / ``model.hf_config_path``: the model folder unless set)."""
    model = local_model(plan.model_path, "actor_rollout_ref.model.path")
    given = {k: local_model(plan.policy_kwargs[k], f"actor_rollout_ref.model.{key}")
             for k, key in (("tokenizer_path", "tokenizer_path"), ("config_path", "hf_config_path"))
             if plan.policy_kwargs.get(k)}
    return {"model": model, "tokenizer_path": model, "config_path": model} | given


def load_tokenizer(plan: Plan):
    """The policy's tokenizer alone (the dry run needs no weights)."""
    from transformers import AutoTokenizer

    kw = plan.policy_kwargs
    trust = kw.get("tokenizer_trust_remote_code", kw.get("trust_remote_code", False))
    source = kw.get("tokenizer_path") or plan.model_path
    with remote_code_errors("actor_rollout_ref.model.path", TRUST_TOKENIZER):
        tok = AutoTokenizer.from_pretrained(model_files(plan)["tokenizer_path"], padding_side="left",
                                            trust_remote_code=trust)
    try:
        check_tokenizer(tok, source=source)
    except ModelFolderError as e:
        raise ConfigError(f"actor_rollout_ref.model.path: {e}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if plan.chat_template:
        tok.chat_template = plan.chat_template
    return tok


def load_vision_processor(plan: Plan):
    """The processor of an image-text-to-text model folder (its images' size bounds from ``data.min/max_pixels``),
    else ``None``; no weights are read."""
    files, kw = model_files(plan), plan.policy_kwargs
    if getattr(policy_config(plan), "vision_config", None) is None:
        return None
    trust = kw.get("tokenizer_trust_remote_code", kw.get("trust_remote_code", False))
    with remote_code_errors("actor_rollout_ref.model.path", TRUST_TOKENIZER):
        return load_processor(files["tokenizer_path"], kw.get("min_pixels"), kw.get("max_pixels"),
                              trust_remote_code=trust)


TRUST = "actor_rollout_ref.model.trust_remote_code"
TRUST_TOKENIZER = f"{TRUST}=True, or data.trust_remote_code=True for the tokenizer alone"


@contextmanager
def remote_code_errors(path_key: str, trust_key: str, override_key: str | None = None):
    """transformers' refusal to run a folder's own code, and a config override it cannot take, as a
    :class:`ConfigError` naming the verl key that changes it."""
    try:
        yield
    except OverrideError as e:
        raise ConfigError(f"{override_key}{str(e).removeprefix('override_config')}" if override_key else str(e)) \
            from None
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise ConfigError(f"{path_key}: {e} (verl key: {trust_key})") from None


def policy_config(plan: Plan):
    """The policy's transformers config (``model.hf_config_path`` when set) with its overrides (no weights read)."""
    kw, key = plan.policy_kwargs, "actor_rollout_ref.model"
    with remote_code_errors(f"{key}.path", f"{TRUST}=True", f"{key}.override_config"):
        return load_config(model_files(plan)["config_path"], kw.get("override_config"),
                           kw.get("trust_remote_code", False))


def build_data(plan: Plan, tokenizer, processor=None) -> PromptData:
    """The prompts, filtered once with the policy's tokenizer; the built-in reward must cover their sources.

    A vision-language policy's ``processor`` reads the rows' images (``data.image_key``)."""
    kw = dict(plan.data_kwargs)
    if processor is not None and kw.get("image_patch_size", 0) is None:  # verl: the processor's own patch size
        kw["image_patch_size"] = getattr(getattr(processor, "image_processor", None), "patch_size", 14)
    if plan.dataset_cls is not None:  # data.custom_cls: the user's class reads the files; rlflow takes its rows
        node, cap = data_node(plan.cfg), {"train": "train_max_samples", "val": "val_max_samples"}
        for split in ("train", "val"):
            if kw[split] is not None:
                kw[split] = dataset_rows(plan.dataset_cls, kw[split], split, tokenizer, processor, node,
                                         kw.get(cap[split]) or -1)
    if processor is None and kw.get("mm_processor_kwargs"):
        plan.notes.append(f"data.mm_processor_kwargs={kw['mm_processor_kwargs']!r} has no effect: "
                          f"{plan.model_path} has no processor (not a vision-language model)")
    try:
        data = PromptData(kw.pop("train"), val=kw.pop("val"), processor=processor, **kw)
    except DataError as e:
        raise ConfigError(f"data.train_files / data.val_files: {e}") from e
    if any(data.skipped_images.values()):
        plan.notes.append(f"data.bad_images=skip: dropped {data.skipped_images['train']} training and "
                          f"{data.skipped_images['val']} validation row(s) with a missing or corrupt image")
    if any(data.skipped.values()):
        plan.notes.append(f"data.missing_ground_truth=skip: dropped {data.skipped['train']} training and "
                          f"{data.skipped['val']} validation row(s) without reward_model.ground_truth")
    try:
        dropped = data.filter_overlong(tokenizer)
    except DataError as e:
        raise ConfigError(f"data.train_files / data.val_files: {e}") from e
    if any(dropped.values()):
        plan.notes.append(f"data.filter_overlong_prompts: dropped {dropped['train']} training and {dropped['val']} "
                          f"validation prompt(s) longer than max_prompt_length={data.max_prompt_length} tokens")
    if not plan.custom_reward and plan.reward.functions:  # the built-in scorers must know every data_source
        check_data_sources({r["data_source"] for r in data.train + data.val}, f"{data.train_name}")
    check_routes(plan.distillation, {r["data_source"] for r in data.train + data.val}, data.train_name)
    return data


def total_steps(plan: Plan, data: PromptData) -> int:
    """verl's rule: ``trainer.total_training_steps`` if set, else epochs x (prompts // train_batch_size)."""
    batch = plan.trainer_kwargs["batch_size"]
    if batch > len(data.train):
        raise ConfigError(f"data.train_batch_size={batch} > {len(data.train)} training prompts in {data.train_name}")
    return plan.total_training_steps or plan.total_epochs * (len(data.train) // batch)


def warmup_steps(plan: Plan, total: int) -> int:
    """verl's: lr_warmup_steps when > 0, else lr_warmup_steps_ratio x the decay steps (Megatron's lr_decay_steps
    when set, else all steps)."""
    steps, ratio = plan.warmup
    decay = getattr(plan.trainer_kwargs["lr_schedule"], "decay_steps", None) or total
    return steps if steps and steps > 0 else int(ratio * decay)


def critic_config(plan: Plan):
    """The critic's transformers config with its overrides (no weights read)."""
    kw, key = plan.critic_kwargs, "critic.model"
    with remote_code_errors(f"{key}.path", f"{key}.trust_remote_code=True", f"{key}.override_config"):
        config = kw.get("config_path") and local_model(kw["config_path"], f"{key}.hf_config_path")
        return load_config(config or local_model(plan.critic_path, f"{key}.path"), kw.get("override_config"),
                           kw.get("trust_remote_code", False))


def build_policy(plan: Plan) -> Policy:
    key = "actor_rollout_ref.model"
    files, kwargs = model_files(plan), dict(plan.policy_kwargs)
    kwargs |= {k: files[k] for k in ("tokenizer_path", "config_path") if k in kwargs}
    if kwargs.get("freeze_vision_tower") and getattr(policy_config(plan), "vision_config", None) is None:
        del kwargs["freeze_vision_tower"]  # as verl: nothing to freeze
        plan.notes.append(f"actor_rollout_ref.actor.freeze_vision_tower=True: {plan.model_path} is a text model, "
                          "so there is no vision tower to freeze")
    try:
        with remote_code_errors(f"{key}.path", f"{TRUST}=True", f"{key}.override_config"):
            policy = Policy.from_pretrained(files["model"], **kwargs, lora=make_lora(plan.lora),
                                            chat_template=plan.chat_template)
    except ModelFolderError as e:
        raise ConfigError(f"actor_rollout_ref.model.path: {e}") from None
    if plan.vision and policy.processor is None:
        raise ConfigError(f"actor_rollout_ref.rollout.enable_vision=True but actor_rollout_ref.model.path="
                          f"{plan.model_path} is not an image-text-to-text model (its config has no vision_config)")
    return policy


def build_reference(plan: Plan, policy: Policy) -> Policy:
    """The frozen KL reference: a copy of the initial policy, or ``actor_rollout_ref.ref.model``'s weights with
    the policy's tokenizer (the vocabularies must agree: its log-probs are of the policy's token ids)."""
    if plan.ref_model_path is None:
        return policy.reference()
    key = "actor_rollout_ref.ref.model"
    path = local_model(plan.ref_model_path, key)
    try:
        check_model_folder(path, tokenizer=False)
    except ModelFolderError as e:
        raise ConfigError(f"{key}: {e}") from None
    with remote_code_errors(key, f"{TRUST}=True"):
        model = load_causal_lm(path, plan.policy_kwargs.get("trust_remote_code", False)).eval().requires_grad_(False)
    ours, theirs = (m.get_output_embeddings().weight.shape[0] for m in (policy.model, model))
    if ours != theirs:
        raise ConfigError(f"{key}={plan.ref_model_path}: its vocabulary has {theirs} tokens, the policy's "
                          f"({plan.model_path}) {ours}; the reference scores the policy's token ids, so they must agree")
    return Policy(model, policy.tokenizer, processor=policy.processor, temperature=policy.temperature,
                  micro_batch_size=policy.micro_batch_size, max_tokens_per_micro_batch=policy.max_tokens_per_micro_batch,
                  log_prob_key=K.REF_LOG_PROBS, entropy_key=None, remove_padding=policy.remove_padding,
                  share_prompts=policy.share_prompts)


def build_critic(plan: Plan) -> Critic:
    kw = dict(plan.critic_kwargs)
    path = local_model(plan.critic_path, "critic.model.path")
    try:
        check_model_folder(path, tokenizer=False)
    except ModelFolderError as e:
        raise ConfigError(f"critic.model.path: {e}") from None
    config = kw.pop("config_path", None)  # critic.model.hf_config_path: the model config, when not the folder's
    config = local_model(config, "critic.model.hf_config_path") if config else None
    with remote_code_errors("critic.model.path", "critic.model.trust_remote_code=True", "critic.model.override_config"):
        return Critic.from_pretrained(path, config_path=config, **kw, lora=make_lora(plan.critic_lora))


def build_reward(plan: Plan):
    """The reward of ``plan.reward`` (functions, a reward model, or both; ``rlflow.config.verl.rewards``), shaped by
    ``OverlongPenalty`` when the DAPO reward manager asks for it.

    A reward model is loaded once per plan: a second call (ReMax's greedy baseline scores with the reward
    too) returns the same object.
    """
    if plan.reward.model is not None and plan.reward.built is not None:
        return plan.reward.built
    reward = make_reward(plan.reward, local_model)
    if plan.overlong:
        reward = instantiate(OverlongPenalty, {"reward": reward, **plan.overlong},
                             "reward_model.reward_kwargs.overlong_buffer_cfg.*")
    plan.reward.built = reward
    return reward


def build_estimator(plan: Plan, rollout, loss) -> tuple:
    """The estimator, chained with the modules around it: ``Chain(KLInReward(...), GRPO(), loss.selection())``,
    and the stages of the experience stream among them (ReMax's ``GreedyBaseline`` generates: a stage of its own,
    after DAPO's ``FilterGroups`` when ``algorithm.filter_groups`` is on)."""
    estimator = instantiate(plan.estimator_cls, plan.estimator_kwargs, "algorithm.*")
    made = {"rollout": rollout, "reward": build_reward(plan)}  # a reward of its own (its stats)
    if plan.kl_controller:
        made["KL controller"] = instantiate(*plan.kl_controller, "algorithm.kl_ctrl.*")

    def make(cls, kwargs):
        return instantiate(cls, {k: made[v.name] if isinstance(v, Fill) else v for k, v in kwargs.items()},
                           f"{cls.__name__} from algorithm.*")

    before = [make(*m) for m in plan.before]
    stages = [m for m in before if isinstance(m, GreedyBaseline)]
    if plan.dynamic_sampling:
        stages.insert(0, instantiate(FilterGroups, plan.dynamic_sampling, "algorithm.filter_groups.*"))
    modules = [m for m in before if m not in stages] + [estimator] + [make(*m) for m in plan.after]
    if hasattr(loss, "selection"):  # covariance losses choose their tokens once per step, over the whole batch
        modules.append(loss.selection())
    return (Chain(*modules) if len(modules) > 1 else estimator), stages


def with_distillation(plan: Plan, policy: Policy, loss, stages: list) -> tuple:
    """verl's ``distillation.*`` (``rlflow.config.verl.distillation``): the loss around the RL loss (or alone), and the
    :class:`~rlflow.models.teacher.Teacher` stage last, scoring with the policy's scoring split."""
    if plan.distillation is None:
        return loss, stages
    d = plan.distillation
    split = {"micro_batch_size": policy.micro_batch_size, "remove_padding": policy.remove_padding,
             "max_tokens_per_micro_batch": policy.max_tokens_per_micro_batch}

    def load(teacher: dict) -> Policy:
        t = Policy.from_pretrained(local_model(teacher["path"], teacher["key"]), **split)
        if t.tokenizer.get_vocab() != policy.tokenizer.get_vocab():  # the student's ids are fed to it as they are
            raise ConfigError(f"{teacher['key']}={teacher['path']}: the teacher's tokenizer differs from the student's "
                              f"({plan.model_path}); distillation needs one vocabulary")
        return t

    top_k = d.get("top_k")
    teachers = (Teacher({k: load(t) for k, t in d["teachers"].items()}, route_key=d["route_key"], top_k=top_k)
                if d["route_key"] else Teacher(load(d["teachers"]), top_k=top_k))
    distill = instantiate(d["loss_cls"], {"rl_loss": loss if d["rl"] else None, **d["loss_kwargs"]},
                          "distillation.distillation_loss.*")
    return distill, [*stages, teachers]


def build_trainer(plan: Plan, data: PromptData | None = None) -> tuple[Trainer, PromptData]:
    """The Trainer and the prompts of this plan (data is loaded here unless given)."""
    policy = build_policy(plan)
    if policy.processor is not None and not getattr(plan.rollout_cls, "makes_image_engine", False):
        raise ConfigError(
            f"actor_rollout_ref.rollout.name: {plan.model_path} is a vision-language model, but "
            f"{plan.rollout_cls.__name__} takes no images yet (vLLM's multimodal input path builds the model's "
            "transformers AutoProcessor, whose Qwen2-VL video processor needs torchvision, which rlflow's CPU "
            "install removes); set actor_rollout_ref.rollout.name=hf")
    data = data or build_data(plan, policy.tokenizer, policy.processor)
    total = total_steps(plan, data)
    loss = instantiate(plan.loss_cls, plan.loss_kwargs, "actor_rollout_ref.actor.*")
    rollout = instantiate(plan.rollout_cls, plan.rollout_kwargs, "actor_rollout_ref.rollout.*")
    if plan.agent is not None:  # multi-turn: the agent loop samples each turn with the rollout's engine
        rollout = instantiate(AgentLoop, {"rollout": rollout, **plan.agent}, "actor_rollout_ref.rollout.multi_turn.*")
    if plan.async_rollout is not None:  # generation beside training (trainer.async_weight_update)
        rollout = instantiate(AsyncRollout, {"rollout": rollout, **plan.async_rollout}, "async_training.*")
    if plan.fully_async is not None:  # fully asynchronous with partial rollouts (trainer.v1.trainer_mode=*_async)
        rollout = instantiate(FullyAsyncRollout, {"rollout": rollout, **plan.fully_async}, "trainer.v1.*")
    estimator, stages = build_estimator(plan, rollout, loss)
    loss, stages = with_distillation(plan, policy, loss, stages)
    reference = "auto"
    wants_ref = K.REF_LOG_PROBS in set(loss.in_keys) | set(estimator.in_keys)
    if wants_ref:  # its own scoring split (verl's ref.log_prob_*): a token budget only with its dynamic bsz on,
        reference = build_reference(plan, policy)  # else its micro size (unset: the policy's)
        reference.max_tokens_per_micro_batch = plan.ref_max_tokens
        if plan.ref_max_tokens or plan.ref_micro_batch_size is not None:
            reference.micro_batch_size = plan.ref_micro_batch_size
    elif plan.ref_model_path is not None:
        plan.notes.append(f"actor_rollout_ref.ref.model={plan.ref_model_path} has no effect: nothing in this run reads "
                          "reference log-probs (no KL loss or KL in the reward)")
    critic, value_loss = None, None
    if plan.critic_path is not None:
        critic = build_critic(plan)
        value_loss = instantiate(ValueLoss, plan.value_loss_kwargs, "critic.cliprange_value / critic.loss_agg_mode")
    run_dir = Path(plan.trainer_kwargs["run_dir"]).expanduser()
    loggers = make_loggers(plan.loggers, run_dir, project=plan.project, experiment=plan.experiment)
    train_reward = build_reward(plan)
    train_reward.columns = tuple(plan.estimator_kwargs.get("reward_keys") or ())  # GDPO reads these per-key rewards
    settings = {k: v for k, v in plan.trainer_kwargs.items() if k != "callbacks"} | {  # -> Optim(...), Loop(...), ...
        "max_steps": total, "epochs": plan.total_epochs, "warmup_steps": warmup_steps(plan, total),
        "loggers": loggers, "val_sampling": plan.val_sampling, "run_dir": run_dir}
    trainer = Trainer(
        policy=policy, experience=Experience(rollout, train_reward, stages), estimator=estimator, loss=loss,
        reference=reference, critic=critic, value_loss=value_loss, callbacks=plan.trainer_kwargs["callbacks"],
        **groups(**settings),
    )
    return trainer, data
