"""verl's reward-manager classes loaded from a file: ``reward.reward_manager.source=importlib`` with
``reward.reward_manager.module.path`` (the file) and ``reward.reward_manager.name`` (the class); the older
spelling ``reward_model.reward_loop_source=importlib`` with ``reward_loop_module_path`` / ``reward_loop_class_name``.

verl builds such a class as ``cls(config=, tokenizer=, compute_score=, **reward.reward_kwargs)`` and awaits
``run_single(data: DataProto)``. rlflow has no ``DataProto``: the class plays rlflow's reward role instead, a
subclass of :class:`rlflow.Reward` implementing ``score(batch) -> Tensor[B]`` (it reads the batch's text columns,
``rlflow.data.keys``). It is built with the keyword arguments its ``__init__`` takes among ``compute_score`` (the
``custom_reward_function``, or the built-in scorer by ``data_source``) and the keys of ``reward.reward_kwargs``. A class written against verl's interface (a subclass of a ``verl`` class, a
``run_single``, a ``DataProto`` parameter) is refused, naming the file, the class and what to change; that is
found by reading the file (:mod:`ast`), so a file that imports ``verl`` is diagnosed without verl installed.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass, field
from typing import Any

from rlflow.config.verl.loading import ConfigError, VerlConfig
from rlflow.config.verl.user_classes import load_user_class

SOURCE, PATH = "reward.reward_manager.source", "reward.reward_manager.module.path"
NAME = "reward.reward_manager.name"
LEGACY = ("reward_model.reward_loop_source", "reward_model.reward_loop_module_path", "reward_model.reward_loop_class_name")
HOW = ("subclass rlflow.Reward and implement score(self, batch) -> a tensor of one float per sample, reading the "
       "batch's columns (rlflow.data.keys: RESPONSE_TEXT, GROUND_TRUTH, DATA_SOURCE, EXTRA_INFO; a column's values: "
       "rlflow.rewards.base.column(batch, key)); __init__ may take compute_score and the reward_kwargs keys "
       "(docs/rewards.md, 'Reward-manager classes')")


@dataclass
class ManagerClass:
    """The user's reward class and the keyword arguments its ``__init__`` takes (``compute_score`` is added by
    the tree's reward node, from the plan's one function)."""

    cls: type
    kwargs: dict = field(default_factory=dict)
    compute_score: bool = False


def _value(cfg: VerlConfig, key: str) -> Any:
    return cfg[key] if key in cfg.flat else None


def class_from_file(flat: dict) -> bool:
    """Whether the flat config selects a reward-manager class from a file (then ``reward.reward_manager.name`` is
    the class's name, not one of rlflow's managers)."""
    return any(flat.get(k) not in (None, "register") for k in (SOURCE, LEGACY[0]))


def selected(cfg: VerlConfig) -> tuple[str, str, str] | None:
    """``(key naming the file, file or module, class name)`` when a reward-manager class comes from a file;
    None for verl's registered names (``source=register``, rlflow's naive/batch/prime/dapo/gdpo)."""
    keys = LEGACY
    if _value(cfg, LEGACY[0]) in (None, "register"):
        keys = (SOURCE, PATH, NAME)
        _value(cfg, "reward_model.reward_manager")  # reward.reward_manager.name is carried on this key
    source = _value(cfg, keys[0])
    if source in (None, "register"):
        return None
    path, name = _value(cfg, keys[1]), _value(cfg, keys[2])
    if source != "importlib":
        raise ConfigError(f"{keys[0]}={source!r}: choose from register, importlib")
    if not path:
        raise ConfigError(f"{keys[0]}=importlib needs {keys[1]} (the Python file, or module, defining the class)")
    if not name or not str(name).isidentifier():
        raise ConfigError(f"{keys[2]}={name!r}: the class name in {path}")
    return keys[1], str(path), str(name)


def _verl_methods(method) -> list[str]:
    arguments = method.args.args + method.args.kwonlyargs
    return ((["it implements verl's run_single"] if method.name == "run_single" else []) +
            ([f"its {method.name} takes a DataProto"] if any(
                a.annotation is not None and "DataProto" in ast.unparse(a.annotation) for a in arguments) else []))


def manager_class(cfg: VerlConfig, reward_kwargs: dict) -> ManagerClass | None:
    """The user's reward-manager class, checked and imported; None when none is selected."""
    chosen = selected(cfg)
    if chosen is None:
        return None
    key, location, name = chosen
    cls = load_user_class("reward-manager class", "rlflow.rewards.base:Reward", location, name, f"{key}={location!r}",
                          "reward-manager interface", HOW, _verl_methods)
    parameters = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    unknown = [k for k in reward_kwargs if k not in parameters and not takes_any]
    if unknown:
        raise ConfigError(f"reward.reward_kwargs: {name}.__init__ takes no {', '.join(unknown)} (it takes "
                          f"{', '.join(p for p in list(parameters)[1:]) or 'nothing'}); verl passes reward_kwargs "
                          "to the reward-manager class")
    return ManagerClass(cls, dict(reward_kwargs), compute_score="compute_score" in parameters or takes_any)
