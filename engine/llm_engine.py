"""LLMEngine: the engine core. add_request() queues work; each step() schedules and launches one batch (one
forward + sampling on the device), then finishes the previous one (its tokens, stop checks, detokenization)
while the device computes, and returns what changed. The offline LLM and the server's engine thread drive it."""
from __future__ import annotations

import gc
import time
from pathlib import Path

import torch

from engine import load_progress
from engine.args import EngineArgs
from engine.cache_engine import CacheEngine
from engine.config import ModelConfig
from engine.cuda_graphs import cuda_graphs_wanted, enable_cuda_graphs, scratch_blocks_needed
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.errors import InvalidInputError, ModelLoadError, PromptTooLongError
from engine.inputs.types import ProcessedPrompt
from engine.inputs.setup import build_input_processor
from engine.kv_map import block_map
from engine.kv_sizing import plan_kv_cache
from engine.logger import init_logger
from engine.memory import GiB, apply_gpu_memory_limit, weights_out_of_memory
from engine.model.loader import build_model, load_model_config, load_weights
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.runner import InflightStep, ModelRunner
from engine.sampling_params import SamplingParams
from engine.stats import StatLogger
from engine.structured_output import StructuredOutputManager

logger = init_logger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16, "float32": torch.float32,
           "float": torch.float32}


class LLMEngine:
    def __init__(self, args: EngineArgs):
        start = time.perf_counter()
        self.args = args
        self.device = _resolve_device(args.device)
        self.model_config: ModelConfig = load_model_config(args.model, args.quantization, args.load_format)
        self.dtype = _resolve_dtype(args.dtype, self.model_config, self.device)
        self.model_name = args.served_model_name or Path(args.model).name
        logger.info("Initializing engine: model=%s, architecture=%s, dtype=%s, device=%s, block_size=%d, "
                    "prefix_caching=%s, scheduling_policy=%s", args.model, self.model_config.architecture,
                    str(self.dtype).removeprefix("torch."), self.device, args.block_size,
                    args.enable_prefix_caching, args.scheduling_policy)
        self.input_processor = build_input_processor(args, self.model_config)
        self.tokenizer = self.input_processor.tokenizer
        load_progress.report("building the model", 0.03)

        max_len = args.max_model_len or self.model_config.max_position_embeddings
        # Capped before the weights arrive, so that loading too runs as on a card of that size.
        self.gpu_memory_limit = apply_gpu_memory_limit(args.gpu_memory_limit, self.device)
        try:
            self.model = build_model(self.model_config, max_len, self.dtype, self.device)
            load_weights(self.model, args.model, args.load_format)
        except torch.cuda.OutOfMemoryError as err:
            if self.gpu_memory_limit is None:
                raise
            raise weights_out_of_memory(self.gpu_memory_limit, self.device, err) from None

        load_progress.report("sizing the KV cache", 0.87)
        plan = plan_kv_cache(self, max_len)
        self.num_gpu_blocks, self.num_cpu_blocks = plan.num_gpu_blocks, plan.num_cpu_blocks
        self.kv_bytes_per_block = plan.bytes_per_block
        use_graphs = cuda_graphs_wanted(args, self.device)
        # Prefill CUDA graphs write their padding rows' K/V to scratch blocks kept outside the pool.
        # (Taken from the profiled budget; an explicit num_gpu_blocks_override gets them on top.)
        num_scratch = scratch_blocks_needed(args.block_size) if use_graphs else 0
        if num_scratch and not args.num_gpu_blocks_override:
            if self.num_gpu_blocks > 2 * num_scratch:
                self.num_gpu_blocks -= num_scratch
            else:
                use_graphs, num_scratch = False, 0
        self.scratch_blocks = list(range(self.num_gpu_blocks, self.num_gpu_blocks + num_scratch))
        self.max_model_len = min(max_len, self.num_gpu_blocks * args.block_size)
        self.input_processor.max_prompt_tokens = self.max_model_len
        if self.max_model_len < max_len:
            under = "" if self.gpu_memory_limit is None else \
                f" under --gpu-memory-limit {self.gpu_memory_limit / GiB:.2f} GiB"
            logger.warning("max_model_len reduced from %d to %d: the KV pool holds %d tokens%s", max_len,
                           self.max_model_len, self.num_gpu_blocks * args.block_size, under)
        self.max_num_batched_tokens = args.batched_tokens_budget
        self.cache = CacheEngine(self.model_config, self.num_gpu_blocks + num_scratch, self.num_cpu_blocks,
                                 args.block_size, self.dtype, self.device)
        self.kv = KVCacheManager(self.num_gpu_blocks, self.num_cpu_blocks, args.block_size,
                                 args.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, self.max_num_batched_tokens, args.max_num_seqs, args.scheduling_policy)
        self.runner = ModelRunner(self.model, self.model_config, self.cache, args.block_size, self.device,
                                  args.encoder_cache_size)
        plan.log(self)
        if use_graphs:
            load_progress.report("capturing CUDA graphs", 0.9)
            enable_cuda_graphs(self)
        elif self.device.type == "cuda":
            logger.info("CUDA graphs off (--enforce-eager, no Triton, or a KV pool too small): eager steps")
        self.outputs = OutputProcessor(self.tokenizer)
        self.structured_output = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                                         self.model_config.eos_token_ids)
        self.stats = StatLogger(self)
        self._next_id = 0
        self._inflight: InflightStep | None = None      # the launched step not yet read (see PendingTokens)
        # The start-up objects (modules, tokenizer, config: ~350k) would otherwise be scanned by every full
        # collection; one took 88 ms on a 2-core CPU, a stall for every running stream. vLLM freezes them too.
        gc.collect()
        gc.freeze()
        logger.info("Engine ready in %.2f seconds", time.perf_counter() - start)

    # ---- requests ------------------------------------------------------------------------------------------
    def process_prompt(self, prompt) -> ProcessedPrompt:
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        return self.input_processor.process(prompt)

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
            req.grammar = so.compiled.fork()
        req.bad_words_token_ids = self.bad_words_token_ids(params.bad_words or [])
        # A multi-token bad word is banned after its other tokens, which must be on the host.
        req.needs_host_tokens |= any(len(ids) > 1 for ids in req.bad_words_token_ids)
        if params.seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(params.seed % 2**64)
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
        return [self.outputs.finish(req) for req in reqs.values()]

    def has_unfinished_requests(self) -> bool:
        """Work left: queued requests, a step to read, or finished requests the runner has yet to forget."""
        return (self.scheduler.has_unfinished_requests() or self._inflight is not None
                or bool(self.scheduler.finished_req_ids))

    # ---- the step ------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Launch the next step, then finish the previous one (wait for its tokens, update, detokenize) while
        the device computes. Returns the outputs of the previous step."""
        outputs = []
        if self._inflight is not None and self._inflight.so.needs_host_tokens:
            outputs = self._finish(self._inflight)       # its sampling reads every token id: no overlap
            self._inflight = None
        so = self.scheduler.schedule()
        launched = None
        if not so.is_empty:
            self.stats.on_schedule(so)
            launched = self.runner.launch(so, self._inflight)
        else:
            self.runner.update_states(so)               # it may still have finished requests to forget
        if self._inflight is not None:
            outputs += self._finish(self._inflight)
        self._inflight = launched
        return outputs

    def _finish(self, step: InflightStep) -> list[RequestOutput]:
        result = step.result()
        self._store_prompt_logprobs(result.prompt_logprobs)
        logprobs = result.logprobs
        updated = self.scheduler.update_from_output(step.so, result.sampled)
        outputs, stopped = [], []
        for req in updated:
            out = self.outputs.on_token(req, logprobs.get(req.request_id))
            if out.finished and not req.is_finished:       # a stop string ended it
                stopped.append(req)
            outputs.append(out)
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self.stats.on_tokens(len(updated))
        return outputs

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
        """Who holds which GPU block, run-length encoded (engine/kv_map.py); read from any thread."""
        return block_map(self.kv, self.scheduler, self.kv_bytes_per_block)


def _cpu_has_bf16() -> bool:
    check = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(check and check())


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device=cuda was asked for but no CUDA GPU is available (use device=cpu)")
    return torch.device(name)


def _resolve_dtype(name: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        # fp32 on CPU (exact), except a GGUF, whose weights are already quantized: bf16 halves the bytes each
        # token reads, and on CPUs with AVX512-BF16 both prefill and decode run ~1.7x faster than fp32 (fp16
        # decodes faster still but prefills 3x slower: its matrix products have no fast CPU path).
        return torch.bfloat16 if config.source_format == "gguf" and _cpu_has_bf16() else torch.float32
    dtype = _DTYPES.get(config.torch_dtype.removeprefix("torch."), torch.bfloat16)
    return torch.bfloat16 if dtype == torch.float32 else dtype

