"""A component tree written as the Python a user would write: imports, ``trainer = Trainer(...)``, ``data = ...``,
``trainer.fit(data)``. The dry run prints it; it runs as printed (``tests/config/test_component_tree.py`` runs it and
compares what it builds with what :func:`rlflow.config.components.build` builds).

Each ``_target_`` becomes an import of the module part of its path and a call of the rest
(``rlflow.Policy.from_pretrained`` -> ``from rlflow import Policy`` and ``Policy.from_pretrained(...)``);
``_args_`` are positional arguments, ``_partial_: true`` is ``functools.partial(...)``, a
``{_target_: hydra.utils.get_method, path: x}`` node is the object ``x`` itself, and a ``file.py:Name`` target is
loaded with :func:`rlflow.registry.load_object`, as the tree's build does.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from rlflow.config.components import DATA, KEYWORDS, NAMER_PATHS, TRAINER
from rlflow.registry import is_file_location, resolve_file, split_spec

INDENT = "    "


class _Names:
    """The imports a program needs, each name bound once (a clash gets an alias: ``Name_2``)."""

    def __init__(self, base_dir: str | Path | None):
        self.base_dir, self.bound = base_dir, {}
        self.modules: list[str] = []  # import x
        self.froms: dict[str, list[str]] = {}  # from module import a, b as b_2
        self.loads: list[str] = []  # x = load_object(...)

    @property
    def lines(self) -> list[str]:
        return ([f"import {m}" for m in sorted(self.modules)]
                + [f"from {m} import {', '.join(sorted(names))}" for m, names in sorted(self.froms.items())]
                + self.loads)

    def bind(self, name: str, source: tuple, record) -> str:
        """The name ``source`` is bound to; ``record(alias)`` records what binds it, once."""
        alias, n = name, 1
        while alias in self.bound and self.bound[alias] != source:
            n += 1
            alias = f"{name}_{n}"
        if alias not in self.bound:
            self.bound[alias] = source
            record(alias)
        return alias

    def of(self, spec: str, where: str) -> str:
        """The expression for the object ``spec`` names, its import recorded."""
        location = split_spec(spec)
        if location is not None:  # file.py:Name or package.module:Name
            module, name = location
            if is_file_location(module):
                module = str(resolve_file(module, self.base_dir).resolve())
            self.bind("load_object", ("rlflow.registry", "load_object"),
                      lambda _: self.froms.setdefault("rlflow.registry", []).append("load_object"))
            return self.bind(name, (module, name),
                             lambda a: self.loads.append(f"{a} = load_object({module!r}, {name!r}, {where!r})"))
        parts = spec.split(".")
        for i in range(len(parts) - 1, 0, -1):  # the longest importable prefix is the module
            module = ".".join(parts[:i])
            try:
                importlib.import_module(module)
            except ImportError:
                continue
            alias = self.bind(parts[i], (module, parts[i]), lambda a: self.froms.setdefault(module, []).append(
                parts[i] + (f" as {a}" if a != parts[i] else "")))
            return ".".join([alias, *parts[i + 1:]])
        return self.bind(parts[0], (parts[0],), lambda _: self.modules.append(parts[0]))  # a top-level module's own object


def python(tree: dict, base_dir: str | Path | None = None) -> str:
    """The program that builds and trains ``tree`` (a loaded, checked tree: :func:`rlflow.config.components.load`)."""
    names = _Names(base_dir)
    root = {"_target_": TRAINER, **{k: v for k, v in tree.items() if k != DATA}}
    trainer = _call(root, "", names, depth=0)
    data = _value(tree.get(DATA), DATA, names, depth=1)
    return "\n".join([*names.lines, "", f"trainer = {trainer}", f"data = {data}", "history = trainer.fit(data)", ""])


def _call(node: dict, path: str, names: _Names, depth: int) -> str:
    at = (lambda key: f"{path}.{key}" if path else key)
    target = node["_target_"]
    if target in NAMER_PATHS and set(node) == {"_target_", "path"}:
        return names.of(node["path"], at("path"))
    recursive = node.get("_recursive_", True)
    args = [_value(v, f"{at('_args_')}[{i}]", names, depth + 1, recursive) for i, v in enumerate(node.get("_args_", []))]
    args += [f"{k}={_value(v, at(k), names, depth + 1, recursive)}" for k, v in node.items() if k not in KEYWORDS]
    func = names.of(target, at("_target_")) if isinstance(target, str) else repr(target)  # one without a path
    if node.get("_partial_", False):
        func, args = "functools.partial", [func, *args]
        names.bind("functools", ("functools",), lambda _: names.modules.append("functools"))
    if depth == 0 and args:  # the root: one argument a line, as one writes a Trainer(...)
        inner = "".join(f"\n{INDENT}{a}," for a in args)
        return f"{func}({inner}\n)"
    return f"{func}({', '.join(args)})"


def _value(value: Any, path: str, names: _Names, depth: int, recursive: bool = True) -> str:
    if isinstance(value, dict):
        if "_target_" in value and recursive:
            return _call(value, path, names, depth)
        return "{" + ", ".join(f"{k!r}: {_value(v, f'{path}.{k}', names, depth, recursive)}"
                               for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_value(v, f"{path}[{i}]", names, depth, recursive) for i, v in enumerate(value)) + "]"
    return repr(value)
