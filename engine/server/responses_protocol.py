"""POST /v1/responses bodies -> what the chat path takes: chat messages, chat-shaped tools, an output constraint.

`input` is a string (one user message) or a list of items: messages (roles user, assistant, system, developer;
content a string or parts input_text / input_image / output_text), function_call and function_call_output
items (an assistant turn's tool calls and their results) and reasoning items (an assistant turn's thinking).
Output items of an earlier response are valid input items, which is how a stored response continues
(previous_response_id). Fields and item types this server cannot honour are a 400 that names them, never
silently dropped.
"""
from __future__ import annotations

from typing import Any

from engine.errors import InvalidInputError
from engine.sampling_params import StructuredOutputsParams
from engine.server.protocol import Fields

# Fields that would change the answer if ignored, with what to do instead.
UNSUPPORTED = {
    "background": "background responses are not supported; send the request and wait (or stream)",
    "conversation": "conversations are not stored here; chain responses with previous_response_id",
    "prompt": "stored prompt templates are not supported; send the input itself",
    "top_logprobs": "logprobs are not returned by /v1/responses here; use /v1/chat/completions",
    "max_tool_calls": "max_tool_calls is not supported",
}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_ITEM_TYPES = "message, function_call, function_call_output, reasoning"


def check_unsupported(f: Fields) -> None:
    for name, why in UNSUPPORTED.items():
        if f.given(name) and f.body[name] is not False:
            raise InvalidInputError(f"{name}: {why}", param=name)
    truncation = f.string("truncation", "disabled")
    if truncation != "disabled":
        raise InvalidInputError('truncation must be "disabled": this server does not drop input to fit',
                                param="truncation")


def input_messages(value: Any, param: str = "input") -> list[dict]:
    """The chat messages of `input` (a string, or a list of items)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidInputError("input must be a string or a non-empty list of items", param=param)
    messages: list[dict] = []
    for i, item in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise InvalidInputError(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            _add_message(messages, item, where)
        elif kind == "function_call":
            _add_tool_call(messages, item, where)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": _output_text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            text = "".join(part.get("text", "") for part in item.get("content") or [] if isinstance(part, dict))
            _assistant(messages)["reasoning_content"] = text
        else:
            raise InvalidInputError(f"{where}: item type {kind!r} is not supported; this server takes {_ITEM_TYPES}",
                                    param=f"{where}.type")
    return messages


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidInputError(f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value


def _assistant(messages: list[dict]) -> dict:
    """The assistant message the next assistant item joins: the last message if it is one that has no text
    after its tool calls yet, else a new one."""
    if messages and messages[-1]["role"] == "assistant":
        return messages[-1]
    messages.append({"role": "assistant", "content": ""})
    return messages[-1]


def _add_message(messages: list[dict], item: dict, where: str) -> None:
    role = _ROLES.get(item.get("role"))
    if role is None:
        raise InvalidInputError(f"{where}.role must be one of {', '.join(_ROLES)}", param=f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        parts = content
    elif isinstance(content, list):
        parts = [_part(part, f"{where}.content[{j}]") for j, part in enumerate(content)]
        if all(p["type"] == "text" for p in parts):          # plain text for templates that expect a string
            parts = "".join(p["text"] for p in parts)
    else:
        raise InvalidInputError(f"{where}.content must be a string or a list of content parts",
                                param=f"{where}.content")
    if role == "assistant" and messages and messages[-1]["role"] == "assistant" \
            and not messages[-1]["content"] and not messages[-1].get("tool_calls") and isinstance(parts, str):
        messages[-1]["content"] = parts                       # the text that follows its reasoning item
        return
    messages.append({"role": role, "content": parts})


def _part(part: Any, where: str) -> dict:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text", "text"):
        return {"type": "text", "text": _string(part, "text", where)}
    if kind == "refusal":
        return {"type": "text", "text": _string(part, "refusal", where)}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str):
            raise InvalidInputError(f"{where}: input_image needs image_url (a data: URL); file_id is not "
                                    "supported here", param=f"{where}.image_url")
        return {"type": "image_url", "image_url": {"url": url}}
    raise InvalidInputError(f"{where}: content part type {kind!r} is not supported; this server takes "
                            "input_text, input_image and output_text", param=f"{where}.type")


def _add_tool_call(messages: list[dict], item: dict, where: str) -> None:
    call = {"id": _string(item, "call_id", where), "type": "function",
            "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
    _assistant(messages).setdefault("tool_calls", []).append(call)


def _output_text(output: Any, where: str) -> str:
    """A function_call_output's output: a string, or text parts."""
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(isinstance(p, dict) and p.get("type") == "input_text" for p in output):
        return "".join(p.get("text", "") for p in output)
    raise InvalidInputError(f"{where} must be a string or a list of input_text parts", param=where)


def chat_tools(f: Fields) -> Fields:
    """The request's tools and tool_choice in the chat API's shape (tools.parse_tools checks them there)."""
    tools = f.body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise InvalidInputError('tools must be a list of {"type": "function", "name": ..., "parameters": {...}}',
                                param="tools")
    converted = []
    for i, tool in enumerate(tools or []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise InvalidInputError(f"tools[{i}]: tool type {kind!r} is not supported; this server runs function "
                                    "tools only (the client runs them)", param=f"tools[{i}].type")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        converted.append({"type": "function", "function": fn})
    choice = f.body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InvalidInputError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                                    '"name": ...}', param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return Fields({"tools": converted or None, "tool_choice": choice,
                   "parallel_tool_calls": f.body.get("parallel_tool_calls")})


def text_format(f: Fields) -> tuple[dict, StructuredOutputsParams | None]:
    """text.format (echoed back in the response) and the constraint it asks for."""
    text = f.obj("text") or {}
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return fmt, None
    if kind == "json_object":
        return fmt, StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict) or not isinstance(fmt.get("name"), str):
            raise InvalidInputError('text.format json_schema needs a name and a schema object', param="text.format")
        return fmt, StructuredOutputsParams(json=schema)
    raise InvalidInputError('text.format must be {"type": "text"}, {"type": "json_object"} or {"type": '
                            '"json_schema", "name": ..., "schema": {...}}', param="text.format")
