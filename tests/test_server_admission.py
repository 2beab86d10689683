"""Admission is fair: a priority below 0 is the API key's privilege (the proxy's key admits, it does not
privilege), anonymous requests never pass the queue limit, every 503 carries Retry-After, and a request waiting
for a slot learns its place in the queue (`: queued N ahead`, an SSE comment OpenAI clients skip).

The engine runs as the launcher starts it (a proxy key in its environment) plus the user's --api-key, with two
running slots and a queue of eight, so that the limits are reached with a few requests.
"""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from engine_server import http, start_engine_server, wait_blocks_free

pytestmark = pytest.mark.slow
API_KEY, PROXY_KEY = "sk-user", "proxy-run-key"
MAX_NUM_SEQS, MAX_WAITING = 2, 8
CHAT = "/v1/chat/completions"
ANONYMOUS = {"Authorization": f"Bearer {PROXY_KEY}"}       # what the proxy sends for every browser
PRIVILEGED = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(qwen3_vl_dir, tmp_path_factory):
    srv = start_engine_server(qwen3_vl_dir, tmp_path_factory.mktemp("engine-admission"), "--max-num-seqs",
                              str(MAX_NUM_SEQS), "--max-waiting-requests", str(MAX_WAITING),
                              "--allow-anonymous-priority", "--disable-uvicorn-access-log", "--disable-log-requests",
                              api_key=API_KEY, env={"LOCALCHAT_PROXY_KEY": PROXY_KEY})
    yield srv
    srv.stop()


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2, **fields}


def long_stream(priority: int = 0) -> dict:
    return chat(max_tokens=1900, ignore_eos=True, stream=True, priority=priority)


def test_the_engine_port_answers_only_keys(server):
    """Started with a proxy key (as the launcher starts it): every route but /health needs a key."""
    for path in ("/v1/models", "/stats", "/metrics", "/version"):
        reply = http("GET", server.url + path)
        assert reply.status == 401 and "--expose-engine" in reply.json()["error"]["message"], (path, reply.text)
        assert http("GET", server.url + path, headers=ANONYMOUS).status == 200
        assert http("GET", server.url + path, headers=PRIVILEGED).status == 200
    assert http("GET", server.url + "/health").status == 200


def test_anonymous_urgent_requests_never_pass_the_queue_limit(server):
    """4,300 anonymous requests at priority -1 against a queue of 8: the queue stays at its limit, every other
    answer is 503 with Retry-After; a request with the API key at priority -1 still gets in."""
    async def run() -> tuple[list[tuple[int, str | None]], int, int]:
        held: list[aiohttp.ClientResponse] = []
        answers: list[tuple[int, str | None]] = []
        peak = 0
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
            async def one() -> None:
                resp = await session.post(server.url + CHAT, json=long_stream(priority=-1), headers=ANONYMOUS)
                answers.append((resp.status, resp.headers.get("Retry-After")))
                if resp.status == 200:
                    held.append(resp)          # admitted: keep its stream open, so that it keeps its place
                else:
                    await resp.read()
                    resp.release()

            async def watch() -> None:
                nonlocal peak
                while True:
                    peak = max(peak, (await (await session.get(server.url + "/stats", headers=ANONYMOUS)).json())
                               ["num_pending"])
                    await asyncio.sleep(0.05)
            watcher = asyncio.create_task(watch())
            try:
                for _ in range(43):
                    await asyncio.gather(*(one() for _ in range(100)))
                at_end = stats_with(server)["num_pending"]
                watcher.cancel()               # the privileged request below may pass the limit
                urgent = await session.post(server.url + CHAT, json=chat(priority=-1, stream=True), headers=PRIVILEGED)
                urgent_status = urgent.status
                urgent.close()
            finally:
                watcher.cancel()
                for resp in held:
                    resp.close()
        return answers, max(peak, at_end), urgent_status
    start = time.monotonic()
    answers, peak, urgent = asyncio.run(run())
    print(f"4300 requests in {time.monotonic() - start:.1f}s; queue peak {peak}")
    assert len(answers) == 4300
    admitted = [a for a in answers if a[0] == 200]
    refused = [a for a in answers if a[0] != 200]
    assert len(admitted) == MAX_NUM_SEQS + MAX_WAITING, len(admitted)
    assert {status for status, _ in refused} == {503}
    assert all(retry is not None and int(retry) >= 1 for _, retry in refused)
    assert peak <= MAX_WAITING
    assert urgent == 200
    wait_blocks_free(server, timeout=30)


def stats_with(server) -> dict:
    reply = http("GET", server.url + "/stats", headers=ANONYMOUS)
    assert reply.status == 200, reply.text
    return reply.json()


def test_a_waiting_stream_learns_its_place_in_the_queue(server):
    """With both slots taken, a third stream's first bytes are `: queued 0 ahead`, a fourth's `: queued 1 ahead`;
    the comment is all it gets until a slot frees."""
    async def run() -> list[bytes]:
        async with aiohttp.ClientSession() as session:
            running = [await session.post(server.url + CHAT, json=long_stream(), headers=ANONYMOUS)
                       for _ in range(MAX_NUM_SEQS)]
            deadline = time.monotonic() + 30
            while stats_with(server)["num_running"] < MAX_NUM_SEQS:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            waiting = [await session.post(server.url + CHAT, json=long_stream(), headers=ANONYMOUS)
                       for _ in range(2)]
            try:
                return [await asyncio.wait_for(resp.content.readuntil(b"\n\n"), timeout=5) for resp in waiting]
            finally:
                for resp in running + waiting:
                    resp.close()
    firsts = asyncio.run(run())
    assert firsts == [b": queued 0 ahead\n\n", b": queued 1 ahead\n\n"], firsts
    wait_blocks_free(server, timeout=30)
