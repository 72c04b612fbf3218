"""verl's tool and interaction YAML files -> rlflow objects.

A tool file (``actor_rollout_ref.rollout.multi_turn.tool_config_path``)::

    tools:
      - class_name: verl.tools.gsm8k_tool.Gsm8kTool      # or rlflow.rollout.tools.Calculator, pkg.mod.Class,
        config: {type: native}                          #    path/to/file.py:Class
        tool_schema: {type: function, function: {name: ..., description: ..., parameters: {...}}}

An interaction file (``interaction_config_path``)::

    interaction:
      - name: gsm8k
        class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction
        config: {}

verl's own classes that rlflow re-implements are mapped to them (:data:`VERL_CLASSES`); verl classes
that need a service rlflow does not run (MCP servers, search engines, remote sandboxes) are refused
with the reason. Every error names the file and the entry.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from rlflow.rollout.agent.interaction import Interaction
from rlflow.rollout.tools.base import Tool

# verl class -> rlflow class path (None: not available, with the reason)
VERL_CLASSES: dict[str, str | tuple[None, str]] = {
    "verl.tools.gsm8k_tool.Gsm8kTool": "rlflow.rollout.tools.gsm8k:Gsm8kTool",
    "verl.workers.tool.gsm8k_tool.Gsm8kTool": "rlflow.rollout.tools.gsm8k:Gsm8kTool",
    "verl.interactions.gsm8k_interaction.Gsm8kInteraction": "rlflow.rollout.agent.interaction:Gsm8kInteraction",
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": "rlflow.rollout.tools.python:PythonTool",  # its url, else locally
    "verl.tools.mcp_search_tool.MCPSearchTool": (None, "MCP servers"),
    "verl.tools.mcp_base_tool.MCPBaseTool": (None, "MCP servers"),
    "verl.tools.search_tool.SearchTool": (None, "a retrieval server"),
    "verl.tools.geo3k_tool.Geo3kTool": (None, "vision-language multi-turn"),
    "verl.tools.image_zoom_in_tool.ImageZoomInTool": (None, "vision-language multi-turn"),
}


class ToolConfigError(ValueError):
    """A tool or interaction file rlflow cannot use; the message names the file and the entry."""


def load_class(spec: str, where: str) -> type:
    """``pkg.mod.Class``, ``pkg.mod:Class`` or ``path/to/file.py:Class`` (verl names mapped first)."""
    mapped = VERL_CLASSES.get(spec, spec)
    if isinstance(mapped, tuple):
        raise ToolConfigError(f"{where}: class_name {spec!r} needs {mapped[1]}, which rlflow does not support")
    if ":" in mapped:
        module_part, _, name = mapped.rpartition(":")
    else:
        module_part, _, name = mapped.rpartition(".")
    if not module_part or not name:
        raise ToolConfigError(f"{where}: class_name {spec!r} must be pkg.module.Class, pkg.module:Class or file.py:Class")
    try:
        if module_part.endswith(".py"):
            path = Path(module_part).expanduser()
            if not path.is_file():
                raise ToolConfigError(f"{where}: class_name {spec!r}: no such file {path}")
            mod_name = f"rlflow_user_tool_{abs(hash(str(path.resolve())))}"
            module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(mod_name, path))
            sys.modules[mod_name] = module
            module.__spec__.loader.exec_module(module)
        else:
            module = importlib.import_module(module_part)
    except ToolConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's module: report it, naming the entry
        hint = " (verl itself is not needed: see docs/multi-turn.md for the classes rlflow provides)" \
            if module_part.startswith("verl.") else ""
        raise ToolConfigError(f"{where}: cannot import {module_part!r} for class_name {spec!r}: {e!r}{hint}") from e
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise ToolConfigError(f"{where}: {module_part!r} has no class {name!r}")
    return cls


def _entries(path: str | Path, key: str) -> tuple[list, str]:
    from omegaconf import OmegaConf

    file = Path(path).expanduser()
    if not file.is_file():
        raise ToolConfigError(f"{path}: no such file")
    data = OmegaConf.to_container(OmegaConf.load(file), resolve=True) or {}
    entries = data.get(key) if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ToolConfigError(f"{file}: expected a top-level '{key}:' list")
    return entries, str(file)


def load_tool_config(path: str | Path) -> list:
    """The tools of a verl tool YAML file, built as ``cls(config=..., tool_schema=...)``."""
    entries, name = _entries(path, "tools")
    tools, seen = [], set()
    for i, entry in enumerate(entries):
        where = f"{name}, tools[{i}]"
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise ToolConfigError(f"{where}: each tool needs class_name (and optionally config, tool_schema)")
        config: dict[str, Any] = dict(entry.get("config") or {})
        kind = config.get("type", "native")
        if kind != "native":
            raise ToolConfigError(f"{where}: config.type={kind!r}: only native tools are supported (MCP tools "
                                  "need MCP servers)")
        cls = load_class(entry["class_name"], where)
        if not issubclass(cls, Tool):
            raise ToolConfigError(f"{where}: {cls.__name__} is not an rlflow.rollout.tools.Tool")
        try:
            tool = cls(config=config, tool_schema=entry.get("tool_schema"))
        except Exception as e:  # noqa: BLE001
            raise ToolConfigError(f"{where}: {cls.__name__}(config=..., tool_schema=...) raised {e!r}") from e
        if tool.name in seen:
            raise ToolConfigError(f"{where}: a second tool named {tool.name!r}")
        seen.add(tool.name)
        tools.append(tool)
    return tools


def load_interaction_config(path: str | Path) -> dict:
    """``{name: interaction}`` from a verl interaction YAML file (``cls(config)`` each)."""
    entries, name = _entries(path, "interaction")
    out = {}
    for i, entry in enumerate(entries):
        where = f"{name}, interaction[{i}]"
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise ToolConfigError(f"{where}: each interaction needs class_name (and name, config)")
        cls = load_class(entry["class_name"], where)
        if not issubclass(cls, Interaction):
            raise ToolConfigError(f"{where}: {cls.__name__} is not an rlflow.rollout.agent.Interaction")
        key = entry.get("name") or cls.__name__
        if key in out:
            raise ToolConfigError(f"{where}: a second interaction named {key!r}")
        out[key] = cls(dict(entry.get("config") or {}))
    return out
