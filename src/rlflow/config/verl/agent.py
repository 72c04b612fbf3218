"""verl's multi-turn keys (``actor_rollout_ref.rollout.multi_turn.*``, ``rollout.agent.default_agent_loop``)
-> the kwargs of :class:`~rlflow.rollout.agent.AgentLoop` (or the user's subclass from ``agent_loop_config_path``:
:mod:`rlflow.config.verl.agent_loops`; ``loop_class``), which then wraps the single-turn rollout.

The tool and interaction files are loaded here, while the config is checked (a bad class name fails before
any weights load); per-row ``extra_info.tools_kwargs`` / ``interaction_kwargs`` are read by the loop.
"""

from __future__ import annotations

from pathlib import Path

from rlflow.config.verl.agent_loops import user_loops
from rlflow.config.verl.loading import ConfigError, NotSupportedError, VerlConfig

MT = "actor_rollout_ref.rollout.multi_turn"
AGENT = "actor_rollout_ref.rollout.agent"
FORMATS = ("hermes",)
TRUNCATE_SIDES = ("left", "right", "middle")
AGENT_LOOPS = ("single_turn_agent", "tool_agent")
# in the plan's AgentLoop kwargs, for rows naming a loop: (its own name, {other name: loop}, the multi-turn keys)
CATALOGUE = "_loops"


def _at_least(cfg: VerlConfig, key: str, low: int, allow_none: bool) -> int | None:
    value = cfg[key]
    if value is None and allow_none:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{key}={value!r}: must be an integer >= {low}{' or null' if allow_none else ''}")
    return value


def agent_plan(cfg: VerlConfig, notes: list[str]) -> dict | None:
    """AgentLoop's kwargs, or None when the rollout is single-turn."""
    enable, loop = cfg[f"{MT}.enable"], cfg[f"{AGENT}.default_agent_loop"]
    tools_path, interaction_path = cfg[f"{MT}.tool_config_path"], cfg[f"{MT}.interaction_config_path"]
    users = user_loops(cfg)
    custom = users.get(loop)
    if loop not in AGENT_LOOPS and custom is None:
        raise ConfigError(f"{AGENT}.default_agent_loop={loop!r}: not one of rlflow's ({', '.join(AGENT_LOOPS)}) and "
                          f"not in {AGENT}.agent_loop_config_path (a YAML list of {{name, _target_}}: your loops)")
    if not enable and loop != "tool_agent" and custom is None:
        if tools_path or interaction_path or cfg[f"{MT}.function_tool_path"]:
            raise ConfigError(f"{MT}.tool_config_path / function_tool_path / interaction_config_path are set but "
                              f"{MT}.enable=False: "
                              f"set {MT}.enable=True for multi-turn rollouts")
        if users:
            notes.append(f"{AGENT}.agent_loop_config_path: its loops ({', '.join(users)}) do not run: the rollout is "
                         f"single-turn (default_agent_loop={loop}, {MT}.enable=False); set {MT}.enable=True for the "
                         "data's rows to run the loops they name (agent_name)")
        return None
    fmt, side = cfg[f"{MT}.format"], cfg[f"{MT}.tool_response_truncate_side"]
    if fmt not in FORMATS:
        raise NotSupportedError(f"{MT}.format", fmt, f"the {fmt!r} tool-call format", f"Use one of {FORMATS}.")
    if side not in TRUNCATE_SIDES:
        raise ConfigError(f"{MT}.tool_response_truncate_side={side!r}: choose from {', '.join(TRUNCATE_SIDES)}")
    kwargs = {
        "format": fmt, "tool_response_truncate_side": side,
        "max_assistant_turns": _at_least(cfg, f"{MT}.max_assistant_turns", 1, True),
        "max_user_turns": _at_least(cfg, f"{MT}.max_user_turns", 0, True),
        "max_parallel_calls": _at_least(cfg, f"{MT}.max_parallel_calls", 1, False),
        "max_tool_response_length": _at_least(cfg, f"{MT}.max_tool_response_length", 1, False),
    }
    from rlflow.rollout.tools.config import ToolConfigError, load_interaction_config, load_tool_config

    try:
        kwargs["tools"] = load_tool_config(Path(tools_path).expanduser()) if tools_path else []
        kwargs["interaction"] = load_interaction_config(Path(interaction_path).expanduser()) \
            if interaction_path else None
    except ToolConfigError as e:
        key = "tool_config_path" if tools_path and str(Path(tools_path).expanduser()) in str(e) \
            else "interaction_config_path"
        raise ConfigError(f"{MT}.{key}: {e}") from e
    kwargs["tools"] += function_tools(cfg[f"{MT}.function_tool_path"], f"{MT}.function_tool_path", kwargs["tools"])
    if not kwargs["tools"] and kwargs["interaction"] is None:
        notes.append(f"{MT}.enable=True without tools or interactions: each sample is one model turn")
    names = ", ".join(t.name for t in kwargs["tools"]) or "none"
    own = loop if custom is not None or "tool_agent" in users else "tool_agent"  # the name of the loop built here
    others = {"single_turn_agent": (None, {}, False), "tool_agent": (None, {}, True)}
    others |= {name: (cls, _fields(name, fields, kwargs), True) for name, (cls, fields) in users.items()}
    kwargs[CATALOGUE] = own, {name: loop for name, loop in others.items() if name != own}, tuple(kwargs)
    if custom is not None:
        kwargs["loop_class"], fields = custom
        kwargs.update(_fields(loop, fields, kwargs))
    notes.append(f"multi-turn: the Trainer gets rollout={custom[0].__name__ if custom else 'AgentLoop'}(<rollout>, "
                 f"tools=[{names}], "
                 f"interaction={sorted(kwargs['interaction']) if kwargs['interaction'] else None}, "
                 f"max_assistant_turns={kwargs['max_assistant_turns']}, max_user_turns={kwargs['max_user_turns']}); "
                 "data.max_response_length bounds each whole conversation")
    return kwargs


def _fields(loop: str, fields: dict, multi_turn: dict) -> dict:
    clash = sorted(set(fields) & set(multi_turn))
    if clash:
        raise ConfigError(f"{AGENT}.agent_loop_config_path: the entry {loop!r} sets {', '.join(clash)}, which the "
                          f"multi-turn keys set ({MT}.*); set it there")
    return fields


def name_loops_of_rows(agent: dict | None, rows: list[tuple[str, dict]]) -> None:
    """verl's per-row ``agent_name``: every name the data's ``rows`` (``(file, row)``) give must be a loop of the run
    (an error names the file, the row and the names); ``agent`` (the plan's AgentLoop kwargs) gets ``name`` and
    ``agents`` (the loops named besides its own, as ``(class or None: AgentLoop, fields, with the multi-turn keys)``)
    when a row names another loop than the one it builds."""
    own, others, _ = agent[CATALOGUE] if agent is not None else ("single_turn_agent", {}, ())
    known = sorted({own, *others})
    used = set()
    for file, row in rows:
        name = row.get("agent_name")
        if name is not None and name not in known:
            single = "" if agent is not None else (f"; this run is single-turn ({MT}.enable=False): set {MT}.enable="
                                                   "True for rows to run other agent loops")
            raise ConfigError(f"data.train_files / data.val_files: {file}, row {row['index']}: agent_name={name!r} is "
                              f"not an agent loop of this run (known: {', '.join(known)}: verl's and "
                              f"{AGENT}.agent_loop_config_path's){single}")
        used |= {name} - {None, own}
    if agent is not None:
        agent.pop("name", None)
        agent.pop("agents", None)
        if used:
            agent["name"], agent["agents"] = own, {name: others[name] for name in sorted(used)}


def function_tools(path: str | None, key: str, others: list) -> list:
    """The ``@function_tool`` tools of the file at ``key`` (none when unset); a name another tool has is an
    error, as in verl."""
    if not path:
        return []
    from rlflow.rollout.tools.functions import load_function_tools  # as rollout.tools.config above: defers torch

    try:
        tools = load_function_tools(path)
    except Exception as e:  # noqa: BLE001 - the user's file: name the key and what it raised
        raise ConfigError(f"{key}={path!r}: {type(e).__name__}: {e}") from e
    if not tools:
        raise ConfigError(f"{key}={path!r}: the file defines no @function_tool (from rlflow.rollout.tools import "
                          "function_tool, or verl's verl.tools.function_tool)")
    clash = sorted({t.name for t in tools} & {t.name for t in others})
    if clash:
        raise ConfigError(f"{key}={path!r}: the tool {clash[0]!r} is in multi_turn.tool_config_path too; rename one")
    return tools
