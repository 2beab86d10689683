"""OpenAI-style chat messages, checked and split into what the chat template sees and the images and videos
they carry.

The template only needs to know that an image or a video sits at a given place (it writes one
<|vision_start|><|image_pad|><|vision_end|> there, or the same with <|video_pad|>), so image parts reach it as a
bare {"type": "image"} and video parts as {"type": "video"}; the media themselves (a URL to decode, or a PIL
image given offline) are returned beside, each kind in prompt order. Video parts take vLLM's shape:
{"type": "video_url", "video_url": {"url": ...}}.
Errors name the offending field the way OpenAI does: messages[1].content[0].image_url.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from engine.errors import InvalidInputError

ROLES = ("system", "developer", "user", "assistant", "tool")
IMAGE_ROLES = ("user", "tool")  # the roles whose images chat templates render (Qwen3-VL: user and tool)


@dataclass
class ImageRef:
    """An image found in the messages: a URL (data:, http(s), file) or an already decoded PIL image."""
    param: str                          # where it was, for error messages: messages[1].content[0].image_url
    url: str | None = None
    image: Image.Image | None = None


@dataclass
class VideoRef:
    """A video found in the messages: a URL (data:video/..., http(s), file), or data:video/jpeg;base64 with
    the frames of a video, each base64, joined by commas (vLLM's shape for frames sampled by the client)."""
    param: str                          # messages[1].content[0].video_url
    url: str


@dataclass
class ParsedChat:
    messages: list[dict[str, Any]]      # what the template renders: content as a string or normalized parts
    images: list[ImageRef]              # in the order their placeholders appear
    videos: list[VideoRef] = field(default_factory=list)


def parse_chat_messages(messages: Any, content_format: str = "openai") -> ParsedChat:
    """Check `messages` and normalize them for the template. With a "string" template (one that cannot loop over
    content parts, like SmolLM2's) text parts are joined with newlines, as vLLM does."""
    if not isinstance(messages, list) or not messages:
        raise InvalidInputError("messages must be a non-empty list of {role, content} objects", param="messages")
    out: list[dict[str, Any]] = []
    images: list[ImageRef] = []
    videos: list[VideoRef] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise InvalidInputError(f"{where} must be an object with role and content", param=where)
        role = message.get("role")
        if role not in ROLES:
            raise InvalidInputError(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}",
                                    param=f"{where}.role")
        content = message.get("content")
        if content is None:
            # OpenAI lets an assistant message (one with tool_calls, as SDKs send it back) leave content out or
            # null; vLLM renders it as no parts, or "" for a template that takes content as one string.
            if role != "assistant":
                raise InvalidInputError(f"{where}.content is required (only an assistant message may leave it "
                                        f"out)", param=f"{where}.content")
            content = "" if content_format == "string" else []
        elif isinstance(content, list):
            parts = [_parse_part(part, role, f"{where}.content[{j}]", images, videos)
                     for j, part in enumerate(content)]
            if content_format == "string":
                if any(p["type"] != "text" for p in parts):
                    raise InvalidInputError(f"{where}.content: this model's chat template cannot place images or "
                                            f"videos",
                                            param=f"{where}.content")
                content = "\n".join(p["text"] for p in parts)
            else:
                content = parts
        elif not isinstance(content, str):
            raise InvalidInputError(f"{where}.content must be a string or a list of content parts",
                                    param=f"{where}.content")
        parsed = {**message, "content": content}
        if role == "developer":      # OpenAI's newer name for the system turn; chat templates know "system"
            parsed["role"] = "system"
        if message.get("tool_calls") is not None:
            parsed["tool_calls"] = _parse_tool_calls(message["tool_calls"], where)
        out.append(parsed)
    return ParsedChat(out, images, videos)


def _parse_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant turn's tool calls. Their arguments arrive as a JSON string (OpenAI's shape) and reach the
    template as an object, as vLLM passes them: templates write `arguments | tojson`."""
    if not isinstance(calls, list):
        raise InvalidInputError(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise InvalidInputError(f"{at} must be {{id, type: function, function: {{name, arguments}}}}",
                                    param=at)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise InvalidInputError(f"{at}.function.arguments is not valid JSON: {e}",
                                        param=f"{at}.function.arguments") from None
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def _parse_part(part: Any, role: str, where: str, images: list[ImageRef], videos: list[VideoRef]) -> dict[str, Any]:
    if not isinstance(part, Mapping):
        raise InvalidInputError(f"{where} must be an object with a type", param=where)
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidInputError(f"{where}.text must be a string", param=f"{where}.text")
        return {"type": "text", "text": text}
    if kind not in ("image_url", "image", "video_url"):
        raise InvalidInputError(f"{where}.type {kind!r} is not supported; use 'text', 'image_url' or 'video_url'",
                                param=f"{where}.type")
    if role not in IMAGE_ROLES:
        raise InvalidInputError(f"{where}: images and videos are only accepted in {' and '.join(IMAGE_ROLES)} "
                                f"messages, not {role}", param=where)
    if kind == "video_url":
        value = part.get("video_url")
        url = value.get("url") if isinstance(value, Mapping) else None
        if not isinstance(url, str) or not url:
            raise InvalidInputError(f"{where}.video_url must be {{\"url\": \"data:video/mp4;base64,...\"}}",
                                    param=f"{where}.video_url")
        videos.append(VideoRef(param=f"{where}.video_url", url=url))
        return {"type": "video"}
    if kind == "image_url":
        value = part.get("image_url")
        url = value.get("url") if isinstance(value, Mapping) else None    # OpenAI's shape only: {"url": ...}
        if not isinstance(url, str) or not url:
            raise InvalidInputError(f"{where}.image_url must be {{\"url\": \"data:image/...;base64,...\"}}",
                                    param=f"{where}.image_url")
        images.append(ImageRef(param=f"{where}.image_url", url=url))
    else:
        image = part.get("image")
        if not isinstance(image, Image.Image):
            raise InvalidInputError(f"{where}.image must be a PIL image (offline use); over HTTP send image_url",
                                    param=f"{where}.image")
        images.append(ImageRef(param=f"{where}.image", image=image))
    return {"type": "image"}
