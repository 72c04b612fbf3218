"""A verl command as a component tree: the ``_target_`` nodes that ``rlflow train TREE.yaml`` instantiates.

:func:`verl_tree` writes the objects of a :class:`~rlflow.config.verl.plan.Plan` -- what
:func:`rlflow.config.verl.build.build_trainer` makes from verl's keys -- as a tree of public constructors:
``Policy.from_pretrained``, ``HFRollout``, ``FunctionReward``, ``GRPO``, ``PPOLoss``, the Trainer's five groups and
``PromptData``. The dry run prints it as the Python a user would write (:mod:`rlflow.config.components_python`),
and ``tests/config/test_verl_component_tree.py`` builds that tree with :func:`rlflow.config.components.build` and
checks that its first steps log what the verl command logs.

A part the public constructors cannot say yet is *deferred*: the tree keeps the closest node and
:class:`VerlTree` lists the part with the reason (a reference model of its own, prompts a user's dataset class
reads, ...); the dry run prints that list under the Python.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlflow.algorithms import ValueLoss
from rlflow.config.verl.agent import CATALOGUE
from rlflow.config.verl.folders import load_vision_processor, local_model, model_files, vision_policy
from rlflow.config.verl.rewards import RM, RewardPlan
from rlflow.config.components import locate
from rlflow.config.verl.resolve import Fill, init_parameters
from rlflow.registry import FILE_MODULES
from rlflow.trainer.options import groups

LOGGERS_BY_NAME = {"jsonl", "csv", "tensorboard", "console"}  # made from the name alone (no project/experiment)


@dataclass
class VerlTree:
    """The tree of a verl command and the parts it does not say yet (``path: reason``)."""

    tree: dict
    deferred: list[str] = field(default_factory=list)


def spec(obj: Any) -> str | None:
    """The shortest import path of a class or function (``rlflow.GRPO``, not ``rlflow.algorithms.estimators.GRPO``),
    or ``file.py:name`` for one loaded from a file; None when it has no name to import it by."""
    name = getattr(obj, "__qualname__", None)
    module = getattr(obj, "__module__", None)
    if not name or not module or "<" in name:
        return None
    parts = module.split(".") if not module.startswith(FILE_MODULES) else []  # a file's: by file, below
    for i in range(1, len(parts) + 1):  # the shortest package that exports it
        prefix = ".".join(parts[:i])
        try:
            found = functools.reduce(getattr, name.split("."), importlib.import_module(prefix))
        except (ImportError, AttributeError):
            continue
        if found is obj:
            return f"{prefix}.{name}"
    from_file = module.startswith(FILE_MODULES) and (inspect.isfunction(obj) or inspect.isclass(obj))
    source = inspect.getsourcefile(obj) if from_file else None
    return f"{source}:{name}" if source and "." not in name else None


def node(value: Any, where: str, deferred: list[str]) -> Any:
    """``value`` as a tree value: data as it is, a function or class as ``hydra.utils.get_*`` of its path, a
    ``functools.partial`` as a ``_partial_`` node, a dataclass as a node of its fields; anything else is deferred
    (its ``repr`` stands in)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [node(v, f"{where}[{i}]", deferred) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {str(k): node(v, f"{where}.{k}", deferred) for k, v in value.items()}
    if isinstance(value, functools.partial) and spec(value.func):
        args = {"_args_": node(list(value.args), where, deferred)} if value.args else {}
        return {"_target_": spec(value.func), "_partial_": True, **args, **node(value.keywords, where, deferred)}
    if (inspect.isfunction(value) or inspect.isclass(value)) and spec(value):
        return {"_target_": f"hydra.utils.get_{'class' if inspect.isclass(value) else 'method'}", "path": spec(value)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and spec(type(value)):
        return {"_target_": spec(type(value)), **{f.name: node(getattr(value, f.name), f"{where}.{f.name}", deferred)
                                                  for f in dataclasses.fields(value) if f.init}}
    deferred.append(f"{where}: {value!r} (an object the tree cannot name yet: the run passes the object itself)")
    return value


def call(cls_or_fn: Any, kwargs: dict, where: str, deferred: list[str]) -> dict:
    """A node calling ``cls_or_fn`` with ``kwargs``."""
    target = spec(cls_or_fn)
    if target is None:
        deferred.append(f"{where}: {cls_or_fn!r} has no import path (the run calls it itself)")
        target = cls_or_fn
    return {"_target_": target, **node(kwargs, where, deferred)}


def policy_node(plan, deferred: list[str]) -> dict:
    """``Policy.from_pretrained`` with the folders :func:`rlflow.config.verl.build.build_policy` loads."""
    files, kwargs = model_files(plan), dict(plan.policy_kwargs)
    kwargs |= {k: files[k] for k in ("tokenizer_path", "config_path") if k in kwargs}
    if kwargs.get("freeze_vision_tower") and not vision_policy(plan):
        del kwargs["freeze_vision_tower"]  # as build_policy: a text model has no vision tower
    out = {"_target_": "rlflow.Policy.from_pretrained", "path": files["model"], **node(kwargs, "policy", deferred)}
    if isinstance(plan.lora, dict):
        out["lora"] = {"_target_": "peft.LoraConfig", **node(plan.lora, "policy.lora", deferred)}
    elif plan.lora is not None:
        out["lora"] = plan.lora
    if plan.chat_template:
        out["chat_template"] = plan.chat_template
    return out


MT = "actor_rollout_ref.rollout.multi_turn"
# AgentLoop's argument <- the verl key of the file it is loaded from, and the loader (one file each)
AGENT_FILES = {"interaction": (f"{MT}.interaction_config_path", "rlflow.rollout.tools.config.load_interaction_config")}
TOOL_FILES = {f"{MT}.tool_config_path": "rlflow.rollout.tools.config.load_tool_config",
              f"{MT}.function_tool_path": "rlflow.rollout.tools.functions.load_function_tools"}


def agent_kwargs(plan) -> dict:
    """AgentLoop's arguments, its tools and interactions as the loaders of their files (tools from one file; from
    a tool YAML and a Python file both, the loaded objects themselves)."""
    kwargs = dict(plan.agent)
    _, _, multi_turn = kwargs.pop(CATALOGUE)
    files = {key: plan.cfg[key] for key in TOOL_FILES if plan.cfg[key]}
    if len(files) == 1:
        (key, path), = files.items()
        kwargs["tools"] = {"_target_": TOOL_FILES[key], "path": str(Path(path).expanduser().resolve())}
    for arg, (key, loader) in AGENT_FILES.items():
        if plan.cfg[key]:
            kwargs[arg] = {"_target_": loader, "path": str(Path(plan.cfg[key]).expanduser().resolve())}
    if "agents" in kwargs:  # the loops the data's rows name (agent_name): made over the same rollout
        shared = {k: v for k, v in kwargs.items() if k in multi_turn or k == "template_kwargs"}
        plain = {k: v for k, v in shared.items() if k == "template_kwargs"}
        kwargs["agents"] = {name: {"_target_": spec(cls) if cls else "rlflow.rollout.agent.AgentLoop",
                                   "_partial_": True, **(shared if with_keys else plain), **fields}
                            for name, (cls, fields, with_keys) in kwargs["agents"].items()}
    return kwargs


def rollout_node(plan, deferred: list[str]) -> dict:
    """The rollout and the wrappers build_trainer puts around it (agent loop, rollout tracing, replay of dumped
    rollouts, asynchronous generation)."""
    rollout = call(plan.rollout_cls, plan.rollout_kwargs, "rollout", deferred)
    agent = agent_kwargs(plan) if plan.agent is not None else None
    loop = spec(agent.pop("loop_class")) if agent and "loop_class" in agent else "rlflow.rollout.agent.AgentLoop"
    for kwargs, target in ((agent, loop), (plan.trace, "rlflow.rollout.TracedRollout"),
                           (plan.replay, "rlflow.rollout.ReplayRollout"),
                           (plan.async_rollout, "rlflow.rollout.AsyncRollout"),
                           (plan.fully_async, "rlflow.rollout.FullyAsyncRollout")):
        if kwargs is not None:
            rollout = {"_target_": target, "rollout": rollout, **node(kwargs, "rollout", deferred)}
    return rollout


def reward_node(reward: RewardPlan, overlong: dict | None, deferred: list[str]) -> dict:
    """:func:`rlflow.config.verl.rewards.build_reward` as nodes; DAPO's overlong shaping around it."""
    timing = {"timeout_s": reward.timeout_s, "processes": reward.processes}
    parts = [(name, {"_target_": "rlflow.FunctionReward", "fn": node(fn, "reward.fn", deferred), **timing,
                     "name": name}, weight) for name, fn, weight in reward.functions]
    if reward.manager is not None:
        user = reward.manager
        score = {"compute_score": reward.functions[0][1]} if user.compute_score else {}
        parts = [(user.cls.__name__, call(user.cls, {**score, **user.kwargs}, "reward", deferred), 1.0)]
    out = None
    if reward.model is not None:
        kwargs = dict(reward.model)
        model = {"_target_": "rlflow.rewards.ModelReward.from_pretrained",
                 "path": local_model(kwargs.pop("path"), f"{RM}.model.path"), "name": "reward_model",
                 **node(kwargs, "reward", deferred)}
        if reward.mode == "model":
            out = model
        elif reward.mode == "rm_argument":
            out = {"_target_": "rlflow.rewards.WithRMScore", "model": model, "reward": parts[0][1]}
        else:
            parts = [("reward_model", model, reward.model_weight)] + parts
    if out is None:
        out = (parts[0][1] if len(parts) == 1 and parts[0][2] == 1.0 else
               {"_target_": "rlflow.rewards.CombinedReward", "rewards": {n: r for n, r, _ in parts},
                "weights": {n: w for n, _, w in parts}})
    if overlong:
        out = {"_target_": "rlflow.rewards.OverlongPenalty", "reward": out, **overlong}
    return out


def estimator_nodes(plan, loss: dict, deferred: list[str]) -> tuple[dict, list]:
    """The estimator (a ``Chain`` with the modules around it) and the stages of the experience stream, as
    the verl keys ask; ReMax's ``GreedyBaseline`` as a stage uses the run's own rollout and a reward of its own (its
    stats apart from the training reward's), or the run's own when that is a reward model (loaded once)."""
    controller = call(*plan.kl_controller, "estimator.controller", deferred) if plan.kl_controller else None

    def module(cls, kwargs, where):
        filled = {k: controller for k, v in kwargs.items() if isinstance(v, Fill) and v.name == "KL controller"}
        plain = {k: v for k, v in kwargs.items() if not isinstance(v, Fill)}
        return {**call(cls, plain, where, deferred), **filled}

    before = [(cls, kw) for cls, kw in plan.before if cls.__name__ != "GreedyBaseline"]
    stages = ([{"_target_": "rlflow.rollout.stream.FilterGroups", **plan.dynamic_sampling}]
              if plan.dynamic_sampling else [])
    own = {} if plan.reward.model is not None else {"reward": reward_node(plan.reward, plan.overlong, deferred)}
    stages += [{"_target_": spec(cls), **own} for cls, _ in plan.before if cls.__name__ == "GreedyBaseline"]
    modules = ([module(c, k, "estimator") for c, k in before] + [call(plan.estimator_cls, plan.estimator_kwargs,
                                                                      "estimator", deferred)]
               + [module(c, k, "estimator") for c, k in plan.after])
    if hasattr(plan.loss_cls, "selection"):  # loss.selection(): a covariance loss's tokens, chosen once per step
        modules.append({"_target_": "rlflow.algorithms.policy_losses.CovSelection", "loss": loss})
    estimator = modules[0] if len(modules) == 1 else {"_target_": "rlflow.module.Chain", "_args_": modules}
    return estimator, stages


def teacher_node(plan, d: dict) -> dict:
    """verl's ``distillation.teacher_models`` as ``Teacher.from_pretrained`` (one path, or one per route value)."""
    teachers = d["teachers"]
    paths = ({k: local_model(t["path"], t["key"]) for k, t in teachers.items()} if d["route_key"]
             else local_model(teachers["path"], teachers["key"]))
    split = {k: plan.policy_kwargs.get(k) for k in ("micro_batch_size", "remove_padding", "max_tokens_per_micro_batch")}
    return {"_target_": "rlflow.models.teacher.Teacher.from_pretrained", "paths": paths,
            **({"route_key": d["route_key"]} if d["route_key"] else {}), "top_k": d.get("top_k"), **split}


def trainer_groups(plan, total: int, deferred: list[str]) -> dict:
    """The Trainer's five groups (``Optim``, ``Batching``, ``Loop``, ``RunDir``, ``Hardware``) as build_trainer
    fills them; the loggers by name when their name is all they need."""
    run_dir = str(Path(plan.trainer_kwargs["run_dir"]).expanduser())
    loggers: Any = list(plan.loggers)
    if set(loggers) - LOGGERS_BY_NAME:
        loggers = {"_target_": "rlflow.trainer.loggers.make_loggers", "names": loggers, "run_dir": run_dir,
                   "project": plan.project, "experiment": plan.experiment}
    settings = {k: v for k, v in plan.trainer_kwargs.items() if k != "callbacks"} | {
        "max_steps": total, "epochs": plan.total_epochs, "warmup_steps": warmup_steps(plan, total),
        "val_sampling": plan.val_sampling, "run_dir": run_dir}
    strategy, strategy_kwargs = settings["strategy"], plan.devices.strategy_kwargs
    if strategy_kwargs is not None:  # a strategy object (Megatron's): a node of its class and arguments
        settings["strategy"] = None
    out = {arg: node(group, arg, deferred) for arg, group in groups(**settings).items()}
    out["run"]["loggers"] = loggers
    if strategy_kwargs is not None:
        given = {k: v for k, v in strategy_kwargs.items() if v != {}}  # an empty mapping is its default None
        out["hardware"]["strategy"] = call(type(strategy), given, "hardware.strategy", deferred)
    return out


def prompts_node(plan, deferred: list[str]) -> dict:
    """``PromptData`` with the data keys (the prompts over ``max_prompt_length`` are dropped by ``fit``), and a
    vision-language policy's processor (``load_processor`` of its folder, bounded by ``data.min/max_pixels``)."""
    kwargs = dict(plan.data_kwargs)
    if plan.dataset_cls is not None:
        deferred.append("data: data.custom_cls reads the files with the policy's tokenizer")
    kw = plan.policy_kwargs
    if vision_policy(plan):
        kwargs["processor"] = {"_target_": "rlflow.models.vision.load_processor",
                               "path": model_files(plan)["tokenizer_path"], "min_pixels": kw.get("min_pixels"),
                               "max_pixels": kw.get("max_pixels"),
                               "trust_remote_code": kw.get("tokenizer_trust_remote_code",
                                                           kw.get("trust_remote_code", False))}
        if kwargs.get("image_patch_size", 0) is None:  # verl: the processor's own patch size
            processor = load_vision_processor(plan)
            kwargs["image_patch_size"] = getattr(getattr(processor, "image_processor", None), "patch_size", 14)
    train, val = kwargs.pop("train"), kwargs.pop("val")
    return {"_target_": "rlflow.PromptData", "train": node(train, "data.train", deferred),
            "val": node(val, "data.val", deferred), **node(kwargs, "data", deferred)}


def reference_node(plan) -> dict | None:
    """verl's ``actor_rollout_ref.ref.*``: weights (``ref.model``) or a scoring split of the reference's own, as a
    ``functools.partial`` of :func:`rlflow.models.reference.frozen_reference` the Trainer calls with its policy;
    ``None`` (the Trainer's ``"auto"``: a copy with the policy's split) otherwise. The split: a token budget only
    with the reference's dynamic batch size on, and then its micro size; else its micro size (unset: the policy's)."""
    tokens = plan.ref_max_tokens
    micro = (plan.ref_micro_batch_size if tokens or plan.ref_micro_batch_size is not None
             else plan.policy_kwargs.get("micro_batch_size"))
    same = (micro, tokens) == (plan.policy_kwargs.get("micro_batch_size"),
                               plan.policy_kwargs.get("max_tokens_per_micro_batch"))
    if plan.ref_model_path is None and same:
        return None
    path = (local_model(plan.ref_model_path, "actor_rollout_ref.ref.model") if plan.ref_model_path is not None
            else None)
    trust = plan.policy_kwargs.get("trust_remote_code", False)
    return {"_target_": "rlflow.models.reference.frozen_reference", "_partial_": True,
            **({"path": path} if path else {}), "micro_batch_size": micro, "max_tokens_per_micro_batch": tokens,
            **({"trust_remote_code": True} if trust and path else {})}


def warmup_steps(plan, total: int) -> int:
    """verl's: lr_warmup_steps when > 0, else lr_warmup_steps_ratio x the decay steps (Megatron's lr_decay_steps
    when set, else all steps)."""
    steps, ratio = plan.warmup
    decay = getattr(plan.trainer_kwargs["lr_schedule"], "decay_steps", None) or total
    return steps if steps and steps > 0 else int(ratio * decay)


def verl_tree(plan, total: int) -> VerlTree:
    """The component tree of ``plan`` for a run of ``total`` steps (:func:`rlflow.config.verl.build.total_steps`)."""
    deferred: list[str] = []
    loss = call(plan.loss_cls, plan.loss_kwargs, "loss", deferred)
    estimator, stages = estimator_nodes(plan, loss, deferred)
    if plan.distillation is not None:  # the teacher scores last, with the policy's scoring split
        d = plan.distillation
        loss = call(d["loss_cls"], {"rl_loss": loss if d["rl"] else None, **d["loss_kwargs"]}, "loss", deferred)
        stages.append(teacher_node(plan, d))
    reward = reward_node(plan.reward, plan.overlong, deferred)
    if plan.estimator_kwargs.get("reward_keys"):  # GDPO reads these per-key rewards
        reward = {"_target_": "rlflow.rewards.with_columns", "reward": reward,
                  "columns": list(plan.estimator_kwargs["reward_keys"])}
    tree = {"policy": policy_node(plan, deferred), "rollout": rollout_node(plan, deferred), "reward": reward,
            "estimator": estimator, "loss": loss}
    if stages:
        tree["stages"] = stages
    reference = reference_node(plan)
    if reference is not None:
        tree["reference"] = reference
    if plan.critic_path is not None:
        kw = dict(plan.critic_kwargs)
        if kw.get("config_path"):
            kw["config_path"] = local_model(kw["config_path"], "critic.model.hf_config_path")
        tree["critic"] = {"_target_": "rlflow.Critic.from_pretrained",
                          "path": local_model(plan.critic_path, "critic.model.path"), **node(kw, "critic", deferred)}
        if plan.critic_lora is not None:
            lora = plan.critic_lora
            tree["critic"]["lora"] = ({"_target_": "peft.LoraConfig", **lora} if isinstance(lora, dict) else lora)
        tree["value_loss"] = call(ValueLoss, plan.value_loss_kwargs, "value_loss", deferred)
    if plan.trainer_kwargs["callbacks"]:
        tree["callbacks"] = node(plan.trainer_kwargs["callbacks"], "callbacks", deferred)
    tree |= trainer_groups(plan, total, deferred)
    tree["data"] = prompts_node(plan, deferred)
    return VerlTree(without_defaults(tree), deferred)


def without_defaults(value: Any) -> Any:
    """The tree with each argument that equals its callable's default left out (the Python a user would write)."""
    if isinstance(value, list):
        return [without_defaults(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {k: without_defaults(v) for k, v in value.items()}
    target = out.get("_target_")
    if not isinstance(target, str) or out.get("_partial_") or target.startswith("hydra.utils."):
        return out
    try:
        params = defaults_of(locate(target, "_target_"))
    except LookupError:
        return out
    return {k: v for k, v in out.items() if not (k in params and not isinstance(v, (dict, list)) and v == params[k])}


def defaults_of(target: Any) -> dict[str, Any]:
    """The parameters of ``target`` that have a default, with it; a ``**kwargs`` of a classmethod
    (``Policy.from_pretrained``) forwards to its class's constructor, whose defaults count too."""
    params = inspect.signature(target).parameters.values()
    out = {p.name: p.default for p in params if p.default is not p.empty}
    owner = getattr(target, "__self__", None)
    if any(p.kind is p.VAR_KEYWORD for p in params) and inspect.isclass(owner):
        out = {n: p.default for n, p in init_parameters(owner).items() if p.default is not p.empty} | out
    return out
