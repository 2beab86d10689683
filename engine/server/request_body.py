"""Checks on a request body that come before any field is read: the Content-Type says JSON, the chat's shape
(messages, parts per message, images, videos) is within the server's limits, and the parsed JSON is neither nested past
MAX_JSON_DEPTH nor holds a lone UTF-16 surrogate or a NUL or other control character where a name, a URL or a
path goes (`check_json_tree`).

The nesting and Unicode checks would otherwise fail deep inside (a RecursionError in a recursive walk, a
TypeError in the tokenizer, an encoding error while writing an error message that quotes the value, a
ValueError from the file system) and come back as a 500. Here they are a 400 naming the field, found by one
iterative walk over the parsed body. The shape is checked first: a body of 100,000 tiny messages is refused
after one pass over its list, before anything renders, tokenizes or decodes it.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from engine.errors import EngineError, InvalidInputError, PayloadTooLargeError
from engine.server.origin_policy import json_declared

# The deepest real bodies: a tool's JSON-schema parameters (tools[0].function.parameters.properties.x.items...).
MAX_JSON_DEPTH = 64


@dataclass(frozen=True)
class BodyLimits:
    """What one chat request may hold (the server's flags), checked on the parsed body before any other work."""
    max_messages: int = 4096             # --max-chat-messages
    max_parts: int = 512                 # --max-content-parts, per message
    max_images: int | None = None        # the model's --limit-mm-per-prompt; None: not checked here
    max_videos: int | None = None        # the same for videos


# Content part types that carry an image or a video: the chat API's, and the Responses API's input_image.
_IMAGE_PARTS = ("image_url", "image", "input_image")
_VIDEO_PARTS = ("video_url", "video")


def check_chat_shape(body: dict[str, Any], limits: BodyLimits, field: str = "messages") -> None:
    """413 for more messages or parts than the limits, 400 for more images or videos than the model takes:
    counted on the parsed body's `field` (the chat's messages, the Responses API's input items), in one pass,
    before anything reads their text, images or videos."""
    messages = body.get(field)
    if not isinstance(messages, list):
        return                           # the route says what is wrong with it
    if len(messages) > limits.max_messages:
        raise PayloadTooLargeError(f"{len(messages)} messages in one request, over the limit of "
                                   f"{limits.max_messages} (--max-chat-messages); send a shorter history",
                                   param=field, code="too_many_messages")
    images = videos = 0
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        if len(content) > limits.max_parts:
            raise PayloadTooLargeError(f"{field}[{i}].content has {len(content)} parts, over the limit of "
                                       f"{limits.max_parts} (--max-content-parts)", param=f"{field}[{i}].content",
                                       code="too_many_parts")
        kinds = [part.get("type") for part in content if isinstance(part, dict)]
        images += sum(1 for kind in kinds if kind in _IMAGE_PARTS)
        videos += sum(1 for kind in kinds if kind in _VIDEO_PARTS)
    for count, limit, media in ((images, limits.max_images, "images"), (videos, limits.max_videos, "videos")):
        if limit is not None and count > limit:
            raise InvalidInputError(f"{count} {media} in one prompt, over the limit of {limit} "
                                    f"(--limit-mm-per-prompt)", param=field, code=f"too_many_{media}")


class UnsupportedMediaTypeError(EngineError):
    status = 415
    err_type = "invalid_request_error"


def check_json_content_type(request: web.Request) -> None:
    """A body must be declared as JSON: application/json or an application/...+json type, with any parameters
    (charset). A missing or other Content-Type is refused, so a browser's cross-site "simple" request (text/plain,
    form data, or a typeless Blob, none of which needs a CORS preflight) never reaches a handler. The proxy
    applies the same rule (origin_policy.json_declared) with the same answer; docs/API.md states it."""
    declared = request.headers.get("Content-Type")
    if json_declared(declared):
        return
    shown = repr(declared[:60]) if declared else "missing"
    raise UnsupportedMediaTypeError(f"Content-Type must be application/json, not {shown} (curl: -H "
                                    f"'Content-Type: application/json')", code="unsupported_media_type")


def check_json_tree(body: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise InvalidInputError (naming the field) for nesting deeper than max_depth or a string (value or key)
    that is not valid Unicode text (a lone surrogate: JSON can escape one, UTF-8 cannot encode it)."""
    stack: list[tuple[Any, int, tuple]] = [(body, 0, ())]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, str):
            _check_text(node, path)
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth >= max_depth:      # named by its top-level field: the full path would be max_depth long
            field = field_path(path[:1])
            raise InvalidInputError(f"{field or 'the body'} is nested more than {max_depth} levels deep",
                                    param=field or None, code="json_too_deep")
        if isinstance(node, dict):
            for key, value in node.items():
                _check_text(key, path + (key,))
                stack.append((value, depth + 1, path + (key,)))
        else:
            stack.extend((value, depth + 1, path + (i,)) for i, value in enumerate(node))


def _check_text(text: Any, path: tuple) -> None:
    if not isinstance(text, str):
        return
    if "\x00" in text:               # no text, name, URL or path holds one; file systems and C libraries stop at it
        where = field_path(path) or "the body"
        raise InvalidInputError(f"{where} holds a NUL character (\\u0000) at character {text.index(chr(0))}; "
                                f"remove it", param=field_path(path) or None, code="invalid_character")
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        where = field_path(path) or "the body"
        raise InvalidInputError(f"{where} holds a lone UTF-16 surrogate (\\u{ord(text[e.start]):04x}) at "
                                f"character {e.start}; send valid Unicode text", param=field_path(path) or None,
                                code="invalid_unicode") from None


def field_path(path: tuple) -> str:
    """("messages", 0, "content") -> "messages[0].content", the way OpenAI names fields in errors."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            safe = part.encode("utf-8", "backslashreplace").decode("utf-8")[:60]
            out += f".{safe}" if out else safe
    return out


BODY_TIMEOUT = web.AppKey("body_timeout_s", float)


class RequestTimeoutError(EngineError):
    status = 408
    err_type = "invalid_request_error"


async def read_body(request: web.Request) -> bytes:
    """The whole body, which must arrive within the app's BODY_TIMEOUT: a client that stops half-way (or sends
    a byte a second) is answered 408, and the server closes the connection after its short lingering time, instead
    of holding it open forever."""
    timeout = request.config_dict.get(BODY_TIMEOUT)
    try:
        async with asyncio.timeout(timeout):
            return await request.read()
    except TimeoutError:
        raise RequestTimeoutError(f"the request body did not arrive within {timeout:g}s "
                                  f"(--request-body-timeout)", code="request_timeout") from None
