"""Server-Sent Events exactly as OpenAI streams them: `data: {json}\\n\\n` per chunk, `data: [DONE]\\n\\n` last;
the Responses API names each event (`event: response.output_text.delta\\ndata: {json}\\n\\n`) and sends no [DONE].

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
    def __init__(self, response: web.StreamResponse, request: web.Request, write_timeout: float | None = None,
                 named_events: bool = False):
        self.response = response
        self.request = request
        self.write_timeout = write_timeout
        self.named_events = named_events

    @classmethod
    async def start(cls, request: web.Request, write_timeout: float | None = None,
                    named_events: bool = False) -> "SSEWriter":
        response = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",        # a reverse proxy (nginx) must pass each event on at once
        })
        await response.prepare(request)
        return cls(response, request, write_timeout, named_events)

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
        name = f"event: {payload.get('type', 'error')}\n".encode() if self.named_events else b""
        await self._write(name + b"data: " + dumps(payload).encode() + b"\n\n")

    async def send_error(self, message: str, err_type: str, param: str | None = None,
                         code: str | None = None) -> None:
        body = error_body(message, err_type, param, code)
        if self.named_events:      # the Responses API's error event, which the openai SDK raises as well
            body = {"type": "error", "code": code, "message": message, "param": param, **body}
        await self.send(body)

    async def finish(self) -> None:
        if not self.named_events:
            await self._write(DONE)
        await self.response.write_eof()
