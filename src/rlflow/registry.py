"""Names a config can select for the components users extend: advantage estimators and policy losses.

A config value (``algorithm.adv_estimator``, ``actor_rollout_ref.actor.policy_loss.loss_mode``, or the
native ``estimator:`` / ``loss:``) is one of

- a registered name: the built-in ones (``grpo``, ``gae``, ``vanilla``, ``gspo``, ...) or yours;
- ``file.py:ClassName``: a class in a Python file (relative to the current folder, or to the recipe
  that names it);
- ``package.module:ClassName``: a class in an importable module.

Register your own names with the decorators (verl's ``register_adv_est`` / policy-loss registry,
for classes)::

    from rlflow import GRPO, register_estimator

    @register_estimator("median_grpo")
    class MedianGRPO(GRPO):
        ...

This module imports nothing heavy: the config is checked against it before torch loads
(:func:`Registry.problem` reads a file's top-level names with :mod:`ast`, it does not run it).
"""

from __future__ import annotations

import ast
import difflib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable

from rlflow.config.errors import ConfigError, NotSupportedError

__all__ = ["Registry", "ESTIMATORS", "POLICY_LOSSES", "register_estimator", "register_policy_loss",
           "load_object", "object_problem", "split_spec", "module_defines"]


def split_spec(value: Any) -> tuple[str, str] | None:
    """``"my_est.py:MedianGRPO"`` -> ``("my_est.py", "MedianGRPO")``; ``"pkg.mod:Name"`` likewise; else ``None``."""
    if not isinstance(value, str) or value.count(":") != 1:
        return None
    location, name = value.split(":")
    if not location or not name.isidentifier():
        return None
    return location, name


def is_file_location(location: str) -> bool:
    """A path to a Python file (``x.py``, ``dir/x.py``, ``~/x.py``) rather than a dotted module name."""
    return location.endswith(".py") or "/" in location or "\\" in location or location.startswith("~")


def resolve_file(location: str, base_dir: str | Path | None) -> Path:
    """A file location, relative to ``base_dir`` (a recipe's folder) or the current folder."""
    path = Path(location).expanduser()
    return path if path.is_absolute() or base_dir is None else Path(base_dir) / path


def top_level_names(file: Path) -> tuple[set[str], bool]:
    """Names a Python file binds at top level (without running it); ``True`` if it may bind more
    (``from x import *`` or a module ``__getattr__``)."""
    tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
    names, open_ended = set(), False
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            open_ended |= node.name == "__getattr__"
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    open_ended = True
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            open_ended = True  # conditional definitions: let the import decide
    return names, open_ended


def module_defines(module: str, name: str) -> bool:
    """Whether importable ``module`` binds ``name`` at top level, read from its source (not imported).
    ``True`` when that cannot be told from the source (conditional or star imports, no source file)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if not spec.origin or not spec.origin.endswith(".py"):
        return True
    names, open_ended = top_level_names(Path(spec.origin))
    return name in names or open_ended


def defined_names(file: Path) -> str:
    """``classes: A, B; functions: f`` for an error message (public names only)."""
    tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
    classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef) and not n.name.startswith("_")]
    functions = [n.name for n in tree.body
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not n.name.startswith("_")]
    parts = ([f"classes: {', '.join(classes)}"] if classes else []) + (
        [f"functions: {', '.join(functions)}"] if functions else [])
    return "; ".join(parts) or "no classes or functions"


def object_problem(location: str, name: str, where: str, base_dir: str | Path | None = None) -> str | None:
    """Why ``location:name`` cannot be loaded, found without importing it; ``None`` when it looks fine."""
    if is_file_location(location):
        file = resolve_file(location, base_dir).resolve()
        if not file.is_file():
            return f"{where}: no such file {file}"
        try:
            names, open_ended = top_level_names(file)
        except SyntaxError as e:
            return f"{where}: {file} is not valid Python: {e.msg} (line {e.lineno})"
        if name not in names and not open_ended:
            close = difflib.get_close_matches(name, sorted(names), n=1)
            hint = f" Did you mean {close[0]}?" if close else ""
            return f"{where}: {file} defines no '{name}' (it defines {defined_names(file)}).{hint}"
        return None
    try:
        found = importlib.util.find_spec(location)
    except (ImportError, ValueError) as e:
        found, error = None, e
    else:
        error = None
    if found is None:
        return (f"{where}: no importable module '{location}'" + (f" ({error})" if error else "")
                + "; for a file, write its path ending in .py")
    return None


_loaded_files: dict[Path, Any] = {}
FILE_MODULES = "rlflow_user_"  # the prefix of the module name a file imported by load_object gets


def load_object(location: str, name: str, where: str, base_dir: str | Path | None = None) -> Any:
    """Import ``name`` from a Python file or a module; errors name ``where`` (the config key) and the file.

    A file is imported once per process, as a module of its own (``sys.modules`` holds it so that
    pickling and dataclasses inside it work).
    """
    problem = object_problem(location, name, where, base_dir)
    if problem:
        raise LookupError(problem)
    if is_file_location(location):
        file = resolve_file(location, base_dir).resolve()
        module = _loaded_files.get(file)
        if module is None:
            module_name = f"{FILE_MODULES}{file.stem}_{abs(hash(str(file))) % 10**8}"
            spec = importlib.util.spec_from_file_location(module_name, file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            try:
                spec.loader.exec_module(module)
            except Exception as e:
                del sys.modules[module_name]
                raise LookupError(f"{where}: importing {file} raised {e!r}") from e
            _loaded_files[file] = module
        source = str(file)
    else:
        try:
            module = importlib.import_module(location)
        except Exception as e:
            raise LookupError(f"{where}: importing module '{location}' raised {e!r}") from e
        source = f"module {location}"
    if not hasattr(module, name):
        raise LookupError(f"{where}: {source} has no '{name}'")
    return getattr(module, name)


class Registry:
    """Config names -> classes for one kind of component.

    Args:
        kind: what the classes are, for messages ("advantage estimator").
        key: the verl config key that selects one.
        base: ``"module:Class"`` every class must subclass (checked when resolved).
        builtins: name -> class name in ``builtin_module`` (looked up when resolved, so a class that
            another module adds later plugs in by one row).
        builtin_module: where the built-in classes live.
    """

    def __init__(self, kind: str, key: str, base: str, builtins: dict[str, str], builtin_module: str):
        self.kind, self.key, self.base = kind, key, base
        self.builtins, self.builtin_module = dict(builtins), builtin_module
        self.user: dict[str, Any] = {}

    def names(self) -> list[str]:
        return [*self.builtins, *self.user]

    def register(self, name: str, cls: Any = None) -> Any:
        """``register("x", Cls)``, or ``@register("x")`` on a class; a name may be registered once."""
        def add(obj: Any) -> Any:
            if name in self.builtins or (name in self.user and self.user[name] is not obj):
                raise ValueError(f"{self.kind} name {name!r} is already registered")
            self.user[name] = obj
            return obj

        return add if cls is None else add(cls)

    def unregister(self, name: str) -> None:
        self.user.pop(name, None)

    def _unknown(self, value: Any, key: str) -> str:
        close = difflib.get_close_matches(str(value), self.names(), n=3)
        hint = f" Did you mean: {', '.join(close)}?" if close else ""
        return (f"{key}={value!r}: not a registered {self.kind}.{hint} Known: {', '.join(self.names())}; "
                f"or give a class as file.py:ClassName or package.module:ClassName")

    def problem(self, value: Any, key: str | None = None, base_dir: str | Path | None = None) -> str | None:
        """Why ``value`` selects nothing, found without importing torch; ``None`` when it looks fine."""
        key = key or self.key
        if value in self.builtins or value in self.user:
            return None
        spec = split_spec(value)
        if spec is None:
            return self._unknown(value, key)
        return object_problem(*spec, where=f"{key}={value!r}", base_dir=base_dir)

    def resolve(self, value: Any, key: str | None = None, base_dir: str | Path | None = None) -> type:
        """The class for ``value``: registered names first, then ``file.py:Class`` / ``module:Class``."""
        key = key or self.key
        if value in self.user:
            cls = self.user[value]
        elif value in self.builtins:
            cls = getattr(importlib.import_module(self.builtin_module), self.builtins[value], None)
            if cls is None:
                raise NotSupportedError(key, value, f"{self.builtins[value]} ({value})",
                                        f"{self.builtin_module} has no class {self.builtins[value]} yet.")
        else:
            problem = self.problem(value, key, base_dir)
            if problem:
                raise ConfigError(problem)
            try:
                cls = load_object(*split_spec(value), where=f"{key}={value!r}", base_dir=base_dir)
            except LookupError as e:
                raise ConfigError(str(e)) from None
        module, base_name = self.base.split(":")
        base = getattr(importlib.import_module(module), base_name)
        if not (isinstance(cls, type) and issubclass(cls, base)):
            what = f"the class {cls.__name__}" if isinstance(cls, type) else f"{type(cls).__name__} {cls!r}"[:80]
            raise ConfigError(f"{key}={value!r}: {what} is not a subclass of {module}.{base_name}; a {self.kind} "
                              f"is a class (see docs/concepts.md)")
        return cls


# algorithm.adv_estimator -> class name in rlflow.algorithms
ESTIMATORS = Registry("advantage estimator", "algorithm.adv_estimator", "rlflow.algorithms:AdvantageEstimator", {
    "gae": "GAE", "grpo": "GRPO", "grpo_vectorized": "GRPO", "grpo_passk": "GRPOPassK", "rloo": "RLOO",
    "rloo_vectorized": "RLOO", "reinforce_plus_plus": "ReinforcePlusPlus",
    "reinforce_plus_plus_baseline": "ReinforcePlusPlusBaseline", "remax": "ReMax", "opo": "OPO", "gpg": "GPG",
    "optimal_token_baseline": "OptimalTokenBaseline", "tir_optimal_token_baseline": "TIROptimalTokenBaseline",
    "gdpo": "GDPO",
}, "rlflow.algorithms")

# actor_rollout_ref.actor.policy_loss.loss_mode -> class name in rlflow.algorithms
POLICY_LOSSES = Registry("policy loss", "actor_rollout_ref.actor.policy_loss.loss_mode", "rlflow.algorithms:PPOLoss", {
    "vanilla": "PPOLoss", "gspo": "GSPOLoss", "cispo": "CISPOLoss", "sapo": "SAPOLoss", "clip_cov": "ClipCovLoss",
    "kl_cov": "KLCovLoss", "geo_mean": "GMPOLoss", "gpg": "ReinforceLoss", "reinforce": "ReinforceLoss",
    "dppo_tv": "DPPOTVLoss", "dppo_kl": "DPPOKLLoss", "bypass_mode": "BypassLoss",
}, "rlflow.algorithms")


def register_estimator(name: str, cls: type | None = None) -> Callable | type:
    """Make ``algorithm.adv_estimator=<name>`` (native ``estimator: <name>``) select ``cls``; a decorator too."""
    return ESTIMATORS.register(name, cls)


def register_policy_loss(name: str, cls: type | None = None) -> Callable | type:
    """Make ``actor_rollout_ref.actor.policy_loss.loss_mode=<name>`` (native ``loss: <name>``) select ``cls``."""
    return POLICY_LOSSES.register(name, cls)
