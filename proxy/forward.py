"""Forwarding to the engine: bodies capped in size, responses streamed through as they arrive.

Three properties matter more than anything else here:
- nothing is held back: every SSE event the engine writes (one per token, typically) is written to the browser
  as soon as its last byte is read, so tokens appear as they are generated; only whole events are passed on, so
  that an event the proxy adds (the engine was lost, the proxy is stopping) never lands inside another;
- when the browser disconnects, the upstream connection is closed at once (not returned to the pool), which is
  how the engine learns that nobody is listening and aborts the request, freeing its KV blocks;
- when the proxy stops (SIGTERM, Ctrl-C), every forward still open ends with a word: a stream gets an error
  event and [DONE], a request whose answer has not begun a 503 (end_open_forwards).
aiohttp cancels the handler task when the client goes away (the app runs with handler_cancellation=True); the
`finally` below then closes the upstream response. A stop cancels it too, with OpenForwards.stopping set.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import aiohttp
from aiohttp import web

from proxy.config import CONFIG, OPEN_FORWARDS
from proxy.engine_status import engine_down_response
from proxy.errors import error_body, error_response, payload_too_large

log = logging.getLogger("proxy")

# Request headers worth passing on; everything else (cookies, Host, browser noise) stays here.
_REQUEST_HEADERS = ("Content-Type", "Accept", "Authorization", "X-Request-Id", "OpenAI-Organization")
# Response headers that describe one hop only, or that aiohttp recomputes for the browser side. Content-Encoding
# stays: bodies pass through undecoded (auto_decompress=False).
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "upgrade",
                "proxy-authenticate", "trailer", "te", "server", "date"}


class BodyTooLarge(Exception):
    pass


async def read_body(request: web.Request, limit: int, timeout: float | None = None) -> bytes:
    """The whole request body, refusing (before reading, when Content-Length says so) anything over `limit`.
    A body that takes longer than `timeout` raises TimeoutError (a stalled or slowloris client)."""
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge
    buf = bytearray()
    async with asyncio.timeout(timeout):
        async for chunk in request.content.iter_chunked(1 << 16):
            buf += chunk
            if len(buf) > limit:  # chunked uploads carry no length: count as we go
                raise BodyTooLarge
    return bytes(buf)


class StalledClient(Exception):
    """The browser stopped reading: one write waited past the proxy's --write-timeout."""


async def _write(request: web.Request, response: web.StreamResponse, data: bytes, timeout: float) -> None:
    try:
        async with asyncio.timeout(timeout):
            await response.write(data)
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()
        raise StalledClient from None


def _upstream_headers(request: web.Request, api_key: str | None) -> dict[str, str]:
    headers = {name: request.headers[name] for name in _REQUEST_HEADERS if name in request.headers}
    # A compressed SSE stream would be held back in compressor buffers; ask the engine for plain bytes.
    headers["Accept-Encoding"] = "identity"
    if api_key:
        # The proxy's key wins: the page never holds one, and a stale header from a client must not leak through.
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def _stream_error_event(message: str, code: str = "engine_disconnected") -> bytes:
    body = error_body(message, "service_unavailable", code=code)
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


_ANSWER_BEGUN = "proxy.answer_begun"     # request key: the response's headers are on their way to the browser
SHUTDOWN_MESSAGE = "The chat server is shutting down; the answer was cut short. Send it again once it is back."


async def end_open_forwards(app: web.Application) -> None:
    """on_shutdown: end every forward still open (see the module's docstring), then give them a moment to write
    their last words before aiohttp closes the connections."""
    forwards = app[OPEN_FORWARDS]
    forwards.stopping = True
    tasks = [task for task in forwards.tasks if not task.done()]
    if not tasks:
        return
    log.info("proxy stopping: ending %d open request(s)", len(tasks))
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks, timeout=2.0)


async def forward(request: web.Request, upstream_path: str, session: aiohttp.ClientSession) -> web.StreamResponse:
    """Send the request to the engine at `upstream_path` (plus the query string) through `session`'s pool."""
    forwards = request.app[OPEN_FORWARDS]
    task = asyncio.current_task()
    forwards.tasks.add(task)
    try:
        return await _forward(request, upstream_path, session)
    except asyncio.CancelledError:
        if not forwards.stopping or request.get(_ANSWER_BEGUN):
            raise
        task.uncancel()                     # the stop asked for an answer, not for silence
        return error_response(503, SHUTDOWN_MESSAGE, "service_unavailable", code="server_shutdown")
    finally:
        forwards.tasks.discard(task)


async def _forward(request: web.Request, upstream_path: str, session: aiohttp.ClientSession) -> web.StreamResponse:
    cfg = request.app[CONFIG]
    try:
        body = await read_body(request, cfg.max_upload_bytes, cfg.body_timeout)
    except BodyTooLarge:
        log.warning("refused %s %s: body over %d bytes", request.method, request.path, cfg.max_upload_bytes)
        return payload_too_large(cfg.max_upload_bytes)
    except TimeoutError:
        log.warning("refused %s %s: body not received within %gs", request.method, request.path, cfg.body_timeout)
        return error_response(408, f"The request body did not arrive within {cfg.body_timeout:g}s.",
                              "invalid_request_error", code="request_timeout")

    path = upstream_path + (f"?{request.query_string}" if request.query_string else "")
    url = cfg.engine_url + path
    try:
        upstream = await session.request(request.method, url, data=body or None, allow_redirects=False,
                                         headers=_upstream_headers(request, cfg.api_key))
    except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
        log.warning("engine unreachable for %s %s: %s", request.method, path, exc.__class__.__name__)
        return engine_down_response(cfg)

    started = time.monotonic()
    finished = False
    response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
    for name, value in upstream.headers.items():
        if name.lower() not in _HOP_HEADERS:
            response.headers.add(name, value)
    is_sse = upstream.content_type == "text/event-stream"
    if is_sse:
        response.headers["Cache-Control"] = "no-cache"
        response.headers["X-Accel-Buffering"] = "no"  # tell any further proxy in front of us not to buffer either
    try:
        request[_ANSWER_BEGUN] = True
        await response.prepare(request)
        try:
            await _pass_on(request, response, upstream, is_sse, cfg.write_timeout)
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            # The engine went away mid-response (crash, kill). Say so in the stream's own error format.
            log.warning("engine connection lost during %s %s: %s", request.method, path, exc)
            if is_sse:
                await _write(request, response, _stream_error_event(
                    "The connection to the inference engine was lost while generating; see vllm.log."),
                    cfg.write_timeout)
        async with asyncio.timeout(cfg.write_timeout):
            await response.write_eof()
        finished = True
        return response
    except asyncio.CancelledError:
        if request.app[OPEN_FORWARDS].stopping and is_sse and response.prepared:
            asyncio.current_task().uncancel()
            log.info("proxy stopping: ending the stream of %s %s with an error event", request.method, path)
            with contextlib.suppress(StalledClient, ConnectionResetError, TimeoutError):
                await _write(request, response, _stream_error_event(SHUTDOWN_MESSAGE, code="server_shutdown"),
                             cfg.write_timeout)
                async with asyncio.timeout(cfg.write_timeout):
                    await response.write_eof()
            return response
        log.info("client disconnected from %s %s after %.2fs; aborting upstream request",
                 request.method, path, time.monotonic() - started)
        raise
    except ConnectionResetError:
        # Writing to a browser that already left (seen when cancellation did not win the race).
        log.info("client disconnected from %s %s after %.2fs; aborting upstream request",
                 request.method, path, time.monotonic() - started)
        return response
    except (StalledClient, TimeoutError):
        log.warning("client stopped reading %s %s for %gs; aborting upstream request", request.method, path,
                    cfg.write_timeout)
        return response
    finally:
        if finished:
            upstream.release()
        else:
            upstream.close()  # drop the TCP connection: the engine sees EOF and aborts generation


async def _pass_on(request: web.Request, response: web.StreamResponse, upstream: aiohttp.ClientResponse,
                   is_sse: bool, write_timeout: float) -> None:
    """The engine's bytes to the browser as they arrive; an SSE stream event by event (an event split across
    reads waits for its end, which is at most one read away)."""
    partial = b""
    # iter_any yields whatever bytes have arrived, without waiting for a line or a buffer to fill.
    async for chunk in upstream.content.iter_any():
        if is_sse:
            partial += chunk
            end = partial.rfind(b"\n\n") + 2
            if end < 2:
                continue
            chunk, partial = partial[:end], partial[end:]
        await _write(request, response, chunk, write_timeout)
    if partial:                                    # the engine's last bytes, whole event or not
        await _write(request, response, partial, write_timeout)
