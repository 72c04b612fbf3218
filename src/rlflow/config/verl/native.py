"""The short recipe format (``recipes/yaml/``): a shorthand for verl keys, kept for the recipes users have.

rlflow's recipe format is the component tree (``recipes/tree/``, :mod:`rlflow.config.components`): the classes and
their arguments. This format names sections like the objects, but each key stands for one verl key::

    policy: {path: models/qwen-0.5b, gradient_checkpointing: true}  # lora: {r: 16, alpha: 32, target_modules: all-linear}
    rollout: {n: 8, temperature: 1.0, max_new_tokens: 256}
    estimator: grpo                    # or {name: gae, gamma: 1.0, lam: 0.95}
    loss: {clip_ratio: 0.2, kl_coef: 0.001}
    reward: my_reward.py:compute_score # optional; default: verl's dispatch by data_source
    rewards: [{path: r.py, name: correct, weight: 1.0}, "r.py:short"]  # optional: several, summed (TRL style)
    reward_model: {path: models/rm, weight: 0.5}                  # optional: a reward model
    data: {train: train.parquet, val: test.parquet, max_prompt_length: 256}
    trainer: {batch_size: 32, mini_batch_size: 8, lr: 1.0e-6, max_steps: 100, run_dir: runs/gsm8k}
    dynamic_sampling: {metric: acc, max_gen_batches: 10}           # DAPO (optional)
    overlong_penalty: {buffer_len: 64, penalty_factor: 1.0}        # DAPO (optional)
    truncated_is: {level: token, threshold: 2.0}                   # rollout correction (optional)
    verl: {algorithm.use_kl_in_reward: true}                       # any verl key the format lacks

Every native key maps to exactly one verl key (``NATIVE``; a few also switch on what they need,
``IMPLIES``), then the verl path runs: one validation, one plan, one set of builders. The ``verl``
section and the overrides take verl keys as they are (overrides may also use native keys).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rlflow.config.verl.loading import (DEFAULTS_FILE, ConfigError, VerlConfig, _node, close_matches, flatten, load_config,
                                   parse_override, unknown_key_error)
from rlflow.config.verl.configs import default_container
from rlflow.models.hub import looks_like_hub_id
from rlflow.registry import is_file_location, split_spec

A, R = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
FG, OB = "algorithm.filter_groups", "reward_model.reward_kwargs.overlong_buffer_cfg"

NATIVE = {
    "policy.path": "actor_rollout_ref.model.path",
    "policy.gradient_checkpointing": "actor_rollout_ref.model.enable_gradient_checkpointing",
    "policy.micro_batch_size": f"{R}.log_prob_micro_batch_size_per_gpu",
    "policy.chat_template": "actor_rollout_ref.model.custom_chat_template",
    # LoRA adapters on the policy (peft.LoraConfig's names; rlflow.config.verl.lora)
    "policy.lora.r": "actor_rollout_ref.model.lora_rank", "policy.lora.alpha": "actor_rollout_ref.model.lora_alpha",
    **{f"policy.lora.{k}": f"actor_rollout_ref.model.{k}" for k in ("target_modules", "exclude_modules", "use_rslora",
                                                                     "use_dora")},
    "policy.lora.adapter": "actor_rollout_ref.model.lora_adapter_path",
    "rollout.engine": f"{R}.name", "rollout.n": f"{R}.n", "rollout.temperature": f"{R}.temperature",
    "rollout.top_p": f"{R}.top_p", "rollout.top_k": f"{R}.top_k", "rollout.do_sample": f"{R}.do_sample",
    "rollout.max_new_tokens": "data.max_response_length",
    # the engine (rollout.engine: hf, vllm, sglang); docs/rollout-engines.md
    **{f"rollout.{k}": f"{R}.{k}" for k in ("dtype", "enforce_eager", "max_model_len", "gpu_memory_utilization",
                                             "free_cache_engine", "max_num_seqs")},
    "rollout.server_url": f"{R}.server.url", "rollout.server_launch": f"{R}.server.launch",
    "reward.path": "custom_reward_function.path", "reward.name": "custom_reward_function.name",
    "reward.weight": "custom_reward_function.weight", "reward.timeout_s": "reward_model.timeout_s",
    "reward.num_workers": "reward_model.num_workers", "rewards": "custom_reward_function.functions",
    "reward_model.path": "reward_model.model.path", "reward_model.weight": "reward_model.weight",
    "reward_model.micro_batch_size": "reward_model.micro_batch_size_per_gpu",
    "reward_model.max_length": "reward_model.max_length",
    "estimator.name": "algorithm.adv_estimator", "estimator.gamma": "algorithm.gamma",
    "estimator.lam": "algorithm.lam", "estimator.norm_by_std": "algorithm.norm_adv_by_std_in_grpo",
    "loss.name": f"{A}.policy_loss.loss_mode", "loss.clip_ratio": f"{A}.clip_ratio",
    "loss.clip_ratio_low": f"{A}.clip_ratio_low", "loss.clip_ratio_high": f"{A}.clip_ratio_high",
    "loss.clip_ratio_c": f"{A}.clip_ratio_c", "loss.kl_coef": f"{A}.kl_loss_coef", "loss.kl_type": f"{A}.kl_loss_type",
    "loss.entropy_coef": f"{A}.entropy_coeff", "loss.agg": f"{A}.loss_agg_mode",
    "critic.path": "critic.model.path", "critic.lr": "critic.optim.lr",
    "value_loss.clip_range": "critic.cliprange_value",
    "data.train": "data.train_files", "data.val": "data.val_files", "data.prompt_key": "data.prompt_key",
    "data.max_prompt_length": "data.max_prompt_length", "data.truncation": "data.truncation",
    "data.shuffle": "data.shuffle", "data.seed": "data.seed",
    "data.filter_overlong_prompts": "data.filter_overlong_prompts",
    "trainer.batch_size": "data.train_batch_size", "trainer.mini_batch_size": f"{A}.ppo_mini_batch_size",
    "trainer.micro_batch_size": f"{A}.ppo_micro_batch_size_per_gpu", "trainer.ppo_epochs": f"{A}.ppo_epochs",
    "trainer.lr": f"{A}.optim.lr", "trainer.weight_decay": f"{A}.optim.weight_decay",
    "trainer.warmup_steps": f"{A}.optim.lr_warmup_steps", "trainer.lr_schedule": f"{A}.optim.lr_scheduler_type",
    "trainer.max_grad_norm": f"{A}.grad_clip", "trainer.max_steps": "trainer.total_training_steps",
    "trainer.epochs": "trainer.total_epochs", "trainer.val_every": "trainer.test_freq",
    "trainer.val_n": f"{R}.val_kwargs.n", "trainer.val_before_train": "trainer.val_before_train",
    "trainer.save_every": "trainer.save_freq", "trainer.run_dir": "trainer.default_local_dir",
    "trainer.resume": "trainer.resume_mode", "trainer.loggers": "trainer.logger", "trainer.device": "trainer.device",
    "trainer.devices": "trainer.n_gpus_per_node", "trainer.precision": "trainer.precision",
    "trainer.strategy": f"{A}.strategy",
    # a loss's own arguments (GSPO/SAPO/Clip-Cov/KL-Cov), by the Python names
    **{f"loss.{k}": f"{A}.{k}" for k in ("tau_pos", "tau_neg")},
    **{f"loss.{k}": f"{A}.policy_loss.{k}" for k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio",
                                                      "ppo_kl_coef")},
    # modules around the rollout, the reward and the estimator, by their class names
    "dynamic_sampling.enable": f"{FG}.enable", "dynamic_sampling.metric": f"{FG}.metric",
    "dynamic_sampling.max_gen_batches": f"{FG}.max_num_gen_batches",
    "overlong_penalty.buffer_len": f"{OB}.len", "overlong_penalty.penalty_factor": f"{OB}.penalty_factor",
    "truncated_is.level": "algorithm.rollout_correction.rollout_is",
    "truncated_is.threshold": "algorithm.rollout_correction.rollout_is_threshold",
    "async_rollout.max_staleness": "async_training.staleness_threshold",  # AsyncRollout (docs/async.md)
}

# Setting a native key also sets these verl keys (unless the recipe sets them itself): native key ->
# {verl key: value as a function of the native value}.
IMPLIES = {
    "loss.kl_coef": {f"{A}.use_kl_loss": bool},
    "reward_model.path": {"reward_model.enable": bool},
    "dynamic_sampling.metric": {f"{FG}.enable": lambda v: v is not None},
    "overlong_penalty.buffer_len": {f"{OB}.enable": bool, "reward_model.reward_manager": lambda v: "dapo"},
}

# Input paths of a recipe, taken relative to the recipe's folder: verl key -> kind ("file": data,
# "model": a model folder or hub id, "python": a .py file or module, "class": file.py:ClassName or a name).
RECIPE_PATHS = {
    "actor_rollout_ref.model.path": "model", "critic.model.path": "model",
    "data.train_files": "file", "data.val_files": "file", "custom_reward_function.path": "python",
    "algorithm.adv_estimator": "class", f"{A}.policy_loss.loss_mode": "class",
}

# What a native recipe starts from (verl's defaults suit clusters; these suit one machine).
NATIVE_DEFAULTS = {
    "algorithm": {"adv_estimator": "grpo"},
    "trainer": {"n_gpus_per_node": 1, "logger": ["console", "jsonl"], "total_epochs": 1, "test_freq": -1,
                "default_local_dir": "runs/rlflow"},
    "actor_rollout_ref": {"model": {"enable_gradient_checkpointing": False}},
    "critic": {"model": {"enable_gradient_checkpointing": False}},
}


SHORTHAND_SECTIONS = ("estimator", "loss", "reward")  # a section given by one string: see _shorthand


def _shorthand(tree: dict) -> dict:
    """``estimator: grpo`` -> ``{name: grpo}``; ``reward: file.py:fn`` -> ``{path: file.py, name: fn}``."""
    tree = dict(tree)
    for section in ("estimator", "loss"):
        if isinstance(tree.get(section), str):
            tree[section] = {"name": tree[section]}
    if isinstance(tree.get("reward"), str):
        path, _, name = tree["reward"].partition(":")
        tree["reward"] = {"path": path, **({"name": name} if name else {})}
    return tree


def nested(flat: dict) -> dict:
    """Dotted keys -> a nested tree."""
    out = OmegaConf.create({})
    for key, value in flat.items():
        OmegaConf.update(out, key, value, force_add=True)
    return OmegaConf.to_container(out)


def to_verl(flat: dict, source: str, problems: list[ConfigError] | None = None) -> dict:
    """Native dotted keys -> a nested tree of verl keys, with what they imply (``IMPLIES``).

    An unknown native key is appended to ``problems`` (raised when it is ``None``) and left out.
    """
    for key in [k for k in flat if k not in NATIVE]:
        error = unknown_key_error(key, list(NATIVE), f" (in {source}; native keys are listed in docs/verl-compat.md)")
        if problems is None:
            raise error
        problems.append(error)
        del flat[key]
    implied = {k: make(flat[n]) for n, keys in IMPLIES.items() if n in flat for k, make in keys.items()}
    return nested(implied | {NATIVE[key]: value for key, value in flat.items()})


def anchor_paths(tree: dict, folder: Path) -> dict:
    """Relative input paths of a recipe (``RECIPE_PATHS``) -> paths relative to the recipe's ``folder``.

    A model path that is a hub id (``Qwen/Qwen2.5-0.5B``) stays one unless the folder holds it; run
    outputs (``trainer.run_dir``) stay relative to the current folder.
    """
    def anchored(value: Any, kind: str) -> Any:
        if isinstance(value, list):
            return [anchored(v, kind) for v in value]
        if not isinstance(value, str) or not value:
            return value
        if kind == "class":  # my_est.py:MedianGRPO; a registered name or a module path stays as it is
            spec = split_spec(value)
            if spec is None or not is_file_location(spec[0]):
                return value
            return f"{anchored(spec[0], 'file')}:{spec[1]}"
        path = Path(value).expanduser()
        if path.is_absolute() or (kind == "python" and not is_file_location(value)):
            return value
        if kind == "model" and looks_like_hub_id(value) and not (folder / path).exists():
            return value
        return str(folder / path)

    flat = flatten(tree)
    return nested({k: anchored(v, RECIPE_PATHS[k]) if k in RECIPE_PATHS else v for k, v in flat.items()})


def split_overrides(overrides: list[str], problems: list[ConfigError] | None) -> tuple[dict, list[str]]:
    """Command-line overrides -> (native keys and values, verl overrides as text).

    A key that is neither native nor verl gets an error suggesting the native keys near it first.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser, defaults = OverridesParser.create(), default_container(DEFAULTS_FILE)
    native_flat, verl_overrides = {}, []
    for text in overrides:
        try:
            o = parse_override(parser, text)
            key = o.key_or_group
            if key in NATIVE:
                native_flat[key] = o.value()
                continue
            if key in SHORTHAND_SECTIONS and isinstance(o.value(), str):  # estimator=my_est.py:MedianGRPO, as in a recipe
                native_flat.update(flatten(_shorthand({key: o.value()})))
                continue
            exists, open_ = _node(defaults, key)
            if not (exists or open_):
                near = close_matches(key, list(NATIVE))
                verl_near = [] if near else close_matches(key, list(flatten(defaults)))
                hint = (f" Did you mean: {', '.join(near + verl_near)}?" if near or verl_near else "")
                raise ConfigError(f"unknown config key '{key}' (on the command line: neither a native recipe key nor "
                                  f"a verl key).{hint} Native keys are listed in docs/verl-compat.md")
            verl_overrides.append(text)
        except ConfigError as e:
            if problems is None:
                raise
            problems.append(e)
    return native_flat, verl_overrides


def load_native(path: str | Path, overrides: list[str] = (), problems: list[ConfigError] | None = None) -> VerlConfig:
    """A native recipe plus overrides (native keys, or verl keys for anything the recipe format lacks).

    Input paths in the recipe (model, data, reward and class files) are relative to the recipe's folder,
    so a recipe runs from any folder; paths on the command line are relative to the current folder.
    With ``problems``, key and type problems are collected there (see :func:`load_config`).
    """
    file = Path(path).expanduser()
    try:
        tree = OmegaConf.to_container(OmegaConf.load(file)) or {}
    except Exception as e:  # noqa: BLE001 - unreadable file: say which
        raise ConfigError(f"cannot read recipe {path}: {e}") from e
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping of sections, got {type(tree).__name__}")
    verl_section = tree.pop("verl", None) or {}
    if not isinstance(verl_section, dict):
        raise ConfigError(f"{path}: the verl section must map verl keys to values")
    folder = file.resolve().parent
    trees = [(str(path), anchor_paths(to_verl(flatten(_shorthand(tree)) if tree else {}, str(path), problems), folder))]
    if verl_section:
        trees.append((f"{path} (verl section)", anchor_paths(nested(flatten(verl_section)), folder)))
    native_flat, verl_overrides = split_overrides(list(overrides), problems)
    if native_flat:
        trees.append(("command-line native overrides", to_verl(native_flat, "the command line", problems)))
    return load_config(verl_overrides, base_overlay=NATIVE_DEFAULTS, trees=trees, problems=problems)
