"""Server-Sent Events exactly as OpenAI streams them: `data: {json}\\n\\n` per chunk, `data: [DONE]\\n\\n` last.

An error after the stream has begun cannot change the HTTP status any more, so it is sent as one
`data: {"error": {...}}` event followed by `[DONE]`, which the openai SDK raises as an APIError.
"""
from __future__ import annotations

from aiohttp import web

from engine.server.errors import dumps, error_body

DONE = b"data: [DONE]\n\n"


class SSEWriter:
    def __init__(self, response: web.StreamResponse):
        self.response = response

    @classmethod
    async def start(cls, request: web.Request) -> "SSEWriter":
        response = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",        # a reverse proxy (nginx) must pass each event on at once
        })
        await response.prepare(request)
        return cls(response)

    async def send(self, payload: dict) -> None:
        await self.response.write(b"data: " + dumps(payload).encode() + b"\n\n")

    async def send_error(self, message: str, err_type: str, param: str | None = None,
                         code: str | None = None) -> None:
        await self.send(error_body(message, err_type, param, code))

    async def finish(self) -> None:
        await self.response.write(DONE)
        await self.response.write_eof()
