"""The engine's OpenAI-compatible API through the real `openai` SDK and raw HTTP, against a real engine process.

One server per module (tiny random Qwen3-VL, an API key set), small max_tokens: the whole module runs in
seconds after the server is up. The model is random, so tests check shapes, counts and invariants (same seed
-> same text, stream == non-stream under greedy), never particular words.
"""
from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import socket
from pathlib import Path

import openai
import pytest

from engine_helpers import noise_image
from engine_server import http, start_engine_server, stats, wait_blocks_free

API_KEY = "sk-test-0123456789"
SERVED = "tiny-vl"


@pytest.fixture(scope="module")
def server(qwen3_vl_dir, tmp_path_factory):
    srv = start_engine_server(qwen3_vl_dir, tmp_path_factory.mktemp("engine-openai"), api_key=API_KEY,
                              served_name=SERVED)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def png_data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# ---- models, chat, completions ---------------------------------------------------------------------------------
def test_models_lists_the_served_name(client):
    models = client.models.list().data
    assert [m.id for m in models] == [SERVED]
    assert models[0].max_model_len == 2048
    assert client.models.retrieve(SERVED).id == SERVED


def test_chat_non_streaming(client):
    reply = client.chat.completions.create(model=SERVED, messages=user("Hello!"), max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion" and reply.model == SERVED
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 5
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 5


def test_chat_stream_matches_non_stream_and_reports_usage(client):
    kwargs = dict(model=SERVED, messages=user("Tell me about Paris."), max_tokens=8, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 8
    assert last.usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_with_an_image_data_url(client):
    text_only = client.chat.completions.create(model=SERVED, messages=user("Describe the image."), max_tokens=3)
    content = [{"type": "image_url", "image_url": {"url": png_data_url(noise_image(64, 64, seed=1))}},
               {"type": "text", "text": "Describe the image."}]
    reply = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": content}],
                                           max_tokens=3)
    assert reply.usage.completion_tokens >= 1
    # The image became its own placeholder tokens: (64/16)^2 patches / 2x2 merge = 4, plus vision start/end.
    assert reply.usage.prompt_tokens >= text_only.usage.prompt_tokens + 4


def test_completions_with_text_and_token_ids(client):
    reply = client.completions.create(model=SERVED, prompt="The capital of France is", max_tokens=4,
                                      extra_body={"ignore_eos": True})
    assert reply.id.startswith("cmpl-") and reply.object == "text_completion"
    assert reply.usage.completion_tokens == 4 and reply.choices[0].finish_reason == "length"
    ids = [10, 20, 30, 40, 50]
    reply = client.completions.create(model=SERVED, prompt=ids, max_tokens=3, extra_body={"ignore_eos": True})
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 3


def test_completions_stream_with_usage(client):
    chunks = list(client.completions.create(model=SERVED, prompt="Once upon a time", max_tokens=6, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-2].choices[0].finish_reason == "length"


def test_finish_reason_stop_on_a_stop_string(client):
    base = dict(model=SERVED, messages=user("Count: 1 2 3"), max_tokens=16, temperature=0,
                extra_body={"ignore_eos": True})
    text = client.chat.completions.create(**base).choices[0].message.content
    assert len(text) >= 4, f"the random model produced too little text to cut: {text!r}"
    stop = text[len(text) // 2:len(text) // 2 + 2]
    reply = client.chat.completions.create(**base, stop=[stop])
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == text[:text.index(stop)]


def test_same_seed_same_text(client):
    def sample(seed: int) -> str:
        return client.chat.completions.create(model=SERVED, messages=user("Say something."), max_tokens=12,
                                              temperature=1.0, seed=seed,
                                              extra_body={"ignore_eos": True}).choices[0].message.content
    assert sample(1234) == sample(1234)


def test_logprobs_shapes(client):
    reply = client.chat.completions.create(model=SERVED, messages=user("Hi"), max_tokens=3, logprobs=True,
                                           top_logprobs=2, extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    assert len(content) == 3
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    comp = client.completions.create(model=SERVED, prompt="Hi", max_tokens=3, logprobs=2,
                                     extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3


# ---- auth ------------------------------------------------------------------------------------------------------
def test_api_key_is_required(server):
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=SERVED, messages=user("hi"), max_tokens=1)
    missing = http("GET", server.url + "/v1/models")
    assert missing.status == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    assert http("GET", server.url + "/stats").status == 200     # the seeds' `curl .../stats` needs no key


# ---- raw SSE, concurrency, KV blocks ---------------------------------------------------------------------------
def test_raw_sse_lines(server):
    body = {"model": SERVED, "messages": user("Hello"), "max_tokens": 4, "stream": True,
            "ignore_eos": True}
    reply = http("POST", server.url + "/v1/chat/completions", body, server.auth)
    assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/event-stream")
    events = [e for e in reply.text.split("\n\n") if e]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_concurrent_streams_interleave(server):
    async def run() -> tuple[list[int], list[int]]:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        order: list[int] = []

        async def one(i: int) -> int:
            stream = await aclient.chat.completions.create(
                model=SERVED, messages=user(f"Stream number {i}"), max_tokens=6 + i, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            used = None
            async for chunk in stream:
                order.append(i)
                if chunk.usage is not None:
                    used = chunk.usage.completion_tokens
            return used

        counts = await asyncio.gather(*(one(i) for i in range(8)))
        await aclient.close()
        return counts, order

    counts, order = asyncio.run(run())
    assert counts == [6 + i for i in range(8)]
    switches = sum(1 for a, b in zip(order, order[1:]) if a != b)
    assert switches > 8 * 2, f"streams did not interleave: {order}"
    wait_blocks_free(server, timeout=2.0)


def test_client_disconnect_frees_blocks(server):
    body = json.dumps({"model": SERVED, "messages": user("Go on forever."), "max_tokens": 1800,
                       "ignore_eos": True, "stream": True}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    try:
        sock.sendall(head + body)
        received = b""
        while received.count(b"data: ") < 2:
            received += sock.recv(4096)
        assert received.startswith(b"HTTP/1.1 200")
        running = stats(server)
        assert running["num_running"] == 1 and running["num_used_gpu_blocks"] > 0
    finally:
        sock.close()
    wait_blocks_free(server, timeout=2.0)
    # Freed by the abort, not by the request running to its end (1800 tokens take far longer than that).
    assert "Aborted request" in server.log_text()


def test_blocks_all_free_after_requests(server):
    _, s = wait_blocks_free(server, timeout=2.0)
    assert s["num_used_gpu_blocks"] == 0 and s["num_total_gpu_blocks"] == 256


# ---- stats, metrics, health, version ---------------------------------------------------------------------------
def test_stats_health_version(server):
    s = stats(server)
    for key in ("num_total_gpu_blocks", "num_free_gpu_blocks", "num_used_gpu_blocks", "block_size",
                "num_running", "num_waiting", "num_swapped", "prefix_cache_hit_rate", "num_preemptions",
                "version", "demo_model"):
        assert key in s, key
    assert s["block_size"] == 16 and s["demo_model"] is False
    health = http("GET", server.url + "/health")
    assert health.status == 200 and health.text == "ok"
    assert http("GET", server.url + "/version").json()["version"] == s["version"]


def test_every_stats_field_is_documented_in_the_api_doc(server):
    doc = (Path(__file__).resolve().parents[1] / "docs" / "API.md").read_text()
    doc = doc.split("\n## /stats\n", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(\w+)` \|", doc, flags=re.M))
    assert set(stats(server)) == documented


def test_metrics_names(server):
    reply = http("GET", server.url + "/metrics")
    assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/plain")
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:e2e_request_latency_seconds_count"):
        assert f"\n{name}{{" in reply.text, name
    finished = [line for line in reply.text.splitlines()
                if line.startswith("vllm:e2e_request_latency_seconds_count")]
    assert float(finished[0].rsplit(" ", 1)[1]) > 0


def test_log_has_startup_and_access_lines(server, client):
    client.chat.completions.create(model=SERVED, messages=user("Hi"), max_tokens=1)
    log = server.log_text()
    for line in ("Using PagedAttention for KV cache.", "Available routes are:", "Started server process",
                 f"Serving on {server.url}", '"POST /v1/chat/completions HTTP/1.1" 200'):
        assert line in log, line
    assert "Traceback" not in log
