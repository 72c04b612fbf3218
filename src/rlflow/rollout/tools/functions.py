"""``@function_tool``: plain Python functions as tools, loaded from a file (verl's ``function_tool_path``).

A file of tools::

    from rlflow.rollout.tools import function_tool      # or verl's: from verl.tools.function_tool import ...

    @function_tool
    def add(a: int, b: int) -> int:
        \"\"\"Add two integers.

        Args:
            a: the first number.
            b: the second number.
        \"\"\"
        return a + b

Each decorated function becomes a :class:`~rlflow.rollout.tools.FunctionTool`; its OpenAI schema is inferred
from the type hints and the Google-style docstring by ``transformers.utils.get_json_schema`` (as verl infers
it), or given with ``@function_tool("name", schema={...})``. It may return a string, a dict (shown as JSON),
anything else (shown as ``str``), or ``(response, reward[, metrics])``. :func:`load_function_tools` runs a
file and returns the tools it defined; while it runs, ``verl.tools.function_tool`` names this module, so a
verl user's file loads unchanged without verl installed.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import sys
import types
from pathlib import Path
from typing import Any, Callable

from rlflow.rollout.tools.base import FunctionTool

REGISTRY: dict[str, "DecoratedTool"] = {}  # tools decorated outside a file load_function_tools runs
_LOADED: dict[Path, list["DecoratedTool"]] = {}
_collecting: list[dict[str, "DecoratedTool"]] = []  # the tools of the file being loaded (one name space per file)


def _shown(value: Any) -> Any:
    """verl's return shapes as rlflow's tool results: a dict as JSON text, other non-strings as ``str``."""
    if isinstance(value, tuple):
        if not 1 <= len(value) <= 3:
            raise TypeError(f"a @function_tool returned a tuple of {len(value)}; return (response,), "
                            "(response, reward) or (response, reward, metrics)")
        return (_shown(value[0]), *value[1:])
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    return value if isinstance(value, str) or hasattr(value, "text") else str(value)


class DecoratedTool(FunctionTool):
    """A ``@function_tool`` function: its return value shown as verl shows it (:func:`_shown`)."""

    async def execute(self, args: dict, **sample_kwargs):
        return _shown(await super().execute(args, **sample_kwargs))


def function_tool(name: str | Callable | None = None, *, schema: dict | None = None):
    """Register a function as a tool (bare ``@function_tool`` or ``@function_tool("name", schema=...)``); the
    function itself is returned unchanged."""

    def register(fn: Callable, tool_name: str | None) -> Callable:
        tool_name = tool_name or fn.__name__
        if schema is not None:
            function = schema.get("function", schema)
        else:
            variadic = [p.name for p in inspect.signature(fn).parameters.values()
                        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
            if variadic:
                raise ValueError(f"@function_tool {tool_name!r}: *args / **kwargs ({', '.join(variadic)}) have no "
                                 "JSON schema; name each parameter")
            from transformers.utils import get_json_schema

            function = get_json_schema(fn)["function"]
        registry = _collecting[-1] if _collecting else REGISTRY
        existing = registry.get(tool_name)
        same = existing is not None and (existing.fn.__module__, existing.fn.__qualname__) == (
            fn.__module__, fn.__qualname__)  # the same definition run again (a notebook cell): replaced
        if existing is not None and not same:
            raise ValueError(f"@function_tool {tool_name!r} is already registered to {existing.fn.__qualname__}")
        registry[tool_name] = DecoratedTool(fn, parameters=function.get("parameters") or {"type": "object",
                                                                                         "properties": {}},
                                            description=function.get("description"), name=tool_name)
        return fn

    if callable(name) and schema is None:
        return register(name, None)
    return lambda fn: register(fn, name)


def load_function_tools(path: str | Path) -> list[DecoratedTool]:
    """Run the Python file ``path`` once and return the ``@function_tool`` tools it registered (each file has
    its own names: two files may both define ``add``)."""
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"function_tool_path: no such file {file}")
    if file in _LOADED:
        return _LOADED[file]
    aliases = _verl_aliases()
    saved = {k: sys.modules.get(k) for k in aliases}
    sys.modules.update(aliases)
    _collecting.append({})
    name = f"rlflow_function_tools_{abs(hash(str(file))) % 10**8}"
    try:
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    finally:
        collected = _collecting.pop()
        for key, old in saved.items():  # verl's names point back where they did
            if old is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = old
    tools = list(collected.values())
    _LOADED[file] = tools
    return tools


def _verl_aliases() -> dict[str, types.ModuleType]:
    """``verl.tools.function_tool`` -> this module (with ``verl`` / ``verl.tools`` stand-ins when verl is not
    installed), for the time a tool file runs."""
    aliases: dict[str, types.ModuleType] = {"verl.tools.function_tool": sys.modules[__name__]}
    if importlib.util.find_spec("verl") is None:
        for parent in ("verl", "verl.tools"):
            module = types.ModuleType(parent)
            module.__path__ = []  # a package, so that its submodule imports
            aliases[parent] = module
    return aliases
