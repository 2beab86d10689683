"""Large image data URLs lifted out of a request body before its JSON is parsed.

A chat request with a 1024x1024 PNG is 2-4 MB, nearly all of it one base64 string. Parsing it builds that string
(orjson: 1.0 ms for a photo, 2.9 ms for a noise image here, twice that on the H200's host, on the event loop),
and base64 then decodes from the str. Lifted, the string stays in the body's bytes: the parser sees a short
placeholder, the image's DataURL points into the body (memoryview), and base64 decodes from there (2x faster).

What is lifted: a JSON string that starts with `data:`, directly follows a `"url":` (or `"image_url":`) key, holds
no backslash (so no JSON escape needs resolving) and is at least MIN_LIFT_CHARS long. The placeholder is a string
carrying a per-request random nonce. After parsing, placeholders at messages[i].content[j].image_url.url (or a
plain-string image_url) become DataURL objects; one anywhere else gets its original string back, so what the JSON
means never changes. Bodies that do not parse once lifted are parsed whole, for the parser's own error message
(`parse`).
"""
from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from engine.inputs.image_io import DataURL

MIN_LIFT_CHARS = 64 * 1024      # smaller strings cost the parser next to nothing
MAX_HEADER_CHARS = 256          # "data:image/png;base64" and its parameters
_WHITESPACE = b" \t\r\n"


class Lifted:
    """The placeholders of one body: placeholder text -> (DataURL, the original string's byte span)."""

    def __init__(self, raw: bytes):
        self.raw = raw
        self.nonce = secrets.token_hex(8)
        self.urls: dict[str, tuple[DataURL, int, int]] = {}

    def placeholder(self, url: DataURL, start: int, end: int) -> bytes:
        text = f"\x00lifted-{self.nonce}-{len(self.urls)}"
        self.urls[text] = (url, start, end)
        return b'"\\u0000' + text[1:].encode() + b'"'

    def original(self, text: str) -> str:
        _, start, end = self.urls[text]
        return self.raw[start:end].decode("utf-8")     # no backslash inside: the bytes are the string


def parse(raw: bytes, loads: Callable[[bytes], Any]) -> Any:
    """loads(raw), its large data URLs lifted out first. A body that does not parse once lifted is parsed
    whole, so the error is the parser's own about the body as sent."""
    small, lifted = lift(raw)
    if lifted is None:
        return loads(raw)
    try:
        body = loads(small)
    except ValueError:              # JSONDecodeError, UnicodeDecodeError
        return loads(raw)
    restore(body, lifted)
    return body


def lift(raw: bytes) -> tuple[bytes, Lifted | None]:
    """(the body with its large data URLs replaced by placeholders, what was lifted), or (raw, None)."""
    if len(raw) < MIN_LIFT_CHARS:
        return raw, None
    lifted = Lifted(raw)
    parts, done = [], 0
    start = raw.find(b'"data:')
    while start >= 0:
        end = raw.find(b'"', start + 1)            # no backslash inside (checked below): this closes it
        if end < 0:
            break
        url = _lift_one(raw, start + 1, end)
        if url is not None:
            parts += [raw[done:start], lifted.placeholder(url, start + 1, end)]
            done = end + 1
        start = raw.find(b'"data:', end + 1)
    if not lifted.urls:
        return raw, None
    parts.append(raw[done:])
    return b"".join(parts), lifted


def _lift_one(raw: bytes, start: int, end: int) -> DataURL | None:
    """The string raw[start:end] as a DataURL, if it is one worth lifting."""
    comma = raw.find(b",", start, min(end, start + MAX_HEADER_CHARS))
    if end - start < MIN_LIFT_CHARS or comma < 0 or raw.find(b"\\", start, end) >= 0:
        return None
    if not _follows_url_key(raw, start - 1):
        return None
    try:
        header = raw[start:comma].decode("ascii")
    except UnicodeDecodeError:
        return None
    return DataURL(header=header, payload=memoryview(raw)[comma + 1:end])


def _follows_url_key(raw: bytes, quote: int) -> bool:
    """Whether the string opening at raw[quote] is preceded by `"url"` or `"image_url"` and a colon (whitespace
    allowed)."""
    i = quote
    while i > 0 and raw[i - 1] in _WHITESPACE:
        i -= 1
    if i == 0 or raw[i - 1] != ord(":"):
        return False
    i -= 1
    while i > 0 and raw[i - 1] in _WHITESPACE:
        i -= 1
    return raw[max(0, i - 5):i] == b'"url"' or raw[max(0, i - 11):i] == b'"image_url"'


def restore(body: Any, lifted: Lifted) -> None:
    """Put the lifted URLs into the parsed body: DataURL objects where chat messages take image URLs, the
    original strings anywhere else."""
    placed = 0
    messages = body.get("messages") if isinstance(body, dict) else None
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            if not isinstance(part, dict):
                continue
            image_url = part.get("image_url")
            if isinstance(image_url, dict) and image_url.get("url") in lifted.urls:
                image_url["url"] = lifted.urls[image_url["url"]][0]
                placed += 1
            elif isinstance(image_url, str) and image_url in lifted.urls:
                part["image_url"] = lifted.urls[image_url][0]
                placed += 1
    if placed < len(lifted.urls):
        _put_back(body, lifted)


def _put_back(node: Any, lifted: Lifted) -> Any:
    """node with every placeholder string replaced by the original string (in place for dicts and lists)."""
    if isinstance(node, str):
        return lifted.original(node) if node in lifted.urls else node
    if isinstance(node, dict):
        for key, value in node.items():
            node[key] = _put_back(value, lifted)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            node[i] = _put_back(value, lifted)
    return node
