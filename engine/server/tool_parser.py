"""vLLM's `hermes` tool-call parser: the model's tool calls, written as Qwen and Hermes models write them,
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
become OpenAI `tool_calls`. Text before the first call is the message content.

Streaming follows OpenAI's deltas: content as it comes (holding back what may be the start of `<tool_call>`),
then per call one delta with its index, id, type and name, then argument fragments whose concatenation is the
arguments' JSON text.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

START, END = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_NAME = re.compile(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*', re.DOTALL)


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ParsedToolCalls:
    content: str | None
    tool_calls: list[dict]          # OpenAI's shape: {"id", "type": "function", "function": {name, arguments}}


def parse_tool_calls(text: str) -> ParsedToolCalls:
    """The whole output. If any call is not valid JSON with a name, nothing is a call: the text stays content
    (as vLLM does), so no client gets half of what the model wrote."""
    start = text.find(START)
    if start < 0:
        return ParsedToolCalls(text, [])
    calls = []
    for body in _CALL.findall(text[start:]):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return ParsedToolCalls(text, [])
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return ParsedToolCalls(text, [])
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append({"id": tool_call_id(), "type": "function",
                      "function": {"name": obj["name"],
                                   "arguments": args if isinstance(args, str) else json.dumps(args,
                                                                                               ensure_ascii=False)}})
    content = text[:start].rstrip()
    return ParsedToolCalls(content or None, calls)


@dataclass
class _Call:
    id: str
    name: str | None = None
    sent_args: int = 0               # characters of the arguments text already streamed


@dataclass
class StreamingToolParser:
    """Feed the whole text so far; get the deltas to send. One per streamed response."""
    text: str = ""
    sent_content: int = 0
    calls: list[_Call] = field(default_factory=list)

    @property
    def called(self) -> bool:
        return any(c.name is not None for c in self.calls)

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """(content delta, tool-call deltas) for the text grown to `text`; `final`: nothing more will come."""
        self.text = text
        start = text.find(START)
        if start >= 0:
            end = len(text[:start].rstrip())
        elif final:
            end = len(text)
        else:   # hold back what may begin <tool_call>, and whitespace that may precede one
            end = len(text[:len(text) - _partial_tag(text)].rstrip())
        content = text[self.sent_content:end] if end > self.sent_content else ""
        self.sent_content = max(self.sent_content, end)
        return content, ([] if start < 0 else self._call_deltas(text[start:]))

    def _call_deltas(self, text: str) -> list[dict]:
        deltas = []
        bodies = text.split(START)[1:]
        for index, raw in enumerate(bodies):
            body = raw.split(END)[0]
            if index == len(self.calls):
                self.calls.append(_Call(tool_call_id()))
            call = self.calls[index]
            m = _NAME.match(body)
            if m is None:
                continue
            if call.name is None:
                call.name = json.loads(f'"{m.group(1)}"')
                deltas.append({"index": index, "id": call.id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            args = body[m.end():]
            args = args[:_value_end(args)]
            if len(args) > call.sent_args:
                deltas.append({"index": index, "function": {"arguments": args[call.sent_args:]}})
                call.sent_args = len(args)
        return deltas


def _value_end(text: str) -> int:
    """Where the JSON value at the start of `text` ends (len(text) while it is still open): string-aware
    bracket depth, so the outer object's closing brace is never streamed as part of the arguments."""
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth <= 0:
                return i + 1
        elif depth == 0 and ch in ",}\n" and i > 0:
            return i                      # a bare number, true, false or null ends here
    return len(text)


def _partial_tag(text: str) -> int:
    """How many trailing characters of `text` could begin `<tool_call>` (held back from the content)."""
    for n in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0
