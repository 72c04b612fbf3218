"""verl's reward keys -> the reward the Trainer gets (:class:`RewardPlan`, then the tree's reward node, :func:`rlflow.config.verl.tree.reward_node`).

How a reward model and rule scores combine follows verl 0.9.1:

- ``reward_model.enable=True`` without ``custom_reward_function.path``: the reward model's score is the
  reward; the rule scorers are not called (verl's reward loop scores with the model alone; its legacy
  managers return ``rm_scores`` when present).
- with ``custom_reward_function.path`` and ``use_reward_loop=True`` (verl's default): the custom function
  alone gives the score; verl lets it query the reward model, rlflow passes each sample's model score as
  ``rm_score=`` (the function must take that parameter: otherwise the model would be loaded for nothing,
  which is an error). ``use_reward_loop=False`` (verl's legacy workers): the model's score, the custom
  function is not called (a note says so).
- rlflow's own key ``reward_model.weight`` (default null: verl's rules above): a number sums
  ``weight * model score + sum_i weight_i * function_i`` instead, each part logged under its own name.

Several functions (TRL's ``reward_funcs`` with ``reward_weights``): ``custom_reward_function.functions``, a
list of ``{path, name, weight, reward_kwargs}`` (``path`` defaults to ``custom_reward_function.path``) or
``"file.py:name"`` strings; their weighted sum is the reward (``CombinedReward``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from rlflow.config.verl.loading import ConfigError, NotSupportedError, VerlConfig
from rlflow.config.verl.reward_fn import reward_function

RM = "reward_model"
CRF = "custom_reward_function"


@dataclass(frozen=True)
class RewardPlan:
    """What the tree's reward node makes. ``functions``: ``(name, function, weight)``; ``model``: the
    ``ModelReward.from_pretrained`` arguments (with ``path``) or None; ``mode``: ``"functions"`` (their
    weighted sum), ``"model"`` (the model's score alone), ``"rm_argument"`` (the one function, given
    ``rm_score``), ``"sum"`` (model and functions, weighted). ``manager``: the user's reward class, which
    then scores in place of the functions (the one function is its ``compute_score``). Made once, by
    :func:`reward_plan`, and never changed."""

    functions: list[tuple[str, Callable, float]]
    mode: str = "functions"
    model: dict | None = None
    model_weight: float = 1.0
    timeout_s: float | None = 30.0
    processes: int = 0
    custom: bool = False
    manager: Any = None  # a reward-manager class from a file (rlflow.config.verl.reward_class.ManagerClass)


def reward_plan(cfg: VerlConfig, manager: str, reward_kwargs: dict, notes: list[str]) -> RewardPlan:
    """Read the reward keys; every problem names its key."""
    timeout, workers = cfg[f"{RM}.timeout_s"], cfg[f"{RM}.num_workers"]  # their ranges: rlflow.config.verl.checks
    crf = cfg[CRF]
    custom = bool(crf["path"] or crf["functions"] or ":" in str(crf["name"]))
    sandbox = sandbox_fusion(cfg, workers or 0, custom, notes)
    functions = _functions(crf, reward_kwargs, manager, cfg["trainer.experiment_name"], sandbox)
    timing = {"timeout_s": timeout, "processes": workers or 0, "custom": custom}
    if not cfg[f"{RM}.enable"]:
        if cfg[f"{RM}.weight"] is not None:
            raise ConfigError(f"{RM}.weight={cfg[f'{RM}.weight']} is set but {RM}.enable=False")
        return RewardPlan(functions=functions, **timing)
    model, weight = model_arguments(cfg, notes), cfg[f"{RM}.weight"]
    mode = model_mode(cfg, functions, custom, weight, notes)
    return RewardPlan(functions=[] if mode == "model" else functions, mode=mode, model=model,
                      model_weight=1.0 if weight is None else weight, **timing)


def model_mode(cfg: VerlConfig, functions: list, custom: bool, weight: float | None, notes: list[str]) -> str:
    """How the reward model's score and the functions make the reward (the module's header): ``sum`` with
    ``reward_model.weight``; else verl's rules, ``model`` (its score alone) or ``rm_argument`` (the custom function,
    given the score)."""
    if weight is not None:
        if weight != weight or abs(weight) == float("inf"):
            raise ConfigError(f"{RM}.weight={weight}: must be a finite number")
        return "sum"
    if not custom:
        notes.append(f"{RM}.enable=True: the reward model's score is the reward, as in verl (rule scorers are not "
                     f"called; set {RM}.weight to add them)")
        return "model"
    if not cfg[f"{RM}.use_reward_loop"]:
        notes.append(f"{RM}.use_reward_loop=False: as verl's legacy reward workers, the reward model's score is the "
                     f"reward and {CRF} is not called")
        return "model"
    takes = [name for name, fn, _ in functions if {"rm_score", "rm_scores"} & _parameters(fn)]
    if len(functions) != 1 or not takes:
        raise ConfigError(
            f"{RM}.enable=True with {CRF}: as in verl, the custom function alone gives the score, and it can use "
            f"the reward model's score through an rm_score parameter, which {functions[0][0]!r} does not take "
            "(the reward model would be loaded for nothing). Add rm_score to the function (one function), or "
            f"set {RM}.weight=1.0 to add the model's score to the functions'")
    return "rm_argument"


def sandbox_fusion(cfg: VerlConfig, processes: int, custom: bool, notes: list[str]) -> dict | None:
    """``reward_model.sandbox_fusion.*`` (verl 0.9: ``reward.sandbox_fusion.*``; verl's top-level ``sandbox_fusion.*``,
    whose set values its reward loop moves there) -> ``SandboxFusion`` arguments, or None without a url. The
    other two keys are read only with a url (without one, a note says they change nothing)."""

    def value(name: str) -> Any:
        top = cfg[f"sandbox_fusion.{name}"] if f"sandbox_fusion.{name}" in cfg.flat else None
        return top if top is not None else cfg[f"{RM}.sandbox_fusion.{name}"]  # verl's top-level key, set, wins

    url = value("url")
    if not url:
        return None
    if not isinstance(url, str):
        raise ConfigError(f"{RM}.sandbox_fusion.url={url!r}: must be the server's url (http://HOST:PORT/run_code)")
    if custom:
        notes.append(f"{RM}.sandbox_fusion.url={url!r}: as in verl, only the built-in scorers (code data sources) "
                     f"send code to the server; {CRF} is called as it is")
        return None
    settings = {"url": url, "max_concurrent": value("max_concurrent"), "memory_limit_mb": value("memory_limit_mb")}
    for key in ("max_concurrent", "memory_limit_mb"):
        if isinstance(settings[key], bool) or not isinstance(settings[key], int) or settings[key] < 1:
            raise ConfigError(f"{RM}.sandbox_fusion.{key}={settings[key]!r}: must be an integer >= 1")
    if processes > 1:  # each reward process holds its own bound: together they keep the user's
        total, settings["max_concurrent"] = settings["max_concurrent"], max(1, settings["max_concurrent"] // processes)
        notes.append(f"{RM}.sandbox_fusion.max_concurrent={total} with {RM}.num_workers={processes} reward "
                     f"processes: each sends at most {settings['max_concurrent']} requests at once")
    return settings


def model_arguments(cfg: VerlConfig, notes: list[str]) -> dict:
    """``reward_model.*`` -> ``ModelReward.from_pretrained`` arguments."""
    strategy = cfg[f"{RM}.strategy"]
    if strategy not in ("fsdp", "fsdp2"):
        raise NotSupportedError(f"{RM}.strategy", strategy, "Megatron reward models", "Use fsdp or fsdp2.")
    if cfg[f"{RM}.ulysses_sequence_parallel_size"] > 1:
        raise NotSupportedError(f"{RM}.ulysses_sequence_parallel_size", cfg[f"{RM}.ulysses_sequence_parallel_size"],
                                "sequence-parallel reward models")
    if cfg[f"{RM}.use_dynamic_bsz"] and cfg.is_provided(f"{RM}.use_dynamic_bsz"):
        notes.append(f"{RM}.use_dynamic_bsz: the reward model scores micro-batches of "
                     f"{RM}.micro_batch_size_per_gpu rows (no token budget)")
    micro = cfg[f"{RM}.micro_batch_size_per_gpu"]
    if micro is None and cfg[f"{RM}.micro_batch_size"] is not None:
        micro = max(1, cfg[f"{RM}.micro_batch_size"] // max(1, cfg["trainer.n_gpus_per_node"] * cfg["trainer.nnodes"]))
    if micro is not None and micro < 1:
        raise ConfigError(f"{RM}.micro_batch_size_per_gpu={micro}: must be >= 1")
    max_length = cfg[f"{RM}.max_length"]
    if max_length is not None and max_length < 2:
        raise ConfigError(f"{RM}.max_length={max_length}: must be >= 2 tokens, or null")
    external = cfg[f"{RM}.model.external_lib"]
    if external:
        import importlib

        importlib.import_module(external)
    path = cfg[f"{RM}.model.path"]
    if not path:
        raise ConfigError(f"{RM}.enable=True needs {RM}.model.path (a local sequence-classification model folder)")
    return {"path": path, "reencode": cfg[f"{RM}.model.input_tokenizer"] is not None, "micro_batch_size": micro,
            "max_length": max_length, "shard": True,
            **({"trust_remote_code": True} if cfg[f"{RM}.model.trust_remote_code"] else {})}


def _functions(crf: dict, reward_kwargs: dict, manager: str, experiment: str = "",
               sandbox: dict | None = None) -> list[tuple[str, Callable, float]]:
    """The rule/custom functions with their weights: ``functions`` if given, else ``path``/``name``."""
    weight = crf["weight"]
    items = crf["functions"]
    if not items:
        name = str(crf["name"]).rsplit(":", 1)[-1] if crf["path"] or ":" in str(crf["name"]) else "reward"
        return [(name, reward_function(crf["path"], crf["name"], reward_kwargs, manager, experiment, sandbox),
                 _weight(weight, f"{CRF}.weight"))]
    out = []
    for i, item in enumerate(items):
        key = f"{CRF}.functions[{i}]"
        if isinstance(item, str):
            path, sep, name = item.rpartition(":")
            item = {"path": path, "name": name} if sep else {"name": item}
        if not isinstance(item, dict) or not item.get("name"):
            raise ConfigError(f"{key}={item!r}: give {{path, name, weight, reward_kwargs}} or 'file.py:name'")
        unknown = set(item) - {"path", "name", "weight", "reward_kwargs"}
        if unknown:
            raise ConfigError(f"{key}: unknown field(s) {sorted(unknown)}; fields: path, name, weight, reward_kwargs")
        path = item.get("path") or crf["path"]
        if not path:
            raise ConfigError(f"{key}: no path (set it, or {CRF}.path for all functions)")
        kwargs = {**reward_kwargs, **(item.get("reward_kwargs") or {})}
        out.append((item["name"], reward_function(path, item["name"], kwargs, manager, experiment),
                    _weight(item.get("weight", 1.0), f"{key}.weight")))
    return out


def _weight(value: Any, key: str) -> float:
    try:
        weight = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={value!r}: must be a number") from None
    if weight != weight or abs(weight) == float("inf"):
        raise ConfigError(f"{key}={value!r}: must be a finite number")
    return weight


def _parameters(fn: Callable) -> set[str]:
    import inspect

    while hasattr(fn, "func"):  # functools.partial, verl_batch_adapter keeps the original in __wrapped__
        fn = fn.func
    fn = getattr(fn, "__wrapped__", fn)
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()
