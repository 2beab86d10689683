"""vLLM's `hermes` tool-call parser: the model's tool calls, written as Qwen and Hermes models write them,
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
become OpenAI `tool_calls`. Text before the first call is the message content.

One parser decides for a streamed and a whole response alike (parse_tool_calls feeds it the whole text at once),
so both give the same calls for the same output, a cut one included:
- a block that begins `{"name": "...", "arguments": ` is a call from then on, and its arguments are what the model
  wrote, streamed as they come; one cut by max_tokens keeps the arguments written so far;
- a finished block whose JSON names the call another way (keys in another order, "parameters") is read whole;
- when no block became a call by the end, the text was content after all and is sent as such.

Streaming follows OpenAI's deltas: content as it comes (holding back what may be the start of `<tool_call>`),
then per call one delta with its index, id, type and name, then argument fragments whose concatenation is the
arguments' text.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

START, END = "<tool_call>", "</tool_call>"
_NAME = re.compile(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*', re.DOTALL)


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ParsedToolCalls:
    content: str | None
    tool_calls: list[dict]          # OpenAI's shape: {"id", "type": "function", "function": {name, arguments}}


def parse_tool_calls(text: str) -> ParsedToolCalls:
    """The whole output, read by the streaming parser in one piece. Content is None beside calls when the model
    wrote nothing before them."""
    parser = StreamingToolParser()
    content, deltas = parser.feed(text, final=True)
    calls = assemble_tool_calls(deltas)
    return ParsedToolCalls((content or None) if calls else content, calls)


def assemble_tool_calls(deltas: list[dict]) -> list[dict]:
    """Streamed tool-call deltas added up into whole calls, in index order."""
    calls: dict[int, dict] = {}
    for d in deltas:
        if "id" in d:
            calls[d["index"]] = {"id": d["id"], "type": "function",
                                 "function": {"name": d["function"]["name"], "arguments": ""}}
        calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


@dataclass
class _Call:
    id: str
    index: int | None = None         # its place among the calls made (OpenAI's tool_calls[].index)
    name: str | None = None
    sent_args: int = 0               # characters of the arguments text already streamed


@dataclass
class StreamingToolParser:
    """Feed the whole text so far; get the deltas to send. One per streamed response."""
    text: str = ""
    sent_content: int = 0
    calls: list[_Call] = field(default_factory=list)    # one per <tool_call> block, a call or not

    @property
    def called(self) -> bool:
        return any(c.name is not None for c in self.calls)

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """(content delta, tool-call deltas) for the text grown to `text`; `final`: nothing more will come."""
        self.text = text
        start = text.find(START)
        deltas = [] if start < 0 else self._call_deltas(text[start:], final)
        if start >= 0 and not (final and not self.called):
            end = len(text[:start].rstrip())
        elif final:
            end = len(text)          # no block became a call: it was content
        else:   # hold back what may begin <tool_call>, and whitespace that may precede one
            end = len(text[:len(text) - _partial_tag(text)].rstrip())
        content = text[self.sent_content:end] if end > self.sent_content else ""
        self.sent_content = max(self.sent_content, end)
        return content, deltas

    def _call_deltas(self, text: str, final: bool) -> list[dict]:
        deltas = []
        bodies = text.split(START)[1:]
        for i, raw in enumerate(bodies):
            body = raw.split(END)[0]
            if i == len(self.calls):
                self.calls.append(_Call(tool_call_id()))
            call = self.calls[i]
            m = _NAME.match(body)
            if m is not None:
                if call.name is None:
                    deltas.append(self._named(call, json.loads(f'"{m.group(1)}"')))
                args = body[m.end():]
                args = args[:_value_end(args)]
            else:
                closed = final or END in raw or i < len(bodies) - 1
                whole = _whole_call(body) if closed and call.name is None else None
                if whole is None:
                    continue
                deltas.append(self._named(call, whole[0]))
                args = whole[1]
            if len(args) > call.sent_args:
                deltas.append({"index": call.index, "function": {"arguments": args[call.sent_args:]}})
                call.sent_args = len(args)
        return deltas

    def _named(self, call: _Call, name: str) -> dict:
        """The delta that opens a call: its index, id, type and name."""
        call.index, call.name = sum(c.name is not None for c in self.calls), name
        return {"index": call.index, "id": call.id, "type": "function", "function": {"name": name, "arguments": ""}}


def _whole_call(body: str) -> tuple[str, str] | None:
    """(name, arguments text) of a finished block whose JSON is a call in another shape; None if it is none."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


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
