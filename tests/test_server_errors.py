"""Bad requests against a real engine process: each gets the right status and an OpenAI-shaped error whose message
says what to fix, never a 500 or a hang; afterwards the engine still serves normally.

The server runs with an API key, a 1 MB body limit, at most 2 images per prompt, a 1 Mpx image limit, 1.5 Mpx of
images and 0.5 MB of prompt text per request, 100 messages of at most 8 parts, and file:// images from the tests'
folder, so every limit can be hit with small requests.
"""
from __future__ import annotations

import base64
import http.client as http_client
import io
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import pytest
from PIL import Image

from engine_helpers import noise_image
from engine_server import http, start_engine_server, wait_blocks_free
from servers import start_proxy

API_KEY = "sk-errors-test"
SERVED = "tiny-vl"
CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
MAX_MODEL_LEN = 2048
MAX_MESSAGES, MAX_PARTS = 100, 8
MEDIA_DIR = Path(__file__).resolve().parent
# A bad request is answered at once; TEST_FAST_S loosens it on a machine busy with other work.
FAST_S = float(os.environ.get("TEST_FAST_S", "0.1"))


@pytest.fixture(scope="module")
def server(qwen3_vl_dir, tmp_path_factory):
    srv = start_engine_server(qwen3_vl_dir, tmp_path_factory.mktemp("engine-errors"), "--max-request-body-mb", "1",
                              "--limit-mm-per-prompt", '{"image": 2}', "--max-image-pixels", "1000000",
                              "--max-pixels-per-request", "1500000", "--max-prompt-text-mb", "0.5",
                              "--max-chat-messages", str(MAX_MESSAGES), "--max-content-parts", str(MAX_PARTS),
                              "--allowed-local-media-path", str(MEDIA_DIR), api_key=API_KEY, served_name=SERVED)
    # A good image and bytes that are no image first: the first decode starts what later ones reuse, and the first
    # unknown format makes Pillow import all its plugins (once per process); the table times each request.
    http("POST", srv.url + CHAT, image_chat(SMALL_IMAGE), srv.auth, timeout=60)
    http("POST", srv.url + CHAT, image_chat("data:image/png;base64," + base64.b64encode(b"warm-up").decode()),
         srv.auth, timeout=60)
    yield srv
    srv.stop()


def data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_chat(*urls: str) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": SERVED, "max_tokens": 2,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "What is this?"}]}]}


def chat(**fields) -> dict:
    return {"model": SERVED, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2, **fields}


def completion(**fields) -> dict:
    return {"model": SERVED, "prompt": "Hello", "max_tokens": 2, **fields}


SMALL_IMAGE = data_url(noise_image(32, 32, seed=3))
IMAGE_PARAM = "messages[0].content[0].image_url"


@dataclass
class Case:
    name: str
    path: str
    body: dict | bytes | None
    status: int
    param: str | None = None
    says: str = ""                       # a piece of the message that tells the client what to fix
    method: str = "POST"
    headers: dict | None = field(default=None)   # None: the right API key


CASES = [
    # the body itself
    Case("malformed JSON", CHAT, b'{"model": "tiny-vl", ', 400, None, "not valid JSON"),
    Case("empty body", CHAT, b"", 400, None, "empty"),
    Case("body is a JSON array", CHAT, b"[1, 2]", 400, None, "JSON object"),
    Case("NaN is not JSON", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400,
         None, "NaN"),
    Case("body over --max-request-body-mb", CHAT, b'{"pad": "' + b"x" * (1_200_000) + b'"}', 413, None,
         "--max-request-body-mb"),
    # messages
    Case("messages missing", CHAT, {"model": SERVED}, 400, "messages", "non-empty list"),
    Case("messages not a list", CHAT, chat(messages="hello"), 400, "messages", "non-empty list"),
    Case("messages empty", CHAT, chat(messages=[]), 400, "messages", "non-empty list"),
    Case("unknown role", CHAT, chat(messages=[{"role": "robot", "content": "hi"}]), 400, "messages[0].role",
         "must be one of"),
    Case("content a number", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content",
         "string or a list"),
    Case("prompt over max_model_len (chat)", CHAT, chat(messages=[{"role": "user", "content": "a " * 3000}]),
         400, "messages", f"maximum context length is {MAX_MODEL_LEN}"),
    # images
    Case("image URL with an unknown scheme", CHAT, image_chat("ftp://example.com/a.png"), 400, IMAGE_PARAM,
         "data:image"),
    Case("http image URL refused", CHAT, image_chat("http://example.com/a.png"), 400, IMAGE_PARAM,
         "--allow-remote-media"),
    Case("data URL that is not an image", CHAT, image_chat("data:text/plain;base64,aGVsbG8="), 400, IMAGE_PARAM,
         "image/png"),
    Case("broken base64", CHAT, image_chat("data:image/png;base64,!!not*base64!!"), 400, IMAGE_PARAM,
         "not valid base64"),
    Case("bytes that are not an image", CHAT,
         image_chat("data:image/png;base64," + base64.b64encode(b"hello, not a png").decode()), 400, IMAGE_PARAM,
         "could not decode image"),
    Case("image over the pixel limit", CHAT, image_chat(data_url(Image.new("RGB", (1100, 1000), "red"))), 400,
         IMAGE_PARAM, "over the limit of 1000000"),
    Case("too many images", CHAT, image_chat(SMALL_IMAGE, SMALL_IMAGE, SMALL_IMAGE), 400, "messages",
         "over the limit of 2"),
    Case("a NUL in a file:// image path", CHAT, image_chat(f"file://{MEDIA_DIR}/ok.png%00.txt"), 400, IMAGE_PARAM,
         "control character"),
    Case("a control character in an image URL", CHAT, image_chat(f"file://{MEDIA_DIR}/a\x01.png"), 400, IMAGE_PARAM,
         "control character"),
    Case("a NUL in the model name", CHAT, b'{"model":"tiny\\u0000","messages":[{"role":"user","content":"hi"}]}',
         400, "model", "NUL"),
    Case("a NUL in a message", CHAT, b'{"messages":[{"role":"user","content":"a\\u0000b"}]}', 400,
         "messages[0].content", "NUL"),
    Case("more messages than --max-chat-messages", CHAT,
         chat(messages=[{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)), 413, "messages",
         "--max-chat-messages"),
    Case("more parts than --max-content-parts", CHAT,
         chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}] * (MAX_PARTS + 1)}]), 413,
         "messages[0].content", "--max-content-parts"),
    Case("more images than the model takes, counted before any decode", CHAT,
         image_chat(*["data:image/png;base64,AAAA"] * 3), 400, "messages", "over the limit of 2"),
    Case("more videos than the model takes, counted before any decode", CHAT,
         chat(messages=[{"role": "user", "content": [{"type": "video_url", "video_url": {
             "url": "data:video/mp4;base64,AAAA"}}] * 3}]), 400, "messages", "over the limit of 2"),
    Case("a control character in a video URL", CHAT,
         chat(messages=[{"role": "user", "content": [{"type": "video_url", "video_url": {
             "url": f"file://{MEDIA_DIR}/a\x01.mp4"}}]}]), 400, "messages[0].content[0].video_url",
         "control character"),
    Case("more parts than --max-content-parts (responses)", RESPONSES,
         {"model": SERVED, "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}] *
                                      (MAX_PARTS + 1)}]}, 413, "input[0].content", "--max-content-parts"),
    Case("more images than the model takes (responses), counted before any decode", RESPONSES,
         {"model": SERVED, "input": [{"role": "user", "content": [
             {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}] * 3}]}, 400, "input",
         "over the limit of 2"),
    Case("images past --max-pixels-per-request", CHAT, image_chat(data_url(Image.new("RGB", (1000, 1000), "red")),
                                                                   data_url(Image.new("RGB", (1000, 1000), "blue"))),
         413, "messages", "--max-pixels-per-request"),
    Case("prompt text past --max-prompt-text-mb (chat)", CHAT,
         chat(messages=[{"role": "user", "content": "a" * 600_000}]), 413, "messages", "--max-prompt-text-mb"),
    Case("prompt text past --max-prompt-text-mb (completion)", COMPLETIONS, completion(prompt="a" * 600_000), 413,
         "prompt", "--max-prompt-text-mb"),
    # model and sampling parameters
    Case("unknown model", CHAT, chat(model="gpt-4o"), 404, "model", "GET /v1/models"),
    Case("max_tokens 0", CHAT, chat(max_tokens=0), 400, "max_tokens", "at least 1"),
    Case("max_tokens -1", CHAT, chat(max_tokens=-1), 400, "max_tokens", "at least 1"),
    Case("max_tokens a string", CHAT, chat(max_tokens="abc"), 400, "max_tokens", "must be an integer"),
    Case("max_completion_tokens 0", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens",
         "at least 1"),
    Case("max_tokens over the room left", CHAT, chat(max_tokens=MAX_MODEL_LEN), 400, "max_tokens", "at most"),
    Case("temperature -1", CHAT, chat(temperature=-1), 400, "temperature", "[0, 100]"),
    Case("temperature 101", CHAT, chat(temperature=101), 400, "temperature", "[0, 100]"),
    Case("top_p 0", CHAT, chat(top_p=0), 400, "top_p", "(0, 1]"),
    Case("top_p 1.5", CHAT, chat(top_p=1.5), 400, "top_p", "(0, 1]"),
    Case("top_k -5", CHAT, chat(top_k=-5), 400, "top_k", "top_k"),
    Case("presence_penalty 3", CHAT, chat(presence_penalty=3), 400, "presence_penalty", "[-2, 2]"),
    Case("n 0", CHAT, chat(n=0), 400, "n", "n must be in [1, 16]"),
    Case("best_of below n", CHAT, chat(n=3, best_of=2), 400, "best_of", "best_of must be in [n, 16]"),
    Case("auto tool choice without --enable-auto-tool-choice", CHAT,
         chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tool_choice",
         "--enable-auto-tool-choice"),
    Case("stop a number", CHAT, chat(stop=5), 400, "stop", "string or a list of strings"),
    Case("stop_token_ids outside the vocabulary", CHAT, chat(stop_token_ids=[10_000_000]), 400, "stop_token_ids",
         "vocabulary"),
    Case("seed beyond 64 bits", CHAT, chat(seed=2 ** 70), 400, "seed", "64-bit"),
    Case("top_logprobs over 20", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", "[0, 20]"),
    Case("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs", "logprobs: true"),
    Case("priority not an integer", CHAT, chat(priority="high"), 400, "priority", "must be an integer"),
    Case("stream not a boolean", CHAT, chat(stream="yes"), 400, "stream", "true or false"),
    Case("stream_options without stream", CHAT, chat(stream_options={"include_usage": True}), 400,
         "stream_options", "stream is true"),
    Case("chat_template_kwargs not an object", CHAT, chat(chat_template_kwargs=[1]), 400, "chat_template_kwargs",
         "an object"),
    Case("a streaming request fails before the stream starts", CHAT, chat(stream=True, max_tokens=0), 400,
         "max_tokens", "at least 1"),
    # completions
    Case("prompt missing", COMPLETIONS, {"model": SERVED}, 400, "prompt", "required"),
    Case("a bad prompt in a list", COMPLETIONS, completion(prompt=["a", 5]), 400, "prompt", "prompt[1] must be"),
    Case("token id outside the vocabulary", COMPLETIONS, completion(prompt=[1, 99_999_999]), 400, "prompt",
         "out of the vocabulary"),
    Case("prompt over max_model_len (token ids)", COMPLETIONS, completion(prompt=[5] * (MAX_MODEL_LEN + 10)), 400,
         "prompt", f"maximum context length is {MAX_MODEL_LEN}"),
    Case("logprobs over 20", COMPLETIONS, completion(logprobs=21), 400, "logprobs", "[0, 20]"),
    Case("echo not a boolean", COMPLETIONS, completion(echo="yes"), 400, "echo", "true or false"),
    # auth and routing
    Case("missing API key", CHAT, chat(), 401, None, "Authorization: Bearer", headers={}),
    Case("wrong API key", CHAT, chat(), 401, None, "incorrect API key",
         headers={"Authorization": "Bearer sk-wrong"}),
    Case("not a Bearer header", "/v1/models", None, 401, None, "Bearer", method="GET",
         headers={"Authorization": API_KEY}),
    Case("GET on a POST route", CHAT, None, 405, None, "use POST", method="GET"),
    Case("unknown route", "/v1/embeddings", {"input": "x"}, 404, None, "no route"),
    Case("unknown model in /v1/models/{id}", "/v1/models/nope", None, 404, "model", "does not exist",
         method="GET"),
    # malformed beyond the JSON grammar: nesting, invalid Unicode, the declared type
    Case("body nested 100000 deep", CHAT, b"[" * 100_000 + b"]" * 100_000, 400, None, "nested too deeply"),
    Case("object nested 5000 deep", CHAT, b'{"a":' * 5000 + b"1" + b"}" * 5000, 400, None, "nested too deeply"),
    Case("max_tokens nested 900 deep", CHAT, b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":'
         + b"[" * 900 + b"]" * 900 + b"}", 400, "max_tokens", "nested more than 64 levels"),
    Case("chat_template_kwargs nested 200 deep", CHAT, b'{"messages":[{"role":"user","content":"hi"}],'
         b'"chat_template_kwargs":{"a":' + b'{"a":' * 199 + b"1" + b"}" * 200 + b"}", 400,
         "chat_template_kwargs", "nested more than 64 levels"),
    Case("escaped lone surrogate in content", CHAT,
         b'{"model":"tiny-vl","messages":[{"role":"user","content":"x\\ud800y"}],"max_tokens":2}', 400,
         "messages[0].content", "lone UTF-16 surrogate"),
    Case("raw surrogate bytes in content", CHAT,
         b'{"model":"tiny-vl","messages":[{"role":"user","content":"x\xed\xa0\x80y"}],"max_tokens":2}', 400,
         "messages[0].content", "lone UTF-16 surrogate"),
    Case("lone surrogate in the model name", CHAT,
         b'{"model":"tiny\\udfff","messages":[{"role":"user","content":"hi"}],"max_tokens":2}', 400, "model",
         "lone UTF-16 surrogate"),
    Case("lone surrogate in a text part", CHAT, b'{"messages":[{"role":"user","content":[{"type":"text",'
         b'"text":"\\udc00"}]}],"max_tokens":2}', 400, "messages[0].content[0].text", "lone UTF-16 surrogate"),
    Case("lone surrogate in a key", CHAT, b'{"messages":[{"role":"user","content":"hi"}],"\\ud800":1}', 400,
         "\\ud800", "lone UTF-16 surrogate"),
    Case("lone surrogate in a completion prompt", COMPLETIONS, b'{"prompt":"\\ud83d","max_tokens":2}', 400,
         "prompt", "lone UTF-16 surrogate"),
    Case("lone surrogate in stop", CHAT, b'{"messages":[{"role":"user","content":"hi"}],"stop":["\\udbff"]}',
         400, "stop[0]", "lone UTF-16 surrogate"),
    Case("text/plain body (a cross-site form post)", CHAT, b'{"messages":[{"role":"user","content":"hi"}]}',
         415, None, "application/json", headers={"Authorization": f"Bearer {API_KEY}",
                                                 "Content-Type": "text/plain"}),
    Case("form-encoded body", COMPLETIONS, b"prompt=hi", 415, None, "application/json",
         headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/x-www-form-urlencoded"}),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_request(server, case: Case):
    headers = server.auth if case.headers is None else case.headers
    start = time.perf_counter()
    reply = http(case.method, server.url + case.path, case.body, headers, timeout=30)
    elapsed = time.perf_counter() - start
    assert reply.status == case.status, reply.text
    assert reply.headers["Content-Type"].startswith("application/json"), reply.headers
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    assert error["param"] == case.param, error
    assert case.says in error["message"], error["message"]
    assert elapsed < FAST_S, f"{elapsed * 1000:.0f} ms"


@pytest.fixture(scope="module")
def proxy(server, tmp_path_factory):
    """The chat proxy in front of the same engine, holding its API key (so the table's auth cases do not apply)."""
    srv = start_proxy(server.url, tmp_path_factory.mktemp("proxy-errors"), api_key=API_KEY)
    yield srv
    srv.stop()


PROXY_CASES = [c for c in CASES if c.status != 401]      # the proxy sends its own key


@pytest.mark.parametrize("case", PROXY_CASES, ids=[c.name for c in PROXY_CASES])
def test_bad_request_through_the_proxy(proxy, case: Case):
    """The same table through the proxy: the same status, shape and advice (the proxy's own 404/405/415 name the
    route and the content type as the engine does)."""
    headers = {k: v for k, v in (case.headers or {}).items() if k != "Authorization"}
    start = time.perf_counter()
    reply = http(case.method, proxy.url + case.path, case.body, headers, timeout=30)
    elapsed = time.perf_counter() - start
    assert reply.status == case.status, reply.text
    assert reply.headers["Content-Type"].startswith("application/json"), reply.headers
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == case.param, error
    assert case.says in error["message"], error["message"]
    assert elapsed < 2 * FAST_S, f"{elapsed * 1000:.0f} ms"


def raw_post(base_url: str, path: str, body: bytes, headers: dict) -> tuple[int, dict]:
    """A POST with exactly these headers (urllib would add a form Content-Type to a body sent without one)."""
    url = urlparse(base_url)
    conn = http_client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request("POST", path, body, headers)
    resp = conn.getresponse()
    status, text = resp.status, resp.read()
    conn.close()
    return status, json.loads(text)


def test_engine_and_proxy_apply_one_content_type_rule(server, proxy):
    """A JSON body must be declared as JSON (application/json, or application/...+json, with any parameters): a
    missing Content-Type gets the same 415 from both servers (a typeless browser Blob needs no CORS preflight)."""
    body = json.dumps(chat()).encode()
    refusals = [raw_post(base, CHAT, body, headers) for base, headers in ((server.url, server.auth), (proxy.url, {}))]
    assert refusals[0] == refusals[1], refusals
    status, reply = refusals[0]
    assert status == 415 and reply["error"]["code"] == "unsupported_media_type"
    assert reply["error"]["message"].startswith("Content-Type must be application/json, not missing")
    for ctype in ("application/json; charset=utf-8", "Application/JSON", "application/vnd.api+json"):
        for base, headers in ((server.url, server.auth), (proxy.url, {})):
            status, reply = raw_post(base, CHAT, body, {**headers, "Content-Type": ctype})
            assert status == 200, (base, ctype, reply)


def test_table_is_large_enough():
    assert len(CASES) >= 60


def test_engine_still_serves_after_the_bad_requests(server, proxy):
    # Runs after the table (pytest keeps file order): nothing broke, nothing leaked, nothing answered 500.
    assert http("GET", server.url + "/health").text == "ok"
    reply = http("POST", server.url + CHAT, chat(max_tokens=3, ignore_eos=True), server.auth)
    assert reply.status == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 3
    wait_blocks_free(server, timeout=2.0)
    log = server.log_text()
    assert '" 500 ' not in log and "Traceback" not in log and "unhandled error" not in log
