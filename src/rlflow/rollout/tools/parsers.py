"""Tool-call parsers: the model's text -> the calls it asked for.

``hermes`` (verl's ``multi_turn.format: hermes``; Qwen2.5/Qwen3, Hermes and most open chat templates):
each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the assistant's text.
A call that cannot be read (bad JSON, no name, an unclosed tag) is still returned, with ``error`` set,
so the model is told what was wrong and the rollout counts it; nothing the model wrote is silently dropped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass
class ToolCall:
    """One call: the tool's ``name`` and its ``arguments``, or ``error`` when the call could not be read."""

    name: str
    arguments: dict
    raw: str = ""
    error: str | None = None


class ToolParser:
    """Base: :meth:`parse` returns the text outside the calls and the calls in order."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError


class HermesParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (``arguments`` may be a JSON string)."""

    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def __init__(self):
        self.pattern = re.compile(re.escape(self.open_tag) + r"(.*?)" + re.escape(self.close_tag), re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls = [self.read(m.group(1)) for m in self.pattern.finditer(text)]
        rest = self.pattern.sub("", text)
        if self.open_tag in rest:  # an opened call the model never closed (e.g. cut by the token budget)
            raw = rest[rest.index(self.open_tag):]
            calls.append(ToolCall("", {}, raw, f"unterminated {self.open_tag} (no {self.close_tag})"))
            rest = rest[: rest.index(self.open_tag)]
        return rest.strip(), calls

    @staticmethod
    def read(body: str) -> ToolCall:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            return ToolCall("", {}, body, f"the tool call is not valid JSON ({e.msg} at position {e.pos})")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return ToolCall("", {}, body, 'a tool call needs {"name": ..., "arguments": {...}}')
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                return ToolCall(obj["name"], {}, body, f"the arguments are not valid JSON ({e.msg})")
        if not isinstance(args, dict):
            return ToolCall(obj["name"], {}, body, "the arguments must be a JSON object")
        return ToolCall(obj["name"], args, body)


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser}


def tool_parser(fmt: str | ToolParser) -> ToolParser:
    """verl's ``multi_turn.format`` name (or a parser object) -> a parser."""
    if isinstance(fmt, ToolParser):
        return fmt
    if fmt not in PARSERS:
        raise ValueError(f"unknown tool-call format {fmt!r}; choose from {sorted(PARSERS)} or pass a ToolParser")
    return PARSERS[fmt]()
