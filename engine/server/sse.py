"""Server-Sent Events exactly as OpenAI streams them: `data: {json}\\n\\n` per chunk, `data: [DONE]\\n\\n` last.

An error after the stream has begun cannot change the HTTP status any more, so it is sent as one
`data: {"error": {...}}` event followed by `[DONE]`, which the openai SDK raises as an APIError.
"""
from __future__ import annotations

import asyncio

from aiohttp import web

from engine.server.errors import dumps, error_body

DONE = b"data: [DONE]\n\n"


class StalledClientError(ConnectionResetError):
    """The client stopped reading: a write waited past the server's --stream-write-timeout. Handled as a
    disconnect (the request is aborted and its blocks freed), after the connection is dropped."""


class SSEWriter:
    def __init__(self, response: web.StreamResponse, request: web.Request, write_timeout: float | None = None):
        self.response = response
        self.request = request
        self.write_timeout = write_timeout

    @classmethod
    async def start(cls, request: web.Request, write_timeout: float | None = None) -> "SSEWriter":
        response = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",        # a reverse proxy (nginx) must pass each event on at once
        })
        await response.prepare(request)
        return cls(response, request, write_timeout)

    async def _write(self, data: bytes) -> None:
        # A reader that stops reading fills the socket buffers, then write() waits forever while the request
        # keeps its KV blocks and its queued outputs grow: past the timeout the client counts as gone.
        try:
            async with asyncio.timeout(self.write_timeout):
                await self.response.write(data)
        except TimeoutError:
            if self.request.transport is not None:
                self.request.transport.abort()
            raise StalledClientError(f"the client read nothing for {self.write_timeout:g}s") from None

    async def send(self, payload: dict) -> None:
        await self._write(b"data: " + dumps(payload).encode() + b"\n\n")

    async def send_error(self, message: str, err_type: str, param: str | None = None,
                         code: str | None = None) -> None:
        await self.send(error_body(message, err_type, param, code))

    async def finish(self) -> None:
        await self._write(DONE)
        await self.response.write_eof()
