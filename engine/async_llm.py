"""AsyncLLM: the engine loop on its own thread, fed and drained by an asyncio server.

Requests are validated (and their images decoded) in the caller's executor, so a bad request fails with a
clear error before any stream starts; only valid requests cross to the engine thread, through a command
queue that the loop drains between steps. Each step's outputs go back to the owning coroutine's queue via
call_soon_threadsafe. A client that goes away aborts its request at the next step boundary, freeing its
blocks at once.

It is the server's one way into the engine (vLLM's EngineClient role): model_info, encode/decode (on the input
pool, under the prompt-text budgets of a prompt), process_chat/process_prompt, generate, get_stats and
get_block_map. No other thread reads the scheduler or the KV cache: the engine core publishes its running count at
each schedule() (LLMEngine.num_running, an int), the engine thread a copy of the counters after each step, and it
copies the block tables when asked, between two steps.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

from engine.args import EngineArgs
from engine.engine_commands import (AbortRequest, AddRequest, EngineCommand, ModelInfo, ReadState, StartRequest,
                                    StatsSnapshot)
from engine.errors import EngineError, EngineOverloadedError, InvalidInputError, QueueFullError
from engine.inputs.types import ProcessedPrompt
from engine.llm_engine import LLMEngine
from engine.logger import init_logger
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import Histogram

logger = init_logger(__name__)
T = TypeVar("T")
# How long a read of the block map waits for the engine thread to reach a step boundary before it takes the last
# copy instead (a long prefill on the CPU can hold the thread for seconds).
READ_WAIT_S = 0.5
# How old the queue positions that waiting streams report may be.
QUEUE_POSITIONS_S = 0.25


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    admitted: asyncio.Event = field(default_factory=asyncio.Event)   # set once the engine has queued it


class AsyncLLM:
    def __init__(self, args: EngineArgs, max_pending: int = 4096, max_waiting: int | None = None):
        self.engine = LLMEngine(args)
        e = self.engine
        video = e.input_processor.video_processor
        self.model_info = ModelInfo(e.model_name, e.max_model_len, e.model_config.vocab_size,
                                    e.model_config.is_multimodal, e.input_processor.limits.limit_images_per_prompt,
                                    args.demo_model, e.input_processor.limits.limit_videos_per_prompt,
                                    video.sampling_defaults() if video is not None else None)
        self.model_name = self.model_info.name
        self.max_num_seqs = args.max_num_seqs
        self.max_pending = max_pending      # every request in flight, whatever its priority
        self.max_waiting = max_waiting      # requests without a running slot; None: only max_pending applies
        self.num_refused_queue_full = 0
        self._admit = threading.Lock()      # worker threads admit concurrently: the count and the insert are one
        self._commands: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._token_texts: dict[int, str] = {}     # token_text's, filled by the event loop
        self._positions: dict[str, int] = {}       # queue_position's, counted at _positions_at
        self._positions_at = 0.0
        self._stopping = False
        self.dead_error: BaseException | None = None
        # What other threads read of the engine, written by the engine thread alone (and here, before it starts):
        # after each step the running count and a copy of the counters; the block map when asked.
        self._started = self.engine.stats.started
        self._publish()
        self._last_block_map = self._copy_block_map()
        # Prompt processing (templates, tokenizing, image decodes) runs off the event loop, on the input processor's
        # executor, which is shut down with the engine
        self._workers = self.engine.input_processor.executor
        # The grammar engine's view of the vocabulary takes a second or two to build: ready before the first
        # structured-output request, built beside the engine loop.
        self._workers.submit(self.engine.structured_output.ll_tokenizer)
        self.engine.model_executor.add_failure_callback(self._on_rank_failure)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- state ---------------------------------------------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        return self._thread.is_alive() and self.dead_error is None

    def get_stats(self) -> StatsSnapshot:
        """The engine's counters as the engine thread copied them after its last step (or command), at once:
        /stats must answer while a long step runs."""
        stats = self._stats
        return replace(stats, counters={**stats.counters, "uptime_s": time.monotonic() - self._started})

    async def get_block_map(self) -> dict:
        """Who holds which GPU block (engine/kv_map.py), copied by the engine thread at its next step boundary
        (the last copy while a step runs longer than READ_WAIT_S, or once the loop has stopped): tens of
        thousands of blocks are too many to copy after every step."""
        return await self._read(self._copy_block_map, lambda: self._last_block_map)

    @property
    def num_waiting(self) -> int:
        """Requests admitted here that hold no running slot: still crossing to the engine thread, waiting, or
        swapped out (the running count as the engine's last schedule() published it)."""
        return max(0, len(self._streams) - self.engine.num_running)

    def queue_position(self, request_id: str) -> int | None:
        """How many admitted requests wait ahead of this one for a running slot (admission order, which the fcfs
        policy runs in), or None if it holds a slot, or may. From the event loop; the positions of all waiting
        requests are counted in one pass, at most every QUEUE_POSITIONS_S."""
        now = time.monotonic()
        if now - self._positions_at > QUEUE_POSITIONS_S:
            with self._admit:            # input threads add to _streams meanwhile
                order = list(self._streams)
            running = self.engine.num_running
            self._positions = {rid: i - running for i, rid in enumerate(order) if i >= running}
            self._positions_at = now
        return self._positions.get(request_id)

    def admission_stats(self) -> dict:
        return {"num_pending": self.num_waiting, "max_waiting_requests": self.max_waiting,
                "num_refused_queue_full": self.num_refused_queue_full}

    def _retry_after_s(self) -> int:
        """A hint for Retry-After: about one wave of running requests per queued batch of max_num_seqs."""
        waves = self.num_waiting // max(1, self.max_num_seqs) + 1
        return min(60, waves)

    # ---- tokens --------------------------------------------------------------------------------------------
    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of `text` (the tokenizer's encode), on the input pool under the prompt-text budgets that
        chat prompts meet (413 past the per-request cap, 429 past the in-flight one)."""
        ip = self.engine.input_processor
        return await asyncio.wrap_future(self._workers.submit(ip.tokenize, text, add_special_tokens))

    async def decode(self, token_ids: list[int]) -> str:
        """The text of `token_ids` (the tokenizer's decode), on the input pool; anything but ids of the vocabulary
        is a 400 naming `tokens` (checked there too: a body's worth of ids takes a while)."""
        return await asyncio.wrap_future(self._workers.submit(self._decode, token_ids))

    async def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        """The vocabulary's symbol for each id (the tokenizer's convert_ids_to_tokens), on the input pool."""
        tokenizer = self.engine.tokenizer
        return await asyncio.wrap_future(self._workers.submit(tokenizer.convert_ids_to_tokens, token_ids))

    def token_text(self, token_id: int) -> str:
        """One token's text, as logprobs show it (decoded, not the vocabulary's symbol): a one-token decode, cheap
        enough for the event loop, and kept. From the event loop only."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.engine.tokenizer.decode([token_id])
        return text

    def _decode(self, token_ids: list[int]) -> str:
        vocab = self.model_info.vocab_size
        bad = [t for t in token_ids if type(t) is not int or not 0 <= t < vocab]   # a bool is no token id
        if bad:
            raise InvalidInputError(f"tokens {bad[:5]} are not token ids: integers in [0, {vocab})", param="tokens")
        return self.engine.tokenizer.decode(token_ids)

    # ---- requests ------------------------------------------------------------------------------------------
    async def process_chat(self, messages, add_generation_prompt=True, chat_template_kwargs=None,
                           start: StartRequest | None = None, **options) -> ProcessedPrompt:
        """Render, tokenize and decode images off the event loop (raises InvalidInputError/ImageError); with
        `start`, the request is then queued from that same worker thread. `options`: InputProcessor.process_chat's
        (tools, chat_template, continue_final_message, mm_processor_kwargs, truncate_prompt_tokens)."""
        ip = self.engine.input_processor
        return await self._on_worker(
            lambda: ip.process_chat(messages, add_generation_prompt, chat_template_kwargs, **options), start)

    async def compile_structured_output(self, params: SamplingParams, param: str | None) -> None:
        """Compile the request's output constraint on a worker thread, not the engine loop; one that does not
        compile is a 400 naming `param`, the request field that asked for it."""
        so = params.structured_outputs
        if so is None or so.compiled is not None:
            return
        loop = asyncio.get_running_loop()
        try:
            so.compiled = await loop.run_in_executor(self._workers, self.engine.structured_output.compile, so)
        except InvalidInputError as e:
            e.param = param or e.param
            raise

    async def process_prompt(self, prompt, start: StartRequest | None = None,
                             truncate_prompt_tokens: int | None = None) -> ProcessedPrompt:
        return await self._on_worker(lambda: self.engine.process_prompt(prompt, truncate_prompt_tokens), start)

    def check_request(self, prompt: ProcessedPrompt, params: SamplingParams) -> int:
        """Raise PromptTooLongError etc. now, not after the stream has begun. Returns the resolved max_tokens."""
        return self.engine.check_lengths(prompt, params)

    def start_request(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams, priority: int,
                      loop: asyncio.AbstractEventLoop, past_queue_limit: bool = False) -> None:
        """Check and queue a request, from any thread; generate() then streams its outputs to `loop`."""
        if not self.is_healthy:
            raise EngineOverloadedError("the engine loop is not running", code="engine_dead")
        self.check_request(prompt, params)
        with self._admit:
            self.check_room(past_queue_limit)
            self._streams[request_id] = _Stream(loop, asyncio.Queue())
        self._send(AddRequest(request_id, prompt, params, priority, time.time()))

    def check_room(self, past_queue_limit: bool = False) -> None:
        """Raise a 503 (with Retry-After) if a new request would not be admitted now: the engine is down, too many
        are in flight, or the queue is full. The server asks before any work on a request, start_request again
        when it queues it. `past_queue_limit`: a privileged request (the server decides: the API key with a
        priority below 0) may pass the queue limit, never max_pending."""
        if not self.is_healthy:
            raise EngineOverloadedError("the engine loop is not running", code="engine_dead")
        if len(self._streams) >= self.max_pending:
            raise EngineOverloadedError(f"too many requests in flight ({len(self._streams)}); retry shortly",
                                        code="overloaded")
        if self.max_waiting is not None and not past_queue_limit and self.num_waiting >= self.max_waiting:
            self.num_refused_queue_full += 1
            retry = self._retry_after_s()
            raise QueueFullError(f"the server is busy: {self.num_waiting} requests are already waiting (limit "
                                 f"{self.max_waiting}, --max-waiting-requests); retry in about {retry}s", retry)

    async def generate(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                       priority: int = 0, past_queue_limit: bool = False) -> AsyncIterator[RequestOutput]:
        """Stream this request's outputs (one per step that produced text), starting it unless a StartRequest
        did. Cancelling the consumer, or leaving the loop early, aborts the request in the engine."""
        if request_id not in self._streams:
            self.start_request(request_id, prompt, params, priority, asyncio.get_running_loop(), past_queue_limit)
        stream = self._streams[request_id]
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.release(request_id)
            else:
                self._streams.pop(request_id, None)

    def release(self, request_id: str) -> None:
        """Forget the request's stream and abort it in the engine, at once and without awaiting anything: a
        handler being cancelled (its client left) must not depend on an await to free the request. Idempotent;
        a request that already finished is not in the engine any more, and its abort costs nothing."""
        if self._streams.pop(request_id, None) is not None:
            self._send(AbortRequest(request_id))

    async def wait_admitted(self, request_id: str) -> None:
        """Return once the engine has queued the request (its checks on the engine thread passed), or at once if
        it is not in flight here."""
        stream = self._streams.get(request_id)
        if stream is not None:
            await stream.admitted.wait()

    def abort(self, request_id: str) -> None:
        self._send(AbortRequest(request_id))

    def fail_request(self, request_id: str, error: EngineError) -> None:
        """End a request with `error` (its consumer raises it: a stream then ends with an error event), and
        abort it in the engine. From the event loop that consumes it."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.queue.put_nowait(error)
        self._send(AbortRequest(request_id))

    async def _on_worker(self, process: Callable[[], ProcessedPrompt], start: StartRequest | None) -> ProcessedPrompt:
        loop = asyncio.get_running_loop()

        def work() -> ProcessedPrompt:
            prompt = process()
            if start is not None:
                if start.fit is not None:
                    start.fit(prompt, start.params)
                self.start_request(start.request_id, prompt, start.params, start.priority, loop,
                                   start.past_queue_limit)
            return prompt
        job = self._workers.submit(work)
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            # The caller left. A prompt still queued is never processed (cancelling the awaited wrapper cancels
            # the job); a request that starts anyway is dropped, not run for no one.
            if start is not None:
                job.add_done_callback(lambda _: self.release(start.request_id))
            raise

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout=10)
        if self._thread.is_alive():
            # The loop is stuck in a step: telling the workers to stop would race its collectives.
            self.engine.model_executor.shutdown(graceful=False)
        self.engine.shutdown()

    def _on_rank_failure(self, message: str) -> None:
        """A tensor-parallel rank died (the executor's watcher thread; the process exits right after): every
        open stream ends with the reason, and /health reports the engine dead meanwhile."""
        self.dead_error = EngineError(message, code="engine_dead")
        for rid in list(self._streams):
            self._deliver(rid, EngineOverloadedError(f"the engine failed: {message}", code="engine_dead"))

    # ---- the engine thread ---------------------------------------------------------------------------------
    def _send(self, command: EngineCommand) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs in one hand-over per event loop: call_soon_threadsafe wakes the loop (a pipe write)
        each time, so 256 streams would cost 256 wake-ups and 256 GIL hand-offs per step."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _drain_commands(self) -> bool:
        """Every command queued since the last step: adds in order, then all aborts as one batch (a burst of
        disconnects is one pass over the scheduler's queues). An abort of a request added in the same drain
        comes after its add; one whose add is still to come finds no stream there, and the add is skipped. Returns
        whether a request was added or aborted."""
        aborts: list[str] = []
        changed = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, AbortRequest):
                aborts.append(command.request_id)
            elif isinstance(command, ReadState):
                command.run()
            else:
                rid = command.request_id
                if rid not in self._streams:       # the client left before the request reached the engine
                    continue
                changed = True
                try:
                    self.engine.add_request(rid, command.prompt, command.params, priority=command.priority,
                                            arrival_time=command.arrival_time)
                    stream = self._streams.get(rid)
                    if stream is not None:
                        stream.loop.call_soon_threadsafe(stream.admitted.set)
                except EngineError as e:
                    self._deliver(rid, e)
                except Exception as e:   # noqa: BLE001 - a bug in one request must not stop the loop
                    logger.exception("could not add request %s", rid)
                    self._deliver(rid, EngineError(f"could not start the request: {type(e).__name__}: {e}",
                                                   code="add_failed"))
        if aborts:
            for out in self.engine.abort_requests(aborts):
                self._deliver(out.request_id, out)
        return changed or bool(aborts)

    def _run(self) -> None:
        try:
            while not self._stopping:
                if self._drain_commands():
                    self._publish()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait(timeout=1.0)
                    self._wakeup.clear()
                    continue
                self._deliver_step(self._step())
                self._publish()
        except BaseException as e:   # noqa: BLE001 - the loop must never die silently
            self.dead_error = e
            logger.exception("engine loop died")
            for rid in list(self._streams):
                self._deliver(rid, EngineOverloadedError(f"the engine failed: {e}", code="engine_dead"))

    def _publish(self) -> None:
        """On the engine thread: what other threads read of it, each a new object (the reference swap is atomic)."""
        self._stats = StatsSnapshot(self.engine.get_stats(), _copy_histogram(self.engine.stats.iteration_tokens))

    def _copy_block_map(self) -> dict:
        self._last_block_map = self.engine.get_block_map()
        return self._last_block_map

    async def _read(self, read: Callable[[], T], last: Callable[[], T]) -> T:
        """`read` run by the engine thread between two steps; `last()` (its previous result) when the thread does
        not come to it within READ_WAIT_S or has stopped."""
        if not self._thread.is_alive():
            return last()
        command = ReadState(read)
        self._send(command)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(command.result)), READ_WAIT_S)
        except TimeoutError:
            return last()

    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step(before_schedule=self._drain_commands)
        except Exception as e:   # noqa: BLE001 - fail the requests of this step, keep serving the others
            logger.exception("engine step failed; aborting the running requests")
            failed = [r.request_id for r in list(self.engine.scheduler.running)]
            self.engine.abort_requests(failed)
            for rid in failed:
                self._deliver(rid, EngineError(f"generation failed: {type(e).__name__}: {e}", code="step_failed"))
            return []


def _copy_histogram(h: Histogram) -> Histogram:
    copied = Histogram(h.buckets)
    copied.counts, copied.total, copied.count = list(h.counts), h.total, h.count
    return copied


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, item in items:
        q.put_nowait(item)
