"""The engine server under careless and hostile clients: slow or half-sent requests are cut off within the
configured timeouts, a full queue answers 503 with Retry-After at once, a reader that stops reading loses its
request, the model card names no file path, and a stop ends open streams with an error event and [DONE].

The server runs with small timeouts and queue limits (flags), so every limit is hit within a second or two.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import signal
import socket
import time

import aiohttp
import psutil
import pytest

from engine.server.sse import SSEWriter, StalledClientError
from engine_server import http, start_engine_server, stats, wait_blocks_free

KEEP_ALIVE_S = 5.0       # the default; a busy server must not close a burst of clients whose headers it has not read yet
BODY_TIMEOUT_S = 2.0
MAX_WAITING = 256
# What 1000 requests at once may add to the engine's memory: each in flight holds a connection, its parsed body
# and, for the 256 queued and 16 running, a request's state (kilobytes each on the tiny model).
RSS_GROWTH_BOUND = 200 * 2**20
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(qwen3_vl_dir, tmp_path_factory):
    srv = start_engine_server(qwen3_vl_dir, tmp_path_factory.mktemp("engine-robust"),
                              "--timeout-keep-alive", str(KEEP_ALIVE_S), "--request-body-timeout",
                              str(BODY_TIMEOUT_S), "--max-waiting-requests", str(MAX_WAITING),
                              "--max-num-seqs", "16", "--disable-uvicorn-access-log", "--disable-log-requests")
    yield srv
    srv.stop()


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2, **fields}


def connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock


def seconds_until_closed(sock: socket.socket, limit: float = 10.0) -> tuple[float, bytes]:
    """(seconds until the server closes the connection, what it sent before)."""
    start, got = time.monotonic(), b""
    sock.settimeout(limit)
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return time.monotonic() - start, got
        got += chunk


def test_slow_headers_and_idle_connections_are_cut_off(server):
    slow, idle = connect(server), connect(server)
    slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")   # and then nothing more
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        waits = list(pool.map(seconds_until_closed, (slow, idle)))
    assert all(elapsed < KEEP_ALIVE_S + 2 for elapsed, _ in waits), waits
    assert http("GET", server.url + "/health").status == 200


def test_a_half_sent_body_gets_408(server):
    sock = connect(server)
    body = json.dumps(chat()).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body[: len(body) // 2])
    elapsed, got = seconds_until_closed(sock)
    assert got.startswith(b"HTTP/1.1 408"), got[:200]
    assert b"--request-body-timeout" in got
    assert elapsed < BODY_TIMEOUT_S + 3


def test_a_slowloris_body_gets_408(server):
    sock = connect(server)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100000\r\n\r\n")
    start, got = time.monotonic(), b""
    sock.settimeout(0.2)
    while time.monotonic() - start < BODY_TIMEOUT_S + 3:
        try:
            sock.sendall(b" ")                       # a byte at a time, forever
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
        except socket.timeout:
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
    assert got.startswith(b"HTTP/1.1 408"), got[:200]
    assert time.monotonic() - start < BODY_TIMEOUT_S + 3


def test_model_card_names_no_path(server, qwen3_vl_dir):
    reply = http("GET", server.url + "/v1/models")
    assert str(qwen3_vl_dir) not in reply.text and "/" not in reply.json()["data"][0]["root"]


async def post_raw(port: int, body: dict) -> tuple[int, dict[str, str]]:
    """One POST written in a single send (headers and body together: a client whose body lags its headers would
    meet --request-body-timeout, which this module sets to seconds), then the whole answer read."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    head = await reader.readuntil(b"\r\n\r\n")
    await reader.read()
    writer.close()
    status_line, *lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines if ": " in line)
    return int(status_line.split()[1]), headers


def test_a_full_queue_answers_503_with_retry_after(server):
    """1000 requests at once against a queue of 256: each is answered 200 or 503 + Retry-After, none hangs, and
    the server's memory stays bounded (refused requests hold nothing)."""
    engine = psutil.Process(server.proc.pid)
    baseline = engine.memory_info().rss
    peak = [baseline]

    async def sample_rss() -> None:
        while True:
            peak[0] = max(peak[0], engine.memory_info().rss)
            await asyncio.sleep(0.05)

    async def run() -> list[tuple[int, dict[str, str]]]:
        sampler = asyncio.create_task(sample_rss())
        try:
            return await asyncio.wait_for(asyncio.gather(
                *(post_raw(server.port, chat(max_tokens=4, seed=i)) for i in range(1000))), timeout=240)
        finally:
            sampler.cancel()
    results = asyncio.run(run())
    print(f"engine RSS {baseline / 2**20:.0f} MB before, {peak[0] / 2**20:.0f} MB at the peak")
    assert peak[0] - baseline < RSS_GROWTH_BOUND, f"{(peak[0] - baseline) / 2**20:.0f} MB more"
    statuses = {status for status, _ in results}
    assert statuses <= {200, 503}, statuses
    refused = [headers for status, headers in results if status == 503]
    assert refused and len(refused) < 1000 - MAX_WAITING
    assert all(int(headers["Retry-After"]) >= 1 for headers in refused)
    s = stats(server)
    assert s["max_waiting_requests"] == MAX_WAITING and s["num_refused_queue_full"] >= len(refused)
    assert s["num_pending"] == 0
    wait_blocks_free(server, timeout=5)


def test_a_priority_below_zero_needs_the_api_key(server):
    """Without the API key (and without --allow-anonymous-priority) an urgent priority is refused, not queued."""
    status, body = asyncio.run(post_json(server.port, chat(priority=-1)))
    assert status == 403 and body["error"]["code"] == "priority_not_allowed", body
    assert "--api-key" in body["error"]["message"] and body["error"]["param"] == "priority"


async def post_json(port: int, body: dict, headers: str = "") -> tuple[int, dict]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + headers.encode() + b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    head = await reader.readuntil(b"\r\n\r\n")
    payload = await reader.read()
    writer.close()
    return int(head.split()[1]), json.loads(payload)


class NeverDrains:
    """A response whose writes never complete: a client that stopped reading."""
    async def write(self, data):
        await asyncio.sleep(3600)


def never_drained_request() -> type:
    """A request class whose transport records that it was aborted."""
    class Transport:
        aborted = False

        def abort(self):
            self.aborted = True

    class Request:
        transport = Transport()
    return Request


def test_a_stalled_reader_loses_its_stream():
    """An SSE write that cannot complete within the write timeout ends the stream as a disconnect would."""
    Request = never_drained_request()
    async def run() -> float:
        writer = SSEWriter(NeverDrains(), Request(), write_timeout=0.2)
        start = time.monotonic()
        await writer.send({"x": 1})            # queued at once; the writer's task waits on the socket
        with pytest.raises(StalledClientError):
            await writer.flush()
        with pytest.raises(StalledClientError):
            await writer.send({"x": 2})
        return time.monotonic() - start
    assert asyncio.run(run()) < 1.0 and Request.transport.aborted


def test_a_reader_too_far_behind_loses_its_stream():
    """What waits for a reader is bounded in bytes: the chunk that would pass max_buffer cuts the client off."""
    Request = never_drained_request()
    async def run() -> int:
        writer = SSEWriter(NeverDrains(), Request(), write_timeout=60, max_buffer=10_000)
        sent = 0
        with pytest.raises(StalledClientError, match="10000 bytes behind"):
            while True:
                await writer.send({"text": "x" * 100})
                sent += 1
        writer.close()
        return sent
    event = len(b'data: {"text":"' + b"x" * 100 + b'"}\n\n')
    assert asyncio.run(run()) == 10_000 // event and Request.transport.aborted


def test_a_queued_stream_gets_its_headers_at_once(server):
    """With every running slot taken, a new stream still gets `200 OK` and its headers at once; tokens follow
    when a slot frees up."""
    async def run() -> float:
        busy = await asyncio.gather(*(_open_stream(server.port, max_tokens=1500) for _ in range(16)))
        try:
            deadline = time.monotonic() + 30
            while stats(server)["num_running"] < 16:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            start = time.monotonic()
            reader, writer = await _open_stream(server.port, max_tokens=2)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
            elapsed = time.monotonic() - start
            assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
            assert stats(server)["num_waiting"] >= 1        # it is still queued
            writer.close()
            return elapsed
        finally:
            for _, writer in busy:
                writer.close()
    assert asyncio.run(run()) < 1.0
    wait_blocks_free(server, timeout=10)


async def _open_stream(port: int, max_tokens: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(chat(max_tokens=max_tokens, ignore_eos=True, stream=True)).encode()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    await writer.drain()
    return reader, writer


def test_a_large_tokenize_does_not_stall_open_streams(server):
    """/tokenize runs the tokenizer on the engine's input pool, as a chat prompt's: a stream open meanwhile keeps
    getting its tokens. (On the event loop, the stream would wait the whole tokenization.)"""
    text = "The quick brown fox jumps over the lazy dog. " * (2_000_000 // 45)     # ~2 MB, seconds to tokenize

    async def run() -> tuple[float, float]:
        arrivals: list[float] = []
        done = asyncio.Event()

        async def stream_until_done(session: aiohttp.ClientSession) -> None:
            while not done.is_set():              # one stream after another, for as long as the tokenizing takes
                body = chat(max_tokens=1900, ignore_eos=True, stream=True)
                async with session.post(server.url + CHAT, json=body) as resp:
                    async for line in resp.content:
                        if line.startswith(b"data:"):
                            arrivals.append(time.monotonic())
                        if done.is_set():
                            break

        async with aiohttp.ClientSession() as session:
            streaming = asyncio.ensure_future(stream_until_done(session))
            while len(arrivals) < 5:
                await asyncio.sleep(0.01)
            start = time.monotonic()
            async with session.post(server.url + "/tokenize", json={"prompt": text}) as reply:
                assert reply.status == 200 and (await reply.json())["count"] > 100_000
            end = time.monotonic()
            done.set()
            await streaming
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > start and a < end]
        return max(gaps), end - start
    largest_gap, tokenize_s = asyncio.run(run())
    assert largest_gap < tokenize_s / 4, (largest_gap, tokenize_s)
    wait_blocks_free(server, timeout=10)


class PeakRSS:
    """The engine's largest resident memory while the `with` block runs, sampled every 20 ms on a thread."""

    def __init__(self, server):
        self.process = psutil.Process(server.proc.pid)

    def __enter__(self) -> "PeakRSS":
        self.baseline = self.peak = self.process.memory_info().rss
        self.running = True
        self.pool = concurrent.futures.ThreadPoolExecutor(1)
        self.pool.submit(self._sample)
        return self

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.02)

    def __exit__(self, *exc) -> None:
        self.running = False
        self.pool.shutdown()

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.baseline) / 2**20


def test_huge_message_lists_are_refused_at_once_and_streams_go_on(server):
    """Four bodies of 100,000 tiny messages (3.3 MB each) are refused after one look at their list, each in under
    a second, while a running stream keeps getting its tokens (no gap of 0.5 s): nothing parses, renders or
    tokenizes them on the event loop or anywhere else."""
    body = json.dumps(chat(messages=[{"role": "user", "content": "hi"}] * 100_000)).encode()
    assert len(body) > 3_000_000

    async def run() -> tuple[list[tuple[int, float]], list[float], float, float]:
        arrivals: list[float] = []
        done = asyncio.Event()
        async with aiohttp.ClientSession() as session:
            async def stream() -> None:
                async with session.post(server.url + CHAT, json=chat(max_tokens=1900, ignore_eos=True,
                                                                     stream=True)) as resp:
                    async for line in resp.content:
                        if line.startswith(b"data:"):
                            arrivals.append(time.monotonic())
                        if done.is_set():
                            break

            async def refused() -> tuple[int, float]:
                start = time.monotonic()
                async with session.post(server.url + CHAT, data=body,
                                        headers={"Content-Type": "application/json"}) as resp:
                    await resp.read()
                    return resp.status, time.monotonic() - start
            streaming = asyncio.ensure_future(stream())
            while len(arrivals) < 5:
                await asyncio.sleep(0.01)
            start = time.monotonic()
            answers = await asyncio.gather(*(refused() for _ in range(4)))
            end = time.monotonic()
            await asyncio.sleep(0.3)           # the stream's next token after the last refusal
            done.set()
            await streaming
        return answers, arrivals, start, end
    answers, arrivals, start, end = asyncio.run(run())
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > start and a < end + 0.3]
    before = [b - a for a, b in zip(arrivals, arrivals[1:]) if b <= start]
    print(f"refused in {[round(seconds, 3) for _, seconds in answers]} s; largest token gap {max(gaps):.3f} s "
          f"(before: {max(before):.3f} s)")
    assert all(status == 413 for status, _ in answers), answers
    assert max(seconds for _, seconds in answers) < 1.0, answers
    assert max(gaps) < 0.5, max(gaps)


def _png_data_url(width: int, height: int) -> str:
    import base64
    import io

    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_a_request_refused_for_its_images_decodes_none(server):
    """Eight 6000 x 6000 images (36 Mpx each, within --max-image-pixels) are 288 Mpx together, past
    --max-pixels-per-request: the 413 comes from their headers, and the engine's memory does not grow by the
    hundreds of MB that decoding even two of them takes."""
    url = _png_data_url(6000, 6000)
    parts = [{"type": "image_url", "image_url": {"url": url}} for _ in range(8)]
    body = chat(messages=[{"role": "user", "content": [*parts, {"type": "text", "text": "What are these?"}]}])
    with PeakRSS(server) as rss:
        reply = http("POST", server.url + CHAT, body)
    assert reply.status == 413 and "--max-pixels-per-request" in reply.json()["error"]["message"], reply.text
    assert rss.growth_mb < 50, f"{rss.growth_mb:.0f} MB"


def test_a_one_byte_a_second_reader_costs_little(server):
    """A stream with top_logprobs 20 read one byte a second: what waits for the reader is bounded in bytes
    (--max-stream-buffer-kb), not a backlog of outputs that each hold the whole answer so far."""
    data = json.dumps(chat(max_tokens=1900, ignore_eos=True, stream=True, logprobs=True, top_logprobs=20)).encode()
    with PeakRSS(server) as rss:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(data) + data)
        sock.settimeout(2)
        start = time.monotonic()
        try:
            while time.monotonic() - start < 20 and sock.recv(1):
                time.sleep(1.0)
        except (ConnectionResetError, TimeoutError):
            pass
        finally:
            sock.close()
    assert rss.growth_mb < 30, f"{rss.growth_mb:.0f} MB"
    wait_blocks_free(server, timeout=10)


def test_tokenize_meets_the_prompt_text_cap_of_a_chat(server):
    """A text over --max-prompt-text-mb is the same 413 from /tokenize as from a chat, before any tokenizing."""
    text = "x" * (8 * 2**20 + 1)
    tokenize = http("POST", server.url + "/tokenize", {"prompt": text})
    chat_reply = http("POST", server.url + CHAT, {"messages": [{"role": "user", "content": text}]})
    assert tokenize.status == chat_reply.status == 413, (tokenize.text, chat_reply.text)
    assert tokenize.json()["error"]["code"] == chat_reply.json()["error"]["code"] == "prompt_text_too_large"


def test_stop_ends_open_streams_with_an_error_event_and_done(server):
    """Runs last: SIGTERM while a long stream is open. Once the grace period is over, the stream gets an error
    event and [DONE] rather than a cut connection."""
    async def run() -> list[str]:
        async with aiohttp.ClientSession() as session:
            body = chat(max_tokens=1900, ignore_eos=True, stream=True)
            async with session.post(server.url + CHAT, json=body) as resp:
                assert resp.status == 200
                events = []
                async for line in resp.content:
                    if line.startswith(b"data:"):
                        events.append(line[5:].strip().decode())
                        if len(events) == 2:
                            server.proc.send_signal(signal.SIGTERM)
                return events
    events = asyncio.run(run())
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "server_shutdown" and "shutting down" in error["message"]
    assert server.proc.wait(20) == 0


@pytest.fixture(scope="module")
def long_server(qwen3_vl_dir, tmp_path_factory):
    """Room for max_tokens 10000 beside a prompt of a few hundred tokens."""
    srv = start_engine_server(qwen3_vl_dir, tmp_path_factory.mktemp("engine-aborts"), "--max-model-len", "12000",
                              "--num-gpu-blocks-override", "2048", "--disable-uvicorn-access-log",
                              "--disable-log-requests")
    yield srv
    srv.stop()


def test_a_burst_of_abandoned_long_requests_leaves_the_engine_idle_at_once(long_server):
    """200 clients ask for 10000 tokens each (half streamed) and disconnect 0.5 s later, some still on the input
    pool, some queued, some in their prefill: within 2 s nothing runs, waits or is pending, and the next short
    request is answered within 2 s."""
    prompt = [{"role": "user", "content": "Tell me a long story about a cat. " * 30}]

    async def client(i: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", long_server.port)
        body = json.dumps({"messages": prompt, "max_tokens": 10000, "ignore_eos": True, "stream": i % 2 == 0})
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body.encode())
        await writer.drain()
        await asyncio.sleep(0.5)
        writer.transport.abort()

    async def burst() -> None:
        await asyncio.gather(*(client(i) for i in range(200)))
    asyncio.run(burst())
    left = time.monotonic()
    while True:
        s = stats(long_server)
        if s["num_running"] == s["num_waiting"] == s["num_pending"] == 0:
            break
        assert time.monotonic() - left < 2.0, s
        time.sleep(0.05)
    start = time.monotonic()
    reply = http("POST", long_server.url + CHAT, chat(max_tokens=4), timeout=10)
    assert reply.status == 200, reply.text
    assert time.monotonic() - start < 2.0
