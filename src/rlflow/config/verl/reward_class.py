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
from pathlib import Path
from typing import Any

from rlflow.config.verl.loading import ConfigError, VerlConfig
from rlflow.registry import Registry, is_file_location, object_problem, resolve_file

SOURCE, PATH = "reward.reward_manager.source", "reward.reward_manager.module.path"
NAME = "reward.reward_manager.name"
LEGACY = ("reward_model.reward_loop_source", "reward_model.reward_loop_module_path", "reward_model.reward_loop_class_name")
REWARD_CLASSES = Registry("reward-manager class", PATH, base="rlflow.rewards.base:Reward", builtins={},
                          builtin_module="rlflow.rewards")
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


def verl_interface_problem(file: Path, name: str, where: str) -> str | None:
    """Why class ``name`` in ``file`` is written against verl's reward-manager interface; None if it is not."""
    tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
    from_verl = set()
    for stmt in tree.body:
        if isinstance(stmt, ast.ImportFrom) and (stmt.module or "").split(".")[0] == "verl":
            from_verl |= {a.asname or a.name for a in stmt.names}
        elif isinstance(stmt, ast.Import):
            from_verl |= {a.asname or a.name.split(".")[0] for a in stmt.names if a.name.split(".")[0] == "verl"}
    cls = next((s for s in tree.body if isinstance(s, ast.ClassDef) and s.name == name), None)
    if cls is None:
        return None
    why = [f"it subclasses verl's {ast.unparse(b)}" for b in cls.bases if ast.unparse(b).split(".")[0] in from_verl]
    for method in (s for s in cls.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))):
        if method.name == "run_single":
            why.append("it implements verl's run_single")
        arguments = method.args.args + method.args.kwonlyargs
        if any(a.annotation is not None and "DataProto" in ast.unparse(a.annotation) for a in arguments):
            why.append(f"its {method.name} takes a DataProto")
    if not why:
        return None
    return (f"{where}: class {name} in {file} is written against verl's reward-manager interface "
            f"({'; '.join(dict.fromkeys(why))}), which rlflow does not run (it has no DataProto). Change it to {HOW}")


def manager_class(cfg: VerlConfig, reward_kwargs: dict) -> ManagerClass | None:
    """The user's reward-manager class, checked and imported; None when none is selected."""
    chosen = selected(cfg)
    if chosen is None:
        return None
    key, location, name = chosen
    where = f"{key}={location!r}"
    problem = object_problem(location, name, where)
    if problem:
        raise ConfigError(problem)
    if is_file_location(location):
        problem = verl_interface_problem(resolve_file(location, None).resolve(), name, where)
        if problem:
            raise ConfigError(problem)
    try:  # the check of the base class imports torch only now
        cls = REWARD_CLASSES.resolve(f"{location}:{name}", key)
    except ConfigError as e:
        if "is not a subclass" not in str(e):
            raise
        raise ConfigError(f"{str(e).split('; ')[0]}. Change it to {HOW}") from None
    parameters = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    unknown = [k for k in reward_kwargs if k not in parameters and not takes_any]
    if unknown:
        raise ConfigError(f"reward.reward_kwargs: {name}.__init__ takes no {', '.join(unknown)} (it takes "
                          f"{', '.join(p for p in list(parameters)[1:]) or 'nothing'}); verl passes reward_kwargs "
                          "to the reward-manager class")
    return ManagerClass(cls, dict(reward_kwargs), compute_score="compute_score" in parameters or takes_any)
