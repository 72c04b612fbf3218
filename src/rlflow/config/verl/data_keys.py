"""verl 0.9's newer ``data.*`` keys -> PromptData's arguments.

- ``train_max_samples`` / ``val_max_samples``: use at most N rows of the files (-1, or any N <= 0: all),
  chosen as verl's ``RLHFDataset`` chooses them: with ``data.shuffle`` N distinct rows drawn by
  ``numpy.random.default_rng(data.seed)``, otherwise the first N; before any filtering.
- ``tool_config_path`` / ``function_tool_path`` (verl's defaults: their ``multi_turn.*`` keys): the tools'
  schemas are rendered into each chat prompt when ``filter_overlong_prompts`` measures it, as the agent loop
  renders it.
- ``mm_processor_kwargs``: keyword arguments of every call of a vision-language model's processor on a row.
"""

from __future__ import annotations

from pathlib import Path

from rlflow.config.verl.agent import function_tools
from rlflow.config.verl.loading import ConfigError, VerlConfig


def _max_samples(cfg: VerlConfig, key: str) -> int | None:
    value = cfg[key]
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}={value!r}: must be an integer (-1: every row)")
    return value if value > 0 else None


def tool_schemas(cfg: VerlConfig, agent: dict | None) -> list[dict] | None:
    """The schemas of ``data.tool_config_path``'s tools (the agent loop's own tools when it is the same file)."""
    path, functions = cfg["data.tool_config_path"], cfg["data.function_tool_path"]
    if not path and not functions:
        return None
    mt = "actor_rollout_ref.rollout.multi_turn"
    if agent and cfg[f"{mt}.tool_config_path"] == path and cfg[f"{mt}.function_tool_path"] == functions:
        return [t.schema for t in agent["tools"]]
    from rlflow.rollout.tools.config import ToolConfigError, load_tool_config

    try:
        tools = load_tool_config(Path(path).expanduser()) if path else []
    except ToolConfigError as e:
        raise ConfigError(f"data.tool_config_path: {e}") from e
    return [t.schema for t in tools + function_tools(functions, "data.function_tool_path", tools)]


def data_extras(cfg: VerlConfig, agent: dict | None) -> dict:
    """PromptData's ``train_max_samples``, ``val_max_samples``, ``tool_schemas`` and ``mm_processor_kwargs``,
    those that are set (the others keep PromptData's defaults: every row, no tools, no processor arguments)."""
    mm = cfg["data.mm_processor_kwargs"]
    if mm is not None and not isinstance(mm, dict):
        raise ConfigError(f"data.mm_processor_kwargs={mm!r}: must be a mapping of processor keyword arguments")
    kwargs = {"train_max_samples": _max_samples(cfg, "data.train_max_samples"),
              "val_max_samples": _max_samples(cfg, "data.val_max_samples"),
              "tool_schemas": tool_schemas(cfg, agent), "mm_processor_kwargs": dict(mm or {})}
    return {k: v for k, v in kwargs.items() if v}
