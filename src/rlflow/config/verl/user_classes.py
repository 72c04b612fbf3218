"""The users' classes a verl key loads from a file (a reward-manager class, an agent loop, a data generator, a
group sampler), checked before they run.

verl's plug-in classes are written against verl's own types (``DataProto``, its server manager); rlflow runs
classes of its own roles instead. :func:`load_user_class` finds a class written against verl by reading its file
(:mod:`ast`: verl need not be installed; ``verl_reasons`` adds the interface's own signs, e.g. a ``run_single``),
refuses it naming the file, the class and what to change (``how``), then imports it and checks its base.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Callable

from rlflow.config.verl.loading import ConfigError
from rlflow.registry import Registry, is_file_location, object_problem, resolve_file

MethodReasons = Callable[[ast.FunctionDef | ast.AsyncFunctionDef], list[str]]


def source_file(location: str) -> Path | None:
    """The Python file of ``file.py`` or an importable module; None when there is none to read."""
    if is_file_location(location):
        return resolve_file(location, None).resolve()
    try:
        spec = importlib.util.find_spec(location)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec and spec.origin and spec.origin.endswith(".py") else None


def verl_problem(file: Path, name: str, where: str, interface: str, how: str,
                 method_reasons: MethodReasons) -> str | None:
    """Why class ``name`` in ``file`` is written against verl's ``interface``; None if it is not."""
    tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
    from_verl = {a.asname or a.name for s in tree.body if isinstance(s, ast.ImportFrom)
                 and (s.module or "").split(".")[0] == "verl" for a in s.names}
    from_verl |= {a.asname or "verl" for s in tree.body if isinstance(s, ast.Import) for a in s.names
                  if a.name.split(".")[0] == "verl"}
    cls = next((s for s in tree.body if isinstance(s, ast.ClassDef) and s.name == name), None)
    if cls is None:
        return None
    why = [f"it subclasses verl's {ast.unparse(b)}" for b in cls.bases if ast.unparse(b).split(".")[0] in from_verl]
    why += [r for m in cls.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) for r in method_reasons(m)]
    if not why:
        return None
    return (f"{where}: class {name} in {file} is written against verl's {interface} "
            f"({'; '.join(dict.fromkeys(why))}), which rlflow does not run (it has no DataProto, no verl server). Change it to {how}")


def load_user_class(kind: str, base: str, location: str, name: str, where: str, interface: str, how: str,
                    method_reasons: MethodReasons) -> type:
    """Class ``name`` of ``location`` (a file or module), a subclass of ``base`` (``module:Class``); every problem
    a :class:`ConfigError` naming ``where``."""
    problem = object_problem(location, name, where)
    file = source_file(location) if problem is None else None
    if file is not None:
        problem = verl_problem(file, name, where, interface, how, method_reasons)
    if problem:
        raise ConfigError(problem)
    try:  # the check of the base class imports torch only now
        return Registry(kind, where, base=base, builtins={}, builtin_module=base.split(":")[0]).resolve(
            f"{location}:{name}", where)
    except ConfigError as e:
        if "is not a subclass" not in str(e):
            raise
        raise ConfigError(f"{str(e).split('; ')[0]}. Change it to {how}") from None
