"""The proxy in front of the real engine: page and assets, unbuffered SSE, abort on disconnect, 413, 503, API key."""
from __future__ import annotations

import base64
import http.client as httpclient
import io
import json
import time
from urllib.parse import urlparse

import pytest
from PIL import Image

from servers import (SERVED_NAME, engine, engine_stats, free_port, http, long_generation_tokens,  # noqa: F401
                     proxy, start_engine, start_proxy, wait_idle)

pytestmark = pytest.mark.slow

STATS_FIELDS = ("num_total_gpu_blocks", "num_free_gpu_blocks", "num_used_gpu_blocks", "num_cached_blocks",
                "num_total_cpu_blocks", "num_free_cpu_blocks", "block_size", "num_running", "num_waiting",
                "num_swapped", "prefix_cache_hit_rate", "num_preemptions", "num_swaps", "model", "demo_model",
                "multimodal")


def chat_body(text="Hello", **extra):
    return {"model": SERVED_NAME, "messages": [{"role": "user", "content": text}], **extra}


def open_stream(base_url: str, body: dict) -> tuple[httpclient.HTTPConnection, httpclient.HTTPResponse]:
    """A streaming POST read line by line with http.client, which hands over each line as it arrives."""
    url = urlparse(base_url)
    conn = httpclient.HTTPConnection(url.hostname, url.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def next_event(resp: httpclient.HTTPResponse) -> str | None:
    """The next `data:` payload of an SSE stream, or None at its end."""
    while True:
        line = resp.readline()
        if not line:
            return None
        if line.startswith(b"data:"):
            return line[5:].strip().decode()


def raw_get(base_url: str, path: str) -> int:
    """GET with the path sent exactly as written (urllib would normalise ../ away)."""
    url = urlparse(base_url)
    conn = httpclient.HTTPConnection(url.hostname, url.port, timeout=10)
    conn.request("GET", path)
    status = conn.getresponse().status
    conn.close()
    return status


def test_serves_page_and_assets(proxy):
    for path in ("/", "/chat.html"):
        status, page = http("GET", proxy.url + path)
        assert status == 200 and 'id="messages"' in page and "/static/chat.js" in page
    for asset in ("chat.js", "chat.css", "markdown.js", "sse.js", "status.js", "attachments.js"):
        status, _ = http("GET", f"{proxy.url}/static/{asset}")
        assert status == 200, asset
    assert http("GET", proxy.url + "/static/nope.js")[0] == 404
    for sneaky in ("/static/../pyproject.toml", "/static/%2e%2e/pyproject.toml", "/static/..%2fpyproject.toml",
                   "/static/%2e%2e/%2e%2e/etc/passwd"):
        assert raw_get(proxy.url, sneaky) == 404, sneaky


def test_models_stats_and_health_forwarded(proxy, engine):
    status, models = http("GET", proxy.url + "/v1/models")
    assert status == 200 and models["data"][0]["id"] == SERVED_NAME
    status, stats = http("GET", proxy.url + "/stats")
    assert status == 200
    missing = [f for f in STATS_FIELDS if f not in stats]
    assert not missing, f"/stats lacks {missing}"
    assert stats["multimodal"] is True and stats["demo_model"] is False
    status, health = http("GET", proxy.url + "/api/health")
    assert status == 200 and health["engine"] == "ready"


def test_engine_errors_pass_through(proxy):
    status, body = http("POST", proxy.url + "/v1/chat/completions", {"model": SERVED_NAME, "messages": "nope"})
    assert 400 <= status < 500
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]


def test_stream_is_unbuffered(proxy, engine):
    """The first token reaches the client while the engine is still generating the rest."""
    n = long_generation_tokens(engine, seconds=20)
    conn, resp = open_stream(proxy.url, chat_body(stream=True, max_tokens=n, ignore_eos=True))
    try:
        assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
        first = next_event(resp)
        assert first and json.loads(first)["choices"][0]["delta"] is not None
        assert engine_stats(engine)["num_running"] == 1, "the proxy held the stream back until the end"
    finally:
        resp.close()
        conn.close()
    wait_idle(engine, timeout=10)


def test_stream_complete_through_proxy(proxy):
    # Greedy: sampled from the random tiny model, the first token is an end-of-turn token about once in 200 runs,
    # and the reply is then rightly empty.
    conn, resp = open_stream(proxy.url, chat_body(stream=True, max_tokens=16, temperature=0,
                                                  stream_options={"include_usage": True}))
    events = []
    while (event := next_event(resp)) is not None:
        events.append(event)
    conn.close()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    assert text
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage and 0 < usage[-1]["completion_tokens"] <= 16


def test_openai_sdk_through_proxy(proxy):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="not-needed")
    stream = client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_client_disconnect_aborts_generation(proxy, engine):
    n = long_generation_tokens(engine, seconds=30)
    conn, resp = open_stream(proxy.url, chat_body(stream=True, max_tokens=n, ignore_eos=True))
    assert next_event(resp)
    assert engine_stats(engine)["num_running"] == 1
    resp.close()  # the browser tab goes away: the socket is closed mid-stream
    conn.close()
    waited = wait_idle(engine, timeout=5)
    assert waited < 5
    time.sleep(0.2)
    assert "client disconnected" in proxy.log_text()


def test_image_request_through_proxy(proxy):
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    body = {"model": SERVED_NAME, "max_tokens": 6, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What color?"}]}]}
    status, reply = http("POST", proxy.url + "/v1/chat/completions", body)
    assert status == 200, reply
    assert isinstance(reply["choices"][0]["message"]["content"], str)


def test_oversize_body_gets_413(engine, tmp_path):
    small = start_proxy(engine.url, tmp_path, max_upload_mb=1)
    try:
        big = chat_body("x" * (2 << 20))
        status, body = http("POST", small.url + "/v1/chat/completions", body=big)
        assert status == 413
        assert body["error"]["code"] == "payload_too_large" and "limit" in body["error"]["message"]
        status, _ = http("POST", small.url + "/v1/chat/completions", chat_body(max_tokens=2))
        assert status == 200  # a normal request on the same proxy still works
    finally:
        small.stop()


def test_engine_down_gives_503(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    lone = start_proxy(dead, tmp_path)
    try:
        assert http("GET", lone.url + "/")[0] == 200  # the page still loads, and can say what is wrong
        for method, path, body in (("POST", "/v1/chat/completions", chat_body()), ("GET", "/stats", None),
                                   ("GET", "/v1/models", None), ("GET", "/api/health", None)):
            status, reply = http(method, lone.url + path, body)
            assert status == 503, path
            assert "not reachable" in reply["error"]["message"] and reply["error"]["type"], path
        assert http("GET", lone.url + "/api/health")[1]["engine"] == "unreachable"
    finally:
        lone.stop()


def test_api_key_added_by_proxy(qwen3_vl_dir, tmp_path):
    key = "sk-test-key-123"
    guarded = start_engine(qwen3_vl_dir, tmp_path, api_key=key)
    with_key = start_proxy(guarded.url, tmp_path, api_key=key)
    without_key = start_proxy(guarded.url, tmp_path)
    try:
        assert http("GET", guarded.url + "/v1/models")[0] == 401
        # The page sends no key (and a client's wrong key is replaced): the proxy's key is what the engine sees.
        assert http("GET", with_key.url + "/v1/models")[0] == 200
        assert http("GET", with_key.url + "/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 200
        status, reply = http("POST", with_key.url + "/v1/chat/completions", chat_body(max_tokens=2))
        assert status == 200, reply
        # Without a key of its own the proxy forwards the client's header, and the engine's 401 comes back.
        status, reply = http("GET", without_key.url + "/v1/models")
        assert status == 401 and reply["error"]["message"]
        assert http("GET", without_key.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})[0] == 200
    finally:
        for server in (with_key, without_key, guarded):
            server.stop()


def test_stopping_the_proxy_ends_open_requests_with_a_word(engine, tmp_path):
    """SIGTERM to the proxy alone: an open stream gets an error event and [DONE] (not a cut connection), a plain
    request still waiting for its answer gets a 503, and the engine aborts both generations."""
    import signal
    from concurrent.futures import ThreadPoolExecutor

    other = start_proxy(engine.url, tmp_path)
    n = long_generation_tokens(engine, seconds=30)
    try:
        conn, resp = open_stream(other.url, chat_body(stream=True, max_tokens=n, ignore_eos=True))
        assert resp.status == 200 and next_event(resp)
        with ThreadPoolExecutor(1) as pool:
            plain = pool.submit(http, "POST", other.url + "/v1/chat/completions",
                                chat_body(max_tokens=n, ignore_eos=True), None, 60)
            deadline = time.monotonic() + 30
            while engine_stats(engine)["num_running"] < 2:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            other.proc.send_signal(signal.SIGTERM)
            events = []
            while (event := next_event(resp)) is not None:
                events.append(event)
            status, body = plain.result(timeout=30)
        conn.close()
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["code"] == "server_shutdown" and "shutting down" in error["message"]
        assert all("error" in json.loads(e) or json.loads(e)["choices"] for e in events[:-2])   # whole events
        assert status == 503 and body["error"]["code"] == "server_shutdown"
        assert other.proc.wait(10) == 0
    finally:
        other.stop()
    wait_idle(engine, timeout=5)


def test_a_browser_that_stops_reading_loses_its_request(engine, tmp_path):
    """A client that stops reading a stream fills the socket buffers; one write then waits past the proxy's
    --write-timeout, and the proxy drops the stream and its upstream request, which frees the engine (the
    engine's own --stream-write-timeout, a minute by default, would come much later)."""
    import socket

    other = start_proxy(engine.url, tmp_path, extra_args=("--write-timeout", "1"))
    port = int(other.url.rsplit(":", 1)[1])
    # Top logprobs make each event kilobytes long, so the buffers fill within seconds.
    body = json.dumps(chat_body(stream=True, max_tokens=3000, ignore_eos=True, logprobs=True,
                                top_logprobs=20)).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    aborted_before = engine.log_text().count("Aborted request")
    try:
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert sock.recv(1024).startswith(b"HTTP/1.1 200")      # and then nothing more is read
        deadline = time.monotonic() + 60
        while engine_stats(engine)["num_running"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        start = time.monotonic()
        while engine_stats(engine)["num_running"] > 0:
            assert time.monotonic() - start < 30, "the stalled stream still holds the engine"
            time.sleep(0.1)
        print(f"freed {time.monotonic() - start:.1f}s after the stream started")
        assert "client stopped reading" in other.log_text()
        assert engine.log_text().count("Aborted request") == aborted_before + 1     # aborted, not finished
    finally:
        sock.close()
        other.stop()
    wait_idle(engine, timeout=5)
