"""verl's per-row choice of agent loop: a batch row's ``agent_name`` column names the loop that runs it.

An :class:`~rlflow.rollout.agent.AgentLoop` built with ``name`` and ``agents`` (``{name: factory}``) keeps them
here. Each row runs with the loop it names (``factory(rollout)``, made once per rollout the owner samples with,
so a validation copy with other sampling options makes its own), or with the owner when it names the owner's
``name`` or nothing. The loops share the owner's rollout, hence its engine, tokenizer and ``n``: their turns are
batched together and the trajectories come back in the batch's order (each ``Trajectory`` keeps its
``agent_name``).
"""

from __future__ import annotations

from collections.abc import Callable


class NamedLoops:
    """The loops a batch's rows may name, besides the owner (the loop of rows that name none)."""

    def __init__(self, name: str | None, agents: dict[str, Callable] | None):
        agents = dict(agents or {})
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"name must be a non-empty string (the agent_name rows give this loop), got {name!r}")
        for key, factory in agents.items():
            if not isinstance(key, str) or not key or not callable(factory):
                raise TypeError(f"agents must map names to factories (factory(rollout) -> AgentLoop), got "
                                f"{key!r}: {factory!r}")
        if name is not None and name in agents:
            raise ValueError(f"agents names {name!r}, this loop's own name: rows naming it run with this loop")
        self.name, self.factories = name, agents

    def known(self) -> list[str]:
        """Every name a row may give."""
        return sorted(([self.name] if self.name is not None else []) + list(self.factories))

    def loop(self, owner, agent_name: str | None, where: str = "", kind: type = object):
        """The loop that runs a row naming ``agent_name`` (``owner`` for none or its own name; another is made by its
        factory and must be a ``kind``); ``where`` names the row in the error an unknown name raises."""
        if agent_name is None or agent_name == self.name:
            return owner
        if agent_name not in self.factories:
            known = ", ".join(self.known()) or "none: this loop was given no agents"
            raise ValueError(f"{where + ': ' if where else ''}agent_name={agent_name!r} is not an agent loop of this "
                             f"run (known: {known}; a row without agent_name runs with the default loop, "
                             f"{type(owner).__name__})")
        made = owner.__dict__.get("_named_loops")
        if made is None or made[0] is not owner.rollout:  # a copy with another rollout (validation) makes its own
            made = owner._named_loops = (owner.rollout, {})
        loops = made[1]
        if agent_name not in loops:
            loop = self.factories[agent_name](owner.rollout)
            if not isinstance(loop, kind) or getattr(loop, "rollout", None) is not owner.rollout:
                raise TypeError(f"agents[{agent_name!r}] made {type(loop).__name__}: a factory must return an "
                                f"{kind.__name__} over the rollout it is given")
            loops[agent_name] = loop
        return loops[agent_name]
