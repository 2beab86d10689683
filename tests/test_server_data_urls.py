"""Large image data URLs are lifted out of a request body before JSON parsing (engine/server/data_urls.py): the
parsed body means exactly what the JSON says, with DataURL objects where chat messages take image URLs."""
from __future__ import annotations

import base64
import json

import pytest

from engine.inputs.image_io import DataURL, decode_data_url
from engine.server import data_urls
from engine.server.protocol import _loads

PAYLOAD = base64.b64encode(bytes(range(256)) * 400).decode()      # 136 KB of base64: over MIN_LIFT_CHARS
URL = "data:image/png;base64," + PAYLOAD


def parse(body: dict | bytes):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    small, lifted = data_urls.lift(raw)
    parsed = _loads(small)
    if lifted is not None:
        data_urls.restore(parsed, lifted)
    return parsed, small, lifted


def chat(image_url) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": image_url}, {"type": "text", "text": "What is it?"}]}]}


@pytest.mark.parametrize("image_url", [{"url": URL}, URL], ids=["object", "plain string"])
def test_a_chat_image_url_becomes_a_data_url_into_the_body(image_url):
    parsed, small, lifted = parse(chat(image_url))
    assert len(small) < 300 and lifted is not None
    part = parsed["messages"][0]["content"][0]["image_url"]
    url = part["url"] if isinstance(part, dict) else part
    assert isinstance(url, DataURL) and url.header == "data:image/png;base64"
    assert decode_data_url(url) == decode_data_url(URL) == base64.b64decode(PAYLOAD)
    assert parsed["messages"][0]["content"][1] == {"type": "text", "text": "What is it?"}


def test_a_data_url_anywhere_else_keeps_its_string():
    body = {**chat({"url": URL}), "metadata": {"url": URL}, "tools": [{"url": URL + "é"}]}
    parsed, _, lifted = parse(json.dumps(body, ensure_ascii=False).encode())
    assert len(lifted.urls) == 3
    assert parsed["metadata"] == {"url": URL} and parsed["tools"] == [{"url": URL + "é"}]
    assert isinstance(parsed["messages"][0]["content"][0]["image_url"]["url"], DataURL)


@pytest.mark.parametrize("raw", [
    json.dumps(chat({"url": URL[:1000]})).encode(),                       # small: not worth lifting
    json.dumps(chat({"url": URL})).replace("/", "\\/").encode(),          # escaped: the parser must resolve it
    json.dumps({"model": "m", "messages": [{"role": "user", "content": URL}]}).encode(),   # not after "url"
], ids=["small", "escaped slashes", "text content"])
def test_what_is_not_lifted_parses_as_before(raw):
    parsed, small, lifted = parse(raw)
    assert lifted is None and small is raw and parsed == json.loads(raw)


def test_a_placeholder_sent_by_the_client_is_just_text():
    raw = json.dumps({**chat({"url": URL}), "user": "\x00lifted-0000000000000000-0"}).encode()
    parsed, _, _ = parse(raw)
    assert parsed["user"] == "\x00lifted-0000000000000000-0"


def test_parse_gives_the_whole_bodys_own_error():
    raw = json.dumps(chat({"url": URL})).encode()[:-2]
    with pytest.raises(json.JSONDecodeError) as whole:
        _loads(raw)
    with pytest.raises(json.JSONDecodeError) as lifted:
        data_urls.parse(raw, _loads)
    assert str(lifted.value) == str(whole.value)


def test_a_body_broken_after_the_url_still_fails_to_parse():
    raw = json.dumps(chat({"url": URL})).encode()[:-2]
    small, lifted = data_urls.lift(raw)
    assert lifted is not None
    with pytest.raises(json.JSONDecodeError):
        _loads(small)
    with pytest.raises(json.JSONDecodeError):
        _loads(raw)
