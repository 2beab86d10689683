"""Server-Sent Events exactly as OpenAI streams them: `data: {json}\\n\\n` per chunk, `data: [DONE]\\n\\n` last;
the Responses API names each event (`event: response.output_text.delta\\ndata: {json}\\n\\n`) and sends no [DONE].

An error after the stream has begun cannot change the HTTP status any more, so it is sent as one
`data: {"error": {...}}` event followed by `[DONE]`, which the openai SDK raises as an APIError.

Back-pressure: `send` serializes a chunk into the stream's buffer and returns at once; a task of the writer's own
sends the buffer to the socket. So the engine's outputs are turned into bytes as they come (each output holds the
whole text so far: a backlog of outputs would grow with the square of the answer's length), and what waits for a
slow reader is bytes, bounded by `max_buffer`: a reader that falls further behind is cut off, as one that reads
nothing for `write_timeout` is.
"""
from __future__ import annotations

import asyncio

from aiohttp import web

from engine.server.errors import dumps, error_body

DONE = b"data: [DONE]\n\n"


class StalledClientError(ConnectionResetError):
    """The client stopped reading: a write waited past the server's --stream-write-timeout, or more than
    --max-stream-buffer-kb of output waits for it. Handled as a disconnect (the request is aborted and its
    blocks freed), after the connection is dropped."""


class SSEWriter:
    def __init__(self, response: web.StreamResponse, request: web.Request, write_timeout: float | None = None,
                 named_events: bool = False, max_buffer: int | None = None):
        self.response = response
        self.request = request
        self.write_timeout = write_timeout
        self.named_events = named_events
        self.max_buffer = max_buffer
        self._pending = bytearray()          # serialized, not yet handed to the socket
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()         # nothing pending and no write in progress
        self._idle.set()
        self._sender: asyncio.Task | None = None
        self._failed: ConnectionResetError | None = None

    @classmethod
    async def start(cls, request: web.Request, write_timeout: float | None = None,
                    named_events: bool = False, max_buffer: int | None = None) -> "SSEWriter":
        response = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",        # a reverse proxy (nginx) must pass each event on at once
        })
        await response.prepare(request)
        return cls(response, request, write_timeout, named_events, max_buffer)

    async def _write(self, data: bytes) -> None:
        # A reader that stops reading fills the socket buffers, then write() waits forever while the request
        # keeps its KV blocks: past the timeout the client counts as gone.
        try:
            async with asyncio.timeout(self.write_timeout):
                await self.response.write(data)
        except TimeoutError:
            raise self._cut(f"the client read nothing for {self.write_timeout:g}s") from None

    def _cut(self, why: str) -> StalledClientError:
        if self.request.transport is not None:
            self.request.transport.abort()
        self._failed = StalledClientError(why)
        return self._failed

    def push(self, data: bytes) -> None:
        """Queue bytes for the client; raises (as a disconnect) once the client is gone or too far behind."""
        if self._failed is not None:
            raise self._failed
        if self.max_buffer is not None and self._pending and len(self._pending) + len(data) > self.max_buffer:
            raise self._cut(f"the client fell more than {self.max_buffer} bytes behind")
        self._pending += data
        self._idle.clear()
        self._wake.set()
        if self._sender is None:
            self._sender = asyncio.create_task(self._send_pending())

    async def _send_pending(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._pending:
                    data = bytes(self._pending)
                    self._pending.clear()
                    await self._write(data)
                self._idle.set()
        except Exception as e:  # noqa: BLE001 - any failed write ends the stream as a disconnect does
            failed = e if isinstance(e, ConnectionResetError) else ConnectionResetError(f"the write failed: {e!r}")
            self._failed = self._failed or failed
            self._idle.set()

    async def flush(self) -> None:
        """Until everything pushed is written; raises if the client went away meanwhile."""
        await self._idle.wait()
        if self._failed is not None:
            raise self._failed

    async def send(self, payload: dict) -> None:
        name = f"event: {payload.get('type', 'error')}\n".encode() if self.named_events else b""
        self.push(name + b"data: " + dumps(payload).encode() + b"\n\n")

    async def send_error(self, message: str, err_type: str, param: str | None = None,
                         code: str | None = None) -> None:
        body = error_body(message, err_type, param, code)
        if self.named_events:      # the Responses API's error event, which the openai SDK raises as well
            body = {"type": "error", "code": code, "message": message, "param": param, **body}
        await self.send(body)

    async def finish(self) -> None:
        if not self.named_events:
            self.push(DONE)
        await self.flush()
        self.close()
        await self.response.write_eof()

    def close(self) -> None:
        """Stop the sending task (the handler ends: finished, failed or cancelled)."""
        if self._sender is not None:
            self._sender.cancel()
