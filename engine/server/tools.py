"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, checked, and what they ask of the engine.

The tools go to the model's own chat template (Qwen's lists them in the system turn). With `tool_choice`
"auto" the model decides and the hermes parser reads its `<tool_call>` blocks (vLLM's
`--enable-auto-tool-choice --tool-call-parser hermes`). "required" and a named function are enforced by
constrained decoding: a grammar that admits only `<tool_call>` blocks whose JSON is {"name": one of the
allowed tools, "arguments": that tool's parameters schema}, so the output always parses.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidInputError
from engine.sampling_params import StructuredOutputsParams
from engine.server.protocol import Fields
from engine.sampling_params import JSON_WHITESPACE



@dataclass(frozen=True)
class ToolConfig:
    tools: list[dict] | None            # as the template receives them: [{"type": "function", "function": ...}]
    choice: str                         # "none" | "auto" | "required" | "named"
    named: str | None                   # the function's name when choice == "named"
    parallel: bool

    @property
    def parse_calls(self) -> bool:
        return self.tools is not None and self.choice != "none"


def parse_tools(f: Fields, auto_tool_choice: bool) -> ToolConfig:
    tools = _tools(f.body.get("tools"))
    parallel = f.boolean("parallel_tool_calls", True)
    choice, named = _tool_choice(f.body.get("tool_choice"), tools)
    if choice == "auto" and tools and not auto_tool_choice:
        raise InvalidInputError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
                                'be set on the server; or send tool_choice "required", "none" or a named function',
                                param="tool_choice")
    return ToolConfig(tools or None, choice, named, parallel)


def _tools(value: Any) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidInputError("tools must be a list of {type: function, function: {name, ...}}", param="tools")
    names = set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise InvalidInputError(f'{where} must be {{"type": "function", "function": {{...}}}}', param=where)
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidInputError(f"{where}.function.name must be a non-empty string", param=f"{where}.function")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise InvalidInputError(f"{where}.function.parameters must be a JSON schema object",
                                    param=f"{where}.function.parameters")
        if fn["name"] in names:
            raise InvalidInputError(f"{where}: two tools are named {fn['name']!r}", param=where)
        names.add(fn["name"])
    return [{"type": "function", "function": t["function"]} for t in value]


def _tool_choice(value: Any, tools: list[dict]) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if tools else "none"), None
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise InvalidInputError('tool_choice "required" needs tools', param="tool_choice")
        return value, None
    if isinstance(value, dict) and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
        if name not in {t["function"]["name"] for t in tools}:
            raise InvalidInputError(f"tool_choice names the function {name!r}, which is not in tools",
                                    param="tool_choice")
        return "named", name
    raise InvalidInputError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                            '{"name": ...}}', param="tool_choice")


def tool_call_constraint(config: ToolConfig) -> StructuredOutputsParams | None:
    """The grammar that forces tool calls, for "required" and a named function; None otherwise."""
    if config.choice not in ("required", "named"):
        return None
    tools = [t["function"] for t in config.tools if config.choice == "required"
             or t["function"]["name"] == config.named]
    rules = [f"call_{i}: %json {json.dumps(_call_schema(fn))}" for i, fn in enumerate(tools)]
    repeat = ' ("\\n" call)*' if config.parallel and config.choice == "required" else ""
    lark = "\n".join([f"start: call{repeat}",
                      'call: "<tool_call>\\n" (' + " | ".join(f"call_{i}" for i in range(len(tools)))
                      + ') "\\n</tool_call>"', *rules])
    return StructuredOutputsParams(grammar=lark)


def _call_schema(fn: dict) -> dict:
    """{"name": fn's name, "arguments": its parameters}: the JSON inside one <tool_call>, keys in that order."""
    params = fn.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False,
            "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
