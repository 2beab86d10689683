"""One generation, from a parsed request to the HTTP response, shared by chat and completions.

A plain response waits for the whole generation. A stream sends its headers as soon as the engine has queued
the request (or its first output is there, if that comes first): errors at admission (overloaded, prompt too
long, engine dead) still get their own HTTP status, and a client whose request waits in the queue knows at once
that it was taken. A later failure (a failed step) is an error event inside the 200 stream.
The engine's output iterator is always closed (contextlib.aclosing), whether the response ends normally, the
write fails because the client went away, or aiohttp cancels the handler: closing it aborts the request in
the engine, which frees its KV blocks at the next step boundary.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web

from engine.errors import EngineError
from engine.inputs.types import ProcessedPrompt
from engine.logger import init_logger
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.server.errors import dumps
from engine.server.protocol import (Fields, RequestOptions, parse_options, read_json_body,
                                    refuse_unsupported)
from engine.server.sse import SSEWriter
from engine.server.state import STATE, ServerState

logger = init_logger(__name__)


@dataclass
class Generation:
    request_id: str                     # chatcmpl-... / cmpl-...: the response id and the engine's request id
    prompt: ProcessedPrompt
    params: SamplingParams
    options: RequestOptions
    created: int


class ResponseFormat(Protocol):
    """The endpoint's JSON shapes for one request (stateful: e.g. whether the role was sent yet)."""

    def chunk(self, out: RequestOutput) -> dict | None: ...        # None: nothing worth sending this step

    def usage_chunk(self, final: RequestOutput) -> dict: ...

    def response(self, final: RequestOutput) -> dict: ...


async def read_request(request: web.Request) -> tuple[ServerState, Fields, RequestOptions]:
    """The server's state, the body's fields and the options every generation endpoint shares, once the body
    has named the served model and nothing this server does not support."""
    state = request.app[STATE]
    f = Fields(await read_json_body(request))
    options = parse_options(f)
    state.check_model(options.model)
    refuse_unsupported(f)
    return state, f, options


def usage(out: RequestOutput) -> dict[str, int]:
    prompt, completion = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def serve_generation(request: web.Request, state: ServerState, gen: Generation,
                           fmt: ResponseFormat) -> web.StreamResponse:
    outputs = state.engine.generate(gen.request_id, gen.prompt, gen.params, gen.options.priority)
    task = asyncio.current_task()
    state.generations[task] = gen.request_id     # so that shutdown can wait for it, then end it
    try:
        async with contextlib.aclosing(outputs):
            if gen.options.stream:
                return await _stream(request, state, gen, fmt, outputs)
            final = await _next_output(outputs)
            while not final.finished:
                final = await _next_output(outputs)
            _on_finished(state, gen, final)
            return web.json_response(fmt.response(final), dumps=dumps)
    except (asyncio.CancelledError, ConnectionResetError):
        # The client went away (aiohttp cancelled the handler, or a write failed); leaving the `async with`
        # has already aborted the request in the engine.
        state.metrics.request_success["abort"] += 1
        if state.log_requests:
            logger.info("Aborted request %s: the client disconnected or the server is stopping", gen.request_id)
        raise
    finally:
        state.generations.pop(task, None)


async def _next_output(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    out = await anext(outputs)          # generate() yields until an output is finished, so this never runs dry
    if out.error:
        raise EngineError(f"generation failed: {out.error}", code="generation_failed")
    return out


async def _first_output_or_admission(state: ServerState, gen: Generation,
                                     outputs: AsyncIterator[RequestOutput]) -> asyncio.Task:
    """The task reading the first output, once that output is there or the engine has queued the request; an
    error before either (the engine refused the request) is raised here, before any header is sent."""
    first = asyncio.ensure_future(_next_output(outputs))      # starts the request if no StartRequest did
    admitted = asyncio.ensure_future(state.engine.wait_admitted(gen.request_id))
    try:
        await asyncio.wait({first, admitted}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        await _cancel(first)
        raise
    finally:
        admitted.cancel()
    if first.done():
        first.result()
    return first


async def _cancel(task: asyncio.Task) -> None:
    """Cancel the task reading the engine's outputs and let it unwind, so that the output iterator can then be
    closed (closing it while the task is still inside it would fail)."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _stream(request: web.Request, state: ServerState, gen: Generation, fmt: ResponseFormat,
                  outputs: AsyncIterator[RequestOutput]) -> web.StreamResponse:
    first = await _first_output_or_admission(state, gen, outputs)
    try:
        sse = await SSEWriter.start(request, state.stream_write_timeout)
    except BaseException:
        await _cancel(first)
        raise
    try:
        out = await first
        while True:
            chunk = fmt.chunk(out)
            if chunk is not None:
                await sse.send(chunk)
            if out.finished:
                break
            out = await _next_output(outputs)
        _on_finished(state, gen, out)
        if gen.options.include_usage:
            await sse.send(fmt.usage_chunk(out))
    except (asyncio.CancelledError, ConnectionResetError):
        raise                           # the client went away: nobody to send an error event to
    except EngineError as err:
        logger.warning("request %s failed while streaming: %s", gen.request_id, err.message)
        await sse.send_error(err.message, err.err_type, err.param, err.code)
    except Exception as exc:  # noqa: BLE001 - the stream must still end with an error event and [DONE]
        logger.exception("request %s failed while streaming", gen.request_id)
        await sse.send_error(f"internal server error ({type(exc).__name__}: {exc}); see the server log",
                             "internal_error", code="internal_error")
    await sse.finish()
    return sse.response


def _on_finished(state: ServerState, gen: Generation, final: RequestOutput) -> None:
    now = time.time()
    state.metrics.on_finished(final, now)
    if not state.log_requests:
        return
    m, completion = final.metrics, final.outputs[0]
    ttft = f"{m.first_token_time - m.arrival_time:.3f}s" if m.first_token_time else "-"
    logger.info("Finished request %s: prompt_tokens=%d, completion_tokens=%d, finish_reason=%s, ttft=%s, "
                "e2e=%.3fs", gen.request_id, len(final.prompt_token_ids), len(completion.token_ids),
                completion.finish_reason, ttft, now - m.arrival_time)
