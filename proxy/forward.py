"""Forwarding to the engine: bodies capped in size, responses streamed through as they arrive.

Two properties matter more than anything else here:
- nothing is buffered: every chunk the engine writes (one SSE event per token, typically) is written to the
  browser as soon as it is read, so tokens appear as they are generated;
- when the browser disconnects, the upstream connection is closed at once (not returned to the pool), which is
  how the engine learns that nobody is listening and aborts the request, freeing its KV blocks.
aiohttp cancels the handler task when the client goes away (the app runs with handler_cancellation=True); the
`finally` below then closes the upstream response.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
from aiohttp import web

from proxy.config import CONFIG, SESSION
from proxy.errors import engine_unavailable, error_body, payload_too_large

log = logging.getLogger("proxy")

# Request headers worth passing on; everything else (cookies, Host, browser noise) stays here.
_REQUEST_HEADERS = ("Content-Type", "Accept", "Authorization", "X-Request-Id", "OpenAI-Organization")
# Response headers that describe one hop only, or that aiohttp recomputes for the browser side. Content-Encoding
# stays: bodies pass through undecoded (auto_decompress=False).
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "upgrade",
                "proxy-authenticate", "trailer", "te", "server", "date"}


class BodyTooLarge(Exception):
    pass


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole request body, refusing (before reading, when Content-Length says so) anything over `limit`."""
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge
    buf = bytearray()
    async for chunk in request.content.iter_chunked(1 << 16):
        buf += chunk
        if len(buf) > limit:  # chunked uploads carry no length: count as we go
            raise BodyTooLarge
    return bytes(buf)


def _upstream_headers(request: web.Request, api_key: str | None) -> dict[str, str]:
    headers = {name: request.headers[name] for name in _REQUEST_HEADERS if name in request.headers}
    # A compressed SSE stream would be held back in compressor buffers; ask the engine for plain bytes.
    headers["Accept-Encoding"] = "identity"
    if api_key:
        # The proxy's key wins: the page never holds one, and a stale header from a client must not leak through.
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def _stream_error_event(message: str) -> bytes:
    body = error_body(message, "service_unavailable", code="engine_disconnected")
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


async def forward(request: web.Request, upstream_path: str | None = None) -> web.StreamResponse:
    cfg = request.app[CONFIG]
    session: aiohttp.ClientSession = request.app[SESSION]
    try:
        body = await read_body(request, cfg.max_upload_bytes)
    except BodyTooLarge:
        log.warning("refused %s %s: body over %d bytes", request.method, request.path, cfg.max_upload_bytes)
        return payload_too_large(cfg.max_upload_bytes)

    path = upstream_path or request.rel_url.path_qs
    url = cfg.engine_url + path
    try:
        upstream = await session.request(request.method, url, data=body or None, allow_redirects=False,
                                         headers=_upstream_headers(request, cfg.api_key))
    except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
        log.warning("engine unreachable for %s %s: %s", request.method, path, exc.__class__.__name__)
        return engine_unavailable(cfg.engine_url)

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
        await response.prepare(request)
        try:
            # iter_any yields whatever bytes have arrived, without waiting for a line or a buffer to fill.
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            # The engine went away mid-response (crash, kill). Say so in the stream's own error format.
            log.warning("engine connection lost during %s %s: %s", request.method, path, exc)
            if is_sse:
                await response.write(_stream_error_event(
                    "The connection to the inference engine was lost while generating; see vllm.log."))
        await response.write_eof()
        finished = True
        return response
    except asyncio.CancelledError:
        log.info("client disconnected from %s %s after %.2fs; aborting upstream request",
                 request.method, path, time.monotonic() - started)
        raise
    except ConnectionResetError:
        # Writing to a browser that already left (seen when cancellation did not win the race).
        log.info("client disconnected from %s %s after %.2fs; aborting upstream request",
                 request.method, path, time.monotonic() - started)
        return response
    finally:
        if finished:
            upstream.release()
        else:
            upstream.close()  # drop the TCP connection: the engine sees EOF and aborts generation
