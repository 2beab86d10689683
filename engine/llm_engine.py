"""LLMEngine: the engine core. add_request() queues work; each step() schedules one batch and has the executor
launch it on every rank (one forward + sampling on the device), then finishes the previous one (its tokens, stop
checks, detokenization) while the device computes, and returns what changed. It owns the scheduler, the KV cache
manager, the output processor and one executor, and never touches a worker, the runner, the KV cache or the
model. The offline LLM and the server's engine thread drive it."""
from __future__ import annotations

import gc
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.args import EngineArgs
from engine.config import ModelConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.errors import InvalidInputError, ModelLoadError, PromptTooLongError
from engine.executor import Executor, InflightStep
from engine.inputs.setup import build_input_processor
from engine.inputs.types import ProcessedPrompt
from engine.logger import init_logger
from engine.model.loader import load_model_config
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import StatLogger
from engine.structured_output import Grammar, StructuredOutputManager

logger = init_logger(__name__)


class LLMEngine:
    def __init__(self, args: EngineArgs):
        start = time.perf_counter()
        self.args = args
        device = _resolve_device(args.device)
        self.model_config: ModelConfig = load_model_config(args.model, args.quantization, args.load_format)
        self.model_name = args.served_model_name or Path(args.model).name
        self.tensor_parallel_size = args.tensor_parallel_size
        logger.info("Initializing engine: model=%s, architecture=%s, dtype=%s, device=%s, block_size=%d, "
                    "prefix_caching=%s, scheduling_policy=%s, tensor_parallel_size=%d", args.model,
                    self.model_config.architecture, args.dtype, device, args.block_size,
                    args.enable_prefix_caching, args.scheduling_policy, args.tensor_parallel_size)
        self.input_processor = build_input_processor(args, self.model_config)
        self.tokenizer = self.input_processor.tokenizer
        # Structured-output matchers by request id: rank 0's runner takes each when its request first runs.
        self.grammars: dict[str, Grammar] = {}
        try:
            self.model_executor = Executor.create(args, self.model_config, device,
                                                  self.input_processor.image_processor, self.grammars)
        except BaseException:
            self.input_processor.shutdown()
            raise
        kv = self.kv_cache_config = self.model_executor.kv_cache_config
        self.dtype, self.device = self.model_executor.dtype, self.model_executor.device
        self.ranks = self.model_executor.ranks
        self.max_model_len = kv.max_model_len
        self.input_processor.max_prompt_tokens = self.max_model_len
        self.max_num_batched_tokens = args.batched_tokens_budget
        self.kv = KVCacheManager(kv.num_gpu_blocks, kv.num_cpu_blocks, args.block_size, args.enable_prefix_caching)
        # A CPU computes each step inside its launch, on this thread: reading its tokens never waits.
        self._steps_in_launch = self.device.type == "cpu"
        self.scheduler = Scheduler(self.kv, self.max_num_batched_tokens, args.max_num_seqs, args.scheduling_policy,
                                   args.speculative_config, waiting_is_free=self._steps_in_launch)
        self.outputs = OutputProcessor(self.tokenizer)
        self.structured_output = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                                         self.model_config.eos_token_ids)
        self.stats = StatLogger(self)
        self._next_id = 0
        self._inflight: InflightStep | None = None      # the launched step not yet read (see PendingTokens)
        # When the step() call that launched it began and when its launch returned; when the last step's tokens
        # were ready. A CPU computes the step inside the launch, a GPU until its tokens are read.
        self._inflight_times = (0.0, 0.0)
        self._last_step_done = 0.0
        # Published for other threads (AsyncLLM's admission): the running count as the last schedule() left it.
        self.num_running = 0
        # The start-up objects (modules, tokenizer, config: ~350k) would otherwise be scanned by every full
        # collection, a stall for every running stream. vLLM freezes them too.
        gc.collect()
        gc.freeze()
        logger.info("Engine ready in %.2f seconds: dtype=%s, device=%s", time.perf_counter() - start,
                    str(self.dtype).removeprefix("torch."), self.device)

    # ---- requests ------------------------------------------------------------------------------------------
    def process_prompt(self, prompt, truncate_prompt_tokens: int | None = None) -> ProcessedPrompt:
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        return self.input_processor.process(prompt, truncate_prompt_tokens)

    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None) -> Request:
        """Validate and queue a request. Raises InvalidInputError (e.g. PromptTooLongError) if it cannot run."""
        params = params or SamplingParams()
        processed = self.process_prompt(prompt)
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        if request_id in self.scheduler.requests or self._in_flight(request_id):
            raise InvalidInputError(f"request id {request_id!r} is already running", param="request_id")
        max_tokens = self.check_lengths(processed, params)
        bad = [t for t in params.stop_token_ids if t >= self.model_config.vocab_size]
        if bad:
            raise InvalidInputError(f"stop_token_ids {bad} are outside the vocabulary (size "
                                    f"{self.model_config.vocab_size})", param="stop_token_ids")
        self.check_token_ids(params)
        req = Request(request_id, processed, params, self.model_config.eos_token_ids, max_tokens, priority,
                      arrival_time)
        so = params.structured_outputs
        if so is not None:
            if so.compiled is None:      # compiled once; each request forks its own matcher
                so.compiled = self.structured_output.compile(so)
            self.grammars[request_id] = so.compiled.fork()
        req.bad_words_token_ids = self.bad_words_token_ids(params.bad_words or [])
        # A multi-token bad word is banned after its other tokens, which must be on the host.
        req.needs_host_tokens |= any(len(ids) > 1 for ids in req.bad_words_token_ids)
        self.outputs.add(req)
        self.scheduler.add_request(req)
        return req

    def _in_flight(self, request_id: str) -> bool:
        """A finished request's id is free again once no launched step holds a token for it."""
        return self._inflight is not None and request_id in self._inflight.so.num_scheduled_tokens

    def check_token_ids(self, params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        for param, ids in (("logit_bias", params.logit_bias or {}), ("allowed_token_ids",
                                                                     params.allowed_token_ids or [])):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise InvalidInputError(f"{param}: token ids {bad[:5]} are outside the vocabulary (size {vocab})",
                                        param=param)

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's tokens alone and after a space (as vLLM: a word mid-sentence starts with one)."""
        out = []
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def check_lengths(self, processed: ProcessedPrompt, params: SamplingParams) -> int:
        """Refuse a prompt that cannot run (empty, too long for max_model_len); returns the resolved max_tokens."""
        n = len(processed.prompt_token_ids)
        if n == 0:
            raise InvalidInputError("the prompt is empty", param="prompt")
        if n >= self.max_model_len:
            raise PromptTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has {n} "
                f"tokens (no room left for output); shorten the prompt", param="messages", code="context_length")
        room = self.max_model_len - n
        if params.max_tokens is not None and params.max_tokens > room:
            raise PromptTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has {n} tokens "
                f"and max_tokens asks for {params.max_tokens} more ({n + params.max_tokens} in all); lower "
                f"max_tokens to at most {room} or shorten the prompt", param="max_tokens", code="context_length")
        return params.max_tokens if params.max_tokens is not None else room

    def abort_request(self, request_id: str) -> RequestOutput | None:
        outs = self.abort_requests([request_id])
        return outs[0] if outs else None

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """Abort every named request still in the engine (others are skipped) in one batch; returns their final
        outputs. A thousand aborts cost one pass over the scheduler's queues."""
        reqs = {rid: req for rid in request_ids if (req := self.scheduler.requests.get(rid)) is not None}
        self.scheduler.finish_requests(list(reqs.values()), RequestStatus.FINISHED_ABORTED)
        self.num_running = len(self.scheduler.running)
        for rid in reqs:
            self.grammars.pop(rid, None)        # never scheduled: the runner did not take its matcher
        return [self.outputs.finish(req) for req in reqs.values()]

    def has_unfinished_requests(self) -> bool:
        """Work left: queued requests, a step to read, or finished requests the runner has yet to forget."""
        return (self.scheduler.has_unfinished_requests() or self._inflight is not None
                or bool(self.scheduler.finished_req_ids))

    # ---- the step ------------------------------------------------------------------------------------------
    def step(self, before_schedule: Callable[[], None] | None = None) -> list[RequestOutput]:
        """Launch the next step, then finish the previous one (wait for its tokens, update, detokenize) while
        the device computes. Returns the outputs of the previous step. `before_schedule` runs right before the
        scheduler picks the step: AsyncLLM applies there the aborts and adds that came meanwhile (while a
        step whose sampling needs every token id was awaited, just before)."""
        called = time.perf_counter()
        outputs = []
        if self._inflight is not None and self._inflight.so.needs_host_tokens:
            outputs = self._finish(self._inflight)       # its sampling reads every token id: no overlap
            self._inflight = None
        if before_schedule is not None:
            before_schedule()
        so = self.scheduler.schedule()
        self.num_running = len(self.scheduler.running)
        launched = None
        if not so.is_empty:
            self.stats.on_schedule(so)
            launched = self.model_executor.execute_model(so)
        elif so.finished_req_ids:
            self.model_executor.execute_model(so)     # nothing to run: the workers forget finished requests
        returned = time.perf_counter()
        if self._inflight is not None:
            outputs += self._finish(self._inflight)
        self._inflight, self._inflight_times = launched, (called, returned)
        return outputs

    def shutdown(self) -> None:
        """Stop the workers and the input threads; from the thread that runs the steps, between steps. The
        engine cannot run afterwards."""
        self.model_executor.shutdown()
        self.input_processor.shutdown()

    def _finish(self, step: InflightStep) -> list[RequestOutput]:
        result = step.result()
        # The step's cost: from the previous step's tokens, or from the call that launched it if that came later
        # (the engine idled, or computed the previous step inside its launch).
        called, returned = self._inflight_times
        done = returned if self._steps_in_launch else time.perf_counter()
        self.scheduler.record_step_time(step.so, done - max(self._last_step_done, called))
        self._last_step_done = done
        self._store_prompt_logprobs(result.prompt_logprobs)
        logprobs = result.logprobs
        if self.args.speculative_config is not None:
            self._count_drafts(step, result.sampled)
        updated = self.scheduler.update_from_output(step.so, result.sampled, result.spec_token_ids)
        outputs, stopped = [], []
        for req, num_new in updated:
            out = self.outputs.on_tokens(req, num_new, logprobs.get(req.request_id))
            if out.finished and not req.is_finished:       # a stop string ended it
                stopped.append(req)
            outputs.append(out)
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self.stats.on_tokens(sum(n for _, n in updated))
        return outputs

    def _count_drafts(self, step: InflightStep, sampled: dict[str, list[int]]) -> None:
        """Speculative decoding's counters: per request that verified drafts, how many it drafted and kept."""
        for s in step.so.sampled:
            tokens = sampled.get(s.request_id)
            if s.spec_token_ids and tokens is not None:
                self.stats.on_spec_decode(len(s.spec_token_ids), len(tokens) - 1)

    def _store_prompt_logprobs(self, chunks: dict[str, tuple[int, list[dict[int, float]]]]) -> None:
        """Into each request's prompt_logprobs (None at position 0, which nothing predicts). A prompt computed
        again after a preemption writes the same places."""
        for rid, (first, entries) in chunks.items():
            req = self.scheduler.requests.get(rid)
            if req is None:                               # aborted while the step ran
                continue
            if req.prompt_logprobs is None:
                req.prompt_logprobs = [None] * req.num_prompt_tokens
            req.prompt_logprobs[first:first + len(entries)] = entries

    def get_stats(self) -> dict:
        return self.stats.snapshot()

    def get_block_map(self) -> dict:
        """Who holds which GPU block, run-length encoded (engine/kv_map.py), with the counters of that moment; on
        the thread that runs the steps (AsyncLLM asks for it between two steps)."""
        return self.stats.block_snapshot()


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device=cuda was asked for but no CUDA GPU is available (use device=cpu)")
    return torch.device(name)
