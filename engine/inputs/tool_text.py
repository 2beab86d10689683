"""Tools, tool calls and tool results written as text, for a chat template that does not know tools.

A template that never reads `tool_calls` (SmolLM2's, plain ChatML) would drop the calls an assistant made, render
tool results under a role the model never saw, and ignore `tools`. The conversation is then rewritten in the
hermes convention that the server's tool-call parser reads back (Qwen's own template writes the same):
- the tools are listed in the system message (one is added first if the chat has none), with how to call them;
- an assistant's calls follow its text as `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>` blocks;
- tool results become a user message, each result inside `<tool_response>\n...\n</tool_response>`, consecutive
  results in one message.
"""
from __future__ import annotations

import functools
import json
from typing import Any

from engine.logger import init_logger

logger = init_logger(__name__)

_TOOLS_INTRO = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                "with function signatures within <tools></tools> XML tags:\n<tools>")
_TOOLS_OUTRO = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                "<args-json-object>}\n</tool_call>")


def uses_tools(messages: list[dict[str, Any]], tools: list[dict] | None) -> bool:
    return bool(tools) or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


def tools_as_text(messages: list[dict[str, Any]], tools: list[dict] | None) -> list[dict[str, Any]]:
    """The messages rewritten so that a template without tool support renders the tools, calls and results."""
    _say_once()
    out: list[dict[str, Any]] = []
    for message in messages:
        if message.get("role") == "tool":
            result = _wrap(message.get("content"), "<tool_response>\n", "\n</tool_response>")
            if out and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": _join(out[-1]["content"], result)}
            else:
                out.append({"role": "user", "content": result, "tool_results": True})
        elif message.get("tool_calls"):
            text = {k: v for k, v in message.items() if k != "tool_calls"}
            blocks = "\n".join(_call_block(c) for c in message["tool_calls"])
            text["content"] = _join(message.get("content"), blocks)
            out.append(text)
        else:
            out.append(message)
    out = [{k: v for k, v in m.items() if k != "tool_results"} for m in out]
    return _with_tools_listed(out, tools) if tools else out


@functools.cache
def _say_once() -> None:
    logger.warning("chat template has no tool support; rendering tool calls as text")


def _call_block(call: dict[str, Any]) -> str:
    fn = call.get("function", {})
    args = fn.get("arguments", {})
    args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return f'<tool_call>\n{{"name": {json.dumps(fn.get("name"), ensure_ascii=False)}, "arguments": {args_text}}}' \
           f"\n</tool_call>"


def _with_tools_listed(messages: list[dict[str, Any]], tools: list[dict]) -> list[dict[str, Any]]:
    listing = _TOOLS_INTRO + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools) + _TOOLS_OUTRO
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": _join(messages[0].get("content"), listing, "\n\n")}, *messages[1:]]
    return [{"role": "system", "content": listing}, *messages]


def _wrap(content: Any, before: str, after: str) -> str | list[dict]:
    """`content` (a string or content parts) between two texts, in the same form."""
    if isinstance(content, list):
        return [{"type": "text", "text": before}, *content, {"type": "text", "text": after}]
    return before + (content or "") + after


def _join(first: Any, second: Any, sep: str = "\n") -> str | list[dict]:
    """Two contents (strings or content parts) as one, as parts if either is; the separator only between two
    non-empty ones."""
    if isinstance(first, list) or isinstance(second, list):
        a, b = _parts(first), _parts(second)
        return a + [{"type": "text", "text": sep}] + b if a and b else a + b
    if not first or not second:
        return first or second or ""
    return first + sep + second


def _parts(content: Any) -> list[dict]:
    if isinstance(content, list):
        return content
    return [{"type": "text", "text": content}] if content else []
