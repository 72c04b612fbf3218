"""Tool-call parsers: the model's text -> the calls it asked for.

``hermes`` (verl's ``multi_turn.format: hermes``; Qwen2.5/Qwen3, Hermes and most open chat templates):
each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the assistant's text.
A call that cannot be read (bad JSON, no name, an unclosed tag) is still returned, with ``error`` set,
so the model is told what was wrong and the rollout counts it; nothing the model wrote is silently dropped.

``vllm:<name>`` (e.g. ``vllm:llama3_json``, ``vllm:mistral``, ``vllm:pythonic``): one of vLLM's tool parsers
(``vllm serve --tool-call-parser <name>``), for the chat templates whose call format is not Hermes. vLLM's
parsers return no call for a call they cannot read (its text stays in the turn), so such turns end the
conversation as answers rather than being answered with an error.
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

    def bind(self, tokenizer, tools: list[dict]) -> None:
        """Read what parsing needs from the tokenizer and the tools' schemas (vLLM's parsers do); most need nothing."""


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


class VLLMParser(ToolParser):
    """One of vLLM's tool parsers (``name`` as ``vllm serve --tool-call-parser`` takes it).

    vLLM's parsers read the tokenizer (their special tokens) and the request's tools, so :meth:`bind` gives them
    (the agent loop does, with its tokenizer and tool schemas) before :meth:`parse`.
    """

    def __init__(self, name: str):
        from vllm.tool_parsers import ToolParserManager

        try:
            self.parser_class = ToolParserManager.get_tool_parser(name)
        except KeyError:
            raise ValueError(f"vLLM has no tool parser {name!r}; its parsers: "
                             f"{sorted(ToolParserManager.list_registered())}") from None
        self.name, self.parser, self.request = name, None, None

    def bind(self, tokenizer, tools: list[dict]) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        self.parser = self.parser_class(tokenizer)  # raises, naming the token, when the tokenizer lacks it
        self.request = ChatCompletionRequest(messages=[], tools=tools or None, model="rlflow")

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.parser is None:
            raise RuntimeError(f"the vllm:{self.name} parser needs bind(tokenizer, tools) before parse")
        out = self.parser.extract_tool_calls(text, self.request)
        if not out.tools_called:
            return text, []
        calls = []
        for call in out.tool_calls:
            parsed = HermesParser.read(json.dumps({"name": call.function.name, "arguments": call.function.arguments}))
            calls.append(parsed)
        return (out.content or "").strip(), calls


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser}


def tool_parser(fmt: str | ToolParser) -> ToolParser:
    """verl's ``multi_turn.format`` name, ``vllm:<parser>`` or a parser object -> a parser."""
    if isinstance(fmt, ToolParser):
        return fmt
    if isinstance(fmt, str) and fmt.startswith("vllm:"):
        return VLLMParser(fmt.removeprefix("vllm:"))
    if fmt not in PARSERS:
        raise ValueError(f"unknown tool-call format {fmt!r}; choose from {sorted(PARSERS)}, 'vllm:<name>' (one of "
                         f"vLLM's tool parsers) or pass a ToolParser")
    return PARSERS[fmt]()
