"""The ``Tool`` contract: an OpenAI function schema plus an ``execute`` that turns arguments into text.

A tool is what the model may call during an agent rollout (:class:`rlflow.rollout.agent.AgentLoop`)::

    class Weather(Tool):
        name = "weather"
        description = "Today's temperature in a city."
        parameters = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

        async def execute(self, args, **sample_kwargs):
            return f"{args['city']}: 21 C"

``execute(args, **sample_kwargs)`` receives the parsed JSON arguments and the sample's keyword arguments
(verl's per-row ``extra_info.tools_kwargs[name]``, its ``create_kwargs`` and ``execute_kwargs`` merged) plus
``session``: a dict private to this tool in this trajectory, kept across its calls (a tool that scores
successive answers keeps its best score there). It returns the text shown to the model, or a
:class:`ToolResult` / ``(text, reward)`` / ``(text, reward, metrics)``: a step ``reward`` is summed per
trajectory (``step_rewards``), numeric ``metrics`` are averaged into ``agent/tool/<name>/<key>``.
A plain ``def execute`` runs on a worker thread, so blocking tools (subprocesses, HTTP) never stall the
other trajectories. A tool that raises or runs past ``timeout_s`` never crashes the step: the model reads
an error message instead, and the rollout counts it (``agent/tool_errors``, ``agent/tool_timeouts``).

verl's constructor ``Tool(config, tool_schema)`` is accepted, so a verl tool YAML entry
(:func:`rlflow.rollout.tools.load_tool_config`) builds rlflow tools unchanged.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
from dataclasses import dataclass, field
from typing import Any, ClassVar

JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
              "object": dict, "null": type(None)}


class ToolError(Exception):
    """A tool call the model got wrong (unknown tool, bad arguments): the message is shown to the model."""


@dataclass
class ToolResult:
    """What one call returns: the text shown to the model, an optional step reward, numeric metrics."""

    text: str
    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # "error" or "timeout" when the call failed (set by the agent loop)


class Tool:
    """Base of every tool. Set ``name``, ``description`` and ``parameters`` (a JSON schema) on the class or
    pass verl's ``tool_schema``; implement :meth:`execute` (async or plain).

    Args:
        config: tool options (verl's ``config:`` block); ``timeout_s`` there overrides the class default.
        tool_schema: an OpenAI function schema ``{"type": "function", "function": {name, description,
            parameters}}``; overrides the class attributes (so one class can serve under another name).
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    parameters: ClassVar[dict] = {"type": "object", "properties": {}}
    #: seconds one call may take before the model is told it timed out (``None``: no limit)
    timeout_s: float | None = 30.0

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        self.config = dict(config or {})
        self.config.pop("type", None)  # verl's "native" / "mcp" marker; the loader checks it
        if "timeout_s" in self.config:
            self.timeout_s = self.config.pop("timeout_s")
        if tool_schema is not None:
            function = tool_schema.get("function", tool_schema)
            if not isinstance(function, dict) or not function.get("name"):
                raise ValueError(f"{type(self).__name__}: tool_schema needs function.name, got {tool_schema!r}")
            self.name = function["name"]
            self.description = function.get("description", "")
            self.parameters = copy.deepcopy(function.get("parameters") or {"type": "object", "properties": {}})
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"{type(self).__name__} has no name: set the class attribute `name` or pass tool_schema")

    @property
    def schema(self) -> dict:
        """The OpenAI function schema, as ``tokenizer.apply_chat_template(..., tools=[...])`` takes it."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def check_args(self, args: Any) -> dict:
        """The arguments if they fit ``parameters`` (required keys, JSON types of declared ones), else ToolError."""
        if not isinstance(args, dict):
            raise ToolError(f"{self.name}: arguments must be a JSON object, got {type(args).__name__}")
        missing = [k for k in self.parameters.get("required", ()) if k not in args]
        if missing:
            raise ToolError(f"{self.name}: missing required argument(s) {missing}")
        for key, spec in self.parameters.get("properties", {}).items():
            kind = spec.get("type") if isinstance(spec, dict) else None
            if key in args and isinstance(kind, str) and kind in JSON_TYPES:
                ok = isinstance(args[key], JSON_TYPES[kind]) and not (kind in ("integer", "number")
                                                                      and isinstance(args[key], bool))
                if not ok:
                    raise ToolError(f"{self.name}: argument {key!r} must be {kind}, got {args[key]!r}")
        return args

    async def execute(self, args: dict, **sample_kwargs) -> ToolResult | str | tuple:
        """Run the call; see the module docstring for ``sample_kwargs`` and the return forms."""
        raise NotImplementedError(f"{type(self).__name__}.execute")

    async def __call__(self, args: dict, **sample_kwargs) -> ToolResult:
        """Check the arguments, run :meth:`execute` (on a thread when it is not a coroutine), normalise the result."""
        args = self.check_args(args)
        if inspect.iscoroutinefunction(self.execute):
            out = await self.execute(args, **sample_kwargs)
        else:
            out = await asyncio.to_thread(self.execute, args, **sample_kwargs)
        return as_result(out, self.name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def as_result(out: Any, name: str = "tool") -> ToolResult:
    """``str`` / ``(text, reward[, metrics])`` / :class:`ToolResult` -> :class:`ToolResult`."""
    if isinstance(out, ToolResult):
        return out
    if isinstance(out, str):
        return ToolResult(out)
    if isinstance(out, tuple) and 1 <= len(out) <= 3:
        text, reward, metrics = (*out, None, None)[:3]
        text = getattr(text, "text", text)  # verl's ToolResponse(text=...)
        return ToolResult("" if text is None else str(text), None if reward is None else float(reward),
                          dict(metrics or {}))
    raise TypeError(f"tool {name!r} returned {type(out).__name__}; return a str, (text, reward[, metrics]) "
                    "or a ToolResult")


class FunctionTool(Tool):
    """A plain Python function as a tool: ``FunctionTool(fn, parameters=..., description=...)``.

    ``fn(**args)`` (sync or async) returns the text (or any :class:`ToolResult` form). Its name and, unless
    given, its description come from the function; ``parameters`` is the JSON schema of its arguments.
    """

    def __init__(self, fn, *, parameters: dict, description: str | None = None, name: str | None = None,
                 timeout_s: float | None = 30.0):
        schema = {"name": name or fn.__name__, "description": description or inspect.getdoc(fn) or "",
                  "parameters": parameters}
        super().__init__({"timeout_s": timeout_s}, {"type": "function", "function": schema})
        self.fn = fn

    async def execute(self, args: dict, **sample_kwargs):
        if inspect.iscoroutinefunction(self.fn):
            return await self.fn(**args)
        return await asyncio.to_thread(self.fn, **args)  # a blocking function never stalls the event loop
