"""verl's custom agent loops: ``actor_rollout_ref.rollout.agent.agent_loop_config_path``, a YAML list of
``{name, _target_, ...}``, and ``agent.default_agent_loop`` naming one of them.

verl's loops subclass its ``AgentLoopBase`` (``async run(sampling_params, **row) -> AgentLoopOutput``, generating
through its server manager). rlflow's loops subclass :class:`rlflow.rollout.agent.AgentLoop` and override
``run_one(t, sampler)`` (one conversation) or ``respond(t, text, calls, session)`` (what answers a model turn);
the entry's other fields are the class's keyword arguments, next to the multi-turn keys'. A class written against
verl's interface (a subclass of a ``verl`` class, a ``run(sampling_params, ...)``) is refused, naming the file,
the class and what to change; that is read from the source (:mod:`ast`), so verl need not be installed.

Every entry is imported while the config is checked: the data's ``agent_name`` column (verl's choice per row)
may name any of them, or verl's ``tool_agent`` / ``single_turn_agent`` (:mod:`rlflow.config.verl.agent`).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from rlflow.config.verl.loading import ConfigError, VerlConfig
from rlflow.config.verl.user_classes import load_user_class

KEY = "actor_rollout_ref.rollout.agent.agent_loop_config_path"
HOW = ("subclass rlflow.rollout.agent.AgentLoop and override run_one(self, t, sampler) (one conversation: "
       "await sampler.generate(t.context, max_tokens) gives a model turn, t.add_model_turn / t.add_observation "
       "append tokens) or respond(self, t, text, calls, session); __init__ takes the rollout, the entry's fields "
       "and **kwargs for AgentLoop's (docs/multi-turn.md, 'Custom agent loops')")


def entries(path: str) -> dict[str, dict]:
    """The file's loops by name: ``{name: {"_target_": ..., other fields}}``; problems name the key and entry."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"{KEY}={path!r}: no such file {file.resolve()}")
    try:
        items = yaml.safe_load(file.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(f"{KEY}={path!r}: not valid YAML: {e}") from None
    if not isinstance(items, list):
        raise ConfigError(f"{KEY}={path!r}: must be a YAML list of {{name, _target_}} entries, as in verl")
    out = {}
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not item.get("name") or not item.get("_target_"):
            raise ConfigError(f"{KEY}={path!r}: entry {i} ({item!r}) needs name and _target_")
        out[str(item["name"])] = {k: v for k, v in item.items() if k != "name"}
    return out


def split_target(target: str) -> tuple[str, str]:
    """``file.py:Class`` / ``pkg.mod:Class`` / ``pkg.mod.Class`` (verl's hydra spelling) -> (location, class)."""
    if ":" in target:
        location, _, name = target.rpartition(":")
        return location, name
    location, _, name = target.rpartition(".")
    return location, name


def _verl_methods(method) -> list[str]:
    if method.name == "run" and "sampling_params" in [a.arg for a in method.args.args]:
        return ["it implements verl's run(sampling_params, **kwargs) -> AgentLoopOutput"]
    return []


def user_loops(cfg: VerlConfig) -> dict[str, tuple[type, dict]]:
    """Every loop of ``agent_loop_config_path`` by name: its class, checked and imported, and its keyword arguments
    (``{}`` when the file is unset): the default loop and the loops the data's rows name (``agent_name``)."""
    path = cfg[KEY]
    out = {}
    for loop, fields in (entries(path) if path else {}).items():
        kwargs = dict(fields)
        target = str(kwargs.pop("_target_"))
        location, name = split_target(target)
        where = f"{KEY}={path!r}: {loop}._target_={target!r}"
        if not location or not name.isidentifier():
            raise ConfigError(f"{where}: give file.py:Class, package.module:Class or package.module.Class")
        out[loop] = load_user_class("agent loop", "rlflow.rollout.agent.loop:AgentLoop", location, name, where,
                                    "agent-loop interface", HOW, _verl_methods), kwargs
    return out
