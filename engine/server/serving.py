"""One generation, from a parsed request to the HTTP response, shared by chat and completions.

A plain response waits for the whole generation. A stream sends its headers as soon as the engine has queued
the request (or its first output is there, if that comes first): errors at admission (overloaded, prompt too
long, engine dead) still get their own HTTP status, and a client whose request waits in the queue knows at once
that it was taken. A later failure (a failed step) is an error event inside the 200 stream.
Every request it started is released (AsyncLLM.release) whether the response ends normally, the write fails
because the client went away, or aiohttp cancels the handler, even more than once: the release is a plain call,
not an await that a second cancellation could cut short, and it aborts the request in the engine, which frees
its KV blocks at the next step boundary. The tasks reading outputs are cancelled before anything is awaited.
"""
from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from aiohttp import web

from engine.errors import EngineError, PermissionDeniedError
from engine.inputs.types import ProcessedPrompt
from engine.logger import init_logger
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.server.errors import dumps
from engine.server.protocol import Fields, RequestOptions, parse_options, read_json_body
from engine.server.auth import PRIVILEGED
from engine.server.sse import SSEWriter
from engine.server.state import STATE, ServerState

logger = init_logger(__name__)
# How often a stream still waiting for its first output looks up its place in the queue.
QUEUE_REPORT_S = 0.5


@dataclass
class Generation:
    request_id: str                     # chatcmpl-... / cmpl-...: the response id and the first engine request's id
    prompt: ProcessedPrompt             # the first prompt (completions may send several: `prompts`)
    params: SamplingParams
    options: RequestOptions
    created: int
    n: int = 1                          # choices returned per prompt
    best_of: int | None = None          # candidates generated per prompt, the n most likely returned
    # Several prompts (completions' batch form), each with its parameters (a default max_tokens is fitted to
    # each prompt's length). None: the one prompt above.
    prompts: list[tuple[ProcessedPrompt, SamplingParams]] | None = None

    def __post_init__(self) -> None:
        if self.prompts is None:
            self.prompts = [(self.prompt, self.params)]

    @property
    def num_candidates(self) -> int:
        return max(self.n, self.best_of or 1)

    def children(self) -> list[tuple[str, ProcessedPrompt, SamplingParams]]:
        """One engine request per candidate: prompt p, sample s. A seeded request's sample s draws with seed +
        s (as vLLM does), so the n choices differ and each is reproducible."""
        out = []
        for p, (prompt, base) in enumerate(self.prompts):
            for s in range(self.num_candidates):
                rid = self.request_id if p == s == 0 else f"{self.request_id}-{p}-{s}"
                params = base if s == 0 or base.seed is None else dataclasses.replace(base, seed=base.seed + s)
                out.append((rid, prompt, params))
        return out


class ResponseFormat(abc.ABC):
    """An endpoint's JSON shapes for one request (stateful: e.g. whether the role was sent yet), in OpenAI's
    envelope. `index` is the choice's index: prompt * n + sample."""
    chunk_object: str                   # the `object` of a streamed chunk
    named_events = False                # SSE `event: <type>` lines and no [DONE] (the Responses API's stream)

    def __init__(self, gen: Generation, state: ServerState, logprobs: int | None):
        self.gen = gen
        self.state = state
        self.logprobs = logprobs        # what the client asked (best_of may ask the engine for more)
        self.token_text = _token_id_text if gen.options.tokens_as_ids else state.token_text   # tokens in logprobs

    def chunk(self, out: RequestOutput, index: int) -> dict | None:
        """The chunk to stream for this output of choice `index`; None: nothing worth sending now. (An endpoint
        that streams other events than chunks overrides events() instead.)"""
        raise NotImplementedError(f"{type(self).__name__} streams neither chunks nor events")

    @abc.abstractmethod
    def response(self, finals: list[RequestOutput]) -> dict:
        """The whole (not streamed) response."""

    def envelope(self, obj: str, choices: list[dict], **extra) -> dict:
        return {"id": self.gen.request_id, "object": obj, "created": self.gen.created,
                "model": self.state.served_model_name, "system_fingerprint": self.state.system_fingerprint,
                "choices": choices, **extra}

    def chunk_of(self, out: RequestOutput, choice: dict, opening: bool = False, **extra) -> dict:
        """A streamed chunk of one choice. stream_options.include_usage: usage null in each (the last chunk holds
        it), or each choice's running counts with continuous_usage_stats (none generated yet in an opening
        chunk)."""
        if self.gen.options.include_usage:
            extra["usage"] = running_usage(out, opening) if self.gen.options.continuous_usage_stats else None
        return self.envelope(self.chunk_object, [choice], **extra)

    def usage_chunk(self, finals: list[RequestOutput]) -> dict:
        return self.envelope(self.chunk_object, [], usage=usage(finals, len(self.gen.prompts)))

    def opening(self) -> list[dict]:
        """Events streamed before the first output."""
        return []

    def events(self, out: RequestOutput, index: int) -> list[dict]:
        """Events streamed for one output of choice `index`."""
        chunk = self.chunk(out, index)
        return [] if chunk is None else [chunk]

    def closing(self, finals: list[RequestOutput]) -> list[dict]:
        """Events streamed once every choice has finished."""
        return [self.usage_chunk(finals)] if self.gen.options.include_usage else []


async def read_request(request: web.Request) -> tuple[ServerState, Fields, RequestOptions]:
    """The server's state, the body's fields and the options every generation endpoint shares, once the body
    has named the served model. A request the engine would not admit now (a full queue, an engine down) is
    answered 503 before its body is parsed, unless it carries the API key (it may pass the queue limit)."""
    state = request.app[STATE]
    privileged = request.get(PRIVILEGED, False)
    if not privileged:
        state.engine.check_room()
    f = Fields(await read_json_body(request, state.body_limits))
    options = parse_options(f, state.return_tokens_as_token_ids)
    state.check_model(options.model)
    if options.priority < 0:
        options = dataclasses.replace(options, past_queue_limit=_priority_allowed(state, privileged))
    return state, f, options


def _priority_allowed(state: ServerState, privileged: bool) -> bool:
    """A priority below 0 is a privilege: the API key's (which may then pass the queue limit), or anyone's with
    --allow-anonymous-priority (still under the queue limit). Whether the request may pass the queue limit."""
    if privileged:
        return True
    if not state.allow_anonymous_priority:
        raise PermissionDeniedError("a priority below 0 needs the server's API key (Authorization: Bearer, "
                                    "--api-key), or a server started with --allow-anonymous-priority",
                                    param="priority", code="priority_not_allowed")
    return False


def usage(outs: list[RequestOutput], num_prompts: int = 1) -> dict:
    """Each prompt counted once (its n samples share it), every choice's tokens; prompt_tokens_details only when
    the prefix cache served some of the prompt (null otherwise, as vLLM)."""
    per_prompt = len(outs) // max(num_prompts, 1)
    firsts = outs[::per_prompt] if per_prompt else []
    prompt = sum(len(o.prompt_token_ids) for o in firsts)
    completion = sum(len(o.outputs[0].token_ids) for o in outs)
    cached = sum(o.metrics.num_cached_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached} if cached else None}


def running_usage(out: RequestOutput, opening: bool = False) -> dict:
    """stream_options.continuous_usage_stats: one choice's counts so far, in every chunk (as vLLM sends them)."""
    prompt, completion = len(out.prompt_token_ids), 0 if opening else len(out.outputs[0].token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def serve_generation(request: web.Request, state: ServerState, gen: Generation,
                           fmt: ResponseFormat) -> web.StreamResponse:
    children = gen.children()
    state.metrics.on_started(gen.n, gen.params.max_tokens)
    task = asyncio.current_task()
    state.generations[task] = gen.request_id     # so that shutdown can wait for it, then end it
    try:
        with contextlib.ExitStack() as stack:
            def start(child) -> AsyncIterator[RequestOutput]:
                rid, prompt, params = child
                it = state.engine.generate(rid, prompt, params, gen.options.priority, gen.options.past_queue_limit)
                stack.callback(state.engine.release, rid)     # aborts the request if it has not finished
                return it
            streams = [start(children[0])]
            # The other candidates start once the first has computed the prompt: with prefix caching they then
            # share its KV blocks instead of computing the same prompt again.
            def start_others() -> list[AsyncIterator[RequestOutput]]:
                return [start(c) for c in children[1:]]
            if gen.options.stream:
                return await _stream(request, state, gen, fmt, streams, start_others)
            first = await _next_output(streams[0])
            streams += start_others()
            finals = await _collect(first, streams)
            for final in finals:
                _on_finished(state, gen, final)
            return web.json_response(fmt.response(_pick_best(gen, finals)), dumps=dumps)
    except (asyncio.CancelledError, ConnectionResetError):
        # The client went away (aiohttp cancelled the handler, or a write failed); leaving the `async with`
        # has already released the requests.
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


async def _final(out: RequestOutput | None, outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    while out is None or not out.finished:
        out = await _next_output(outputs)
    return out


async def _collect(first: RequestOutput, streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Every candidate's final output. On an error or a cancellation the other readers are cancelled."""
    tasks = [asyncio.ensure_future(_final(first if i == 0 else None, s)) for i, s in enumerate(streams)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        await _cancel(*tasks)


def _pick_best(gen: Generation, finals: list[RequestOutput]) -> list[RequestOutput]:
    """best_of: per prompt, the n candidates of highest cumulative log-probability, best first."""
    if gen.num_candidates == gen.n:
        return finals
    k = gen.num_candidates
    picked = []
    for p in range(len(gen.prompts)):
        group = finals[p * k:(p + 1) * k]
        picked += sorted(group, key=_cumulative_logprob, reverse=True)[:gen.n]
    return picked


def _cumulative_logprob(out: RequestOutput) -> float:
    c = out.outputs[0]
    return sum(entry[t] for t, entry in zip(c.token_ids, c.logprobs or []))


async def _first_output_or_admission(state: ServerState, gen: Generation,
                                     outputs: AsyncIterator[RequestOutput]) -> asyncio.Task:
    """The task reading the first output, once that output is there or the engine has queued the request; an
    error before either (the engine refused the request) is raised here, before any header is sent."""
    first = asyncio.ensure_future(_next_output(outputs))      # starts the request if no StartRequest did
    admitted = asyncio.ensure_future(state.engine.wait_admitted(gen.request_id))
    try:
        await asyncio.wait({first, admitted}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        await _cancel(first, admitted)
        raise
    admitted.cancel()
    if first.done():
        first.result()
    return first


async def _cancel(*tasks: asyncio.Task) -> None:
    """Cancel tasks reading the engine's outputs, all of them before the first await (a handler cancelled again
    while it waits here must not leave one running), then let them unwind."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _stream(request: web.Request, state: ServerState, gen: Generation, fmt: ResponseFormat,
                  streams: list[AsyncIterator[RequestOutput]],
                  start_others: Callable[[], list[AsyncIterator[RequestOutput]]]) -> web.StreamResponse:
    """SSE of every candidate's chunks. The headers go out once the engine has queued the first candidate (a
    refusal before that is a plain error response), so that a queued client sees its request accepted."""
    first_task = await _first_output_or_admission(state, gen, streams[0])
    try:
        sse = await SSEWriter.start(request, state.stream_write_timeout, named_events=fmt.named_events,
                                    max_buffer=state.stream_buffer_bytes)
    except BaseException:
        await _cancel(first_task)
        raise
    try:
        return await _stream_events(state, gen, fmt, sse, first_task, streams, start_others)
    finally:
        sse.close()


async def _stream_events(state: ServerState, gen: Generation, fmt: ResponseFormat, sse: SSEWriter,
                         first_task: asyncio.Task, streams: list[AsyncIterator[RequestOutput]],
                         start_others: Callable[[], list[AsyncIterator[RequestOutput]]]) -> web.StreamResponse:
    queue: asyncio.Queue = asyncio.Queue()
    readers: list[asyncio.Task] = []
    try:
        for event in fmt.opening():
            await sse.send(event)
        first = await _first_while_queued(state, gen.request_id, sse, first_task)
        streams += start_others()
        readers = [asyncio.create_task(_read_into(queue, i, s, first if i == 0 else None))
                   for i, s in enumerate(streams)]
        finals: list[RequestOutput | None] = [None] * len(streams)
        while any(f is None for f in finals):
            index, out = await queue.get()
            if isinstance(out, BaseException):
                raise out
            for event in fmt.events(out, index):
                await sse.send(event)
            if out.finished:
                finals[index] = out
                _on_finished(state, gen, out)
        for event in fmt.closing(finals):
            await sse.send(event)
    except (asyncio.CancelledError, ConnectionResetError):
        raise                           # the client went away: nobody to send an error event to
    except EngineError as err:
        logger.warning("request %s failed while streaming: %s", gen.request_id, err.message)
        await sse.send_error(err.message, err.err_type, err.param, err.code)
    except Exception as exc:  # noqa: BLE001 - the stream must still end with an error event and [DONE]
        logger.exception("request %s failed while streaming", gen.request_id)
        await sse.send_error(f"internal server error ({type(exc).__name__}: {exc}); see the server log",
                             "internal_error", code="internal_error")
    finally:
        await _cancel(first_task, *readers)
    await sse.finish()
    return sse.response


async def _first_while_queued(state: ServerState, request_id: str, sse: SSEWriter,
                              first_task: asyncio.Task) -> RequestOutput:
    """The first output; until it comes, the request's place in the queue whenever it changes, as an SSE comment
    (`: queued N ahead`), which OpenAI clients skip and the chat page shows."""
    reported = None
    while True:
        done, _ = await asyncio.wait({first_task}, timeout=QUEUE_REPORT_S)
        if done:
            return first_task.result()
        ahead = state.engine.queue_position(request_id)
        if ahead is not None and ahead != reported:
            sse.push(f": queued {ahead} ahead\n\n".encode())
            reported = ahead


async def _read_into(queue: asyncio.Queue, index: int, outputs: AsyncIterator[RequestOutput],
                     first: RequestOutput | None) -> None:
    """One candidate's outputs into the shared queue, in order; its error too, then it stops."""
    try:
        out = first if first is not None else await _next_output(outputs)
        while True:
            queue.put_nowait((index, out))
            if out.finished:
                return
            out = await _next_output(outputs)
    except Exception as exc:  # noqa: BLE001 - handed to the writer, which ends the stream with it
        queue.put_nowait((index, exc))


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


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
