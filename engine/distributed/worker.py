"""One tensor-parallel rank: its share of the model, its KV cache and its runner (vLLM's Worker).

Rank 0's Worker lives inside LLMEngine (the engine process); ranks 1..N-1 run `run_worker` in the processes the
executor spawns. Every rank builds the same things in the same order, because the model's collectives (the
row-parallel all-reduces, the logits' all-gather) pair the ranks' calls one to one: the model and its weights,
the KV pool (each rank profiles its own capacity and all take the smallest), the CUDA graphs, then the steps.
A worker's step is rank 0's step replayed: it receives the SchedulerOutput, launches it on its own runner, and
receives the token ids rank 0 sampled (engine/runner.py), so that its pending inputs match rank 0's.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

import torch

from engine.args import EngineArgs
from engine.cache_engine import CacheEngine, resolve_kv_cache_dtype
from engine.config import ModelConfig
from engine.cuda_graphs import (cuda_graphs_wanted, enable_cuda_graphs, prefill_scratch_blocks,
                                 scratch_blocks_needed)
from engine.kv_sizing import KVCachePlan, plan_kv_cache
from engine.logger import init_logger
from engine.memory import apply_gpu_memory_limit, weights_out_of_memory
from engine.model.loader import build_model, load_weights
from engine.runner import ModelRunner

logger = init_logger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16, "float32": torch.float32,
           "float": torch.float32}
PARENT_POLL_S = 0.5


class Worker:
    """The model, KV cache and runner of one rank; the same object on rank 0 and in every worker process."""

    def __init__(self, args: EngineArgs, model_config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 image_processor=None):
        self.args = args
        self.model_config = model_config
        self.dtype = dtype
        self.kv_cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
        self.device = device
        self.image_processor = image_processor      # the largest image sizes the profiled step (kv_sizing)
        # Capped before the weights arrive, so that loading too runs as on a card of that size.
        self.gpu_memory_limit = apply_gpu_memory_limit(args.gpu_memory_limit, device)

    def load_model(self, max_len: int) -> None:
        try:
            self.model = build_model(self.model_config, max_len, self.dtype, self.device, self.args.cpu_embeddings)
            load_weights(self.model, self.args.model, self.args.load_format, self.device,
                         fp8_kv_cache=self.args.kv_cache_dtype != "auto")
            self.model.decoder.embed_tokens.check_host_lookup(self.device)
        except torch.cuda.OutOfMemoryError as err:
            if self.gpu_memory_limit is None:
                raise
            raise weights_out_of_memory(self.gpu_memory_limit, self.device, err) from None

    def init_kv_cache(self, max_len: int) -> KVCachePlan:
        """Size the pool (the same block counts on every rank), allocate it and build the runner."""
        args = self.args
        plan = plan_kv_cache(self, max_len)
        self.num_gpu_blocks, self.num_cpu_blocks = plan.num_gpu_blocks, plan.num_cpu_blocks
        self.use_graphs = cuda_graphs_wanted(args, self.device)
        # Prefill CUDA graphs write their padding rows' K/V to scratch blocks kept outside the pool: taken from
        # the profiled budget (none where the pool is too small, or under a limit that set no pool aside for
        # them: decode graphs only); an explicit num_gpu_blocks_override gets them on top.
        num_scratch = 0
        if self.use_graphs and args.num_gpu_blocks_override:
            num_scratch = scratch_blocks_needed(args.block_size)
        elif self.use_graphs and (plan.profile is None or plan.profile.prefill_graphs):
            num_scratch = prefill_scratch_blocks(self.num_gpu_blocks, args.block_size)
            self.num_gpu_blocks -= num_scratch
        self.scratch_blocks = list(range(self.num_gpu_blocks, self.num_gpu_blocks + num_scratch))
        self.max_model_len = min(max_len, self.num_gpu_blocks * args.block_size)
        self.cache = CacheEngine(self.model_config, self.num_gpu_blocks + num_scratch, self.num_cpu_blocks,
                                 args.block_size, self.kv_cache_dtype, self.device)
        self.runner = ModelRunner(self.model, self.model_config, self.cache, args.block_size, self.device,
                                  args.encoder_cache_size)
        return plan

    def capture_cuda_graphs(self) -> None:
        if self.use_graphs:
            enable_cuda_graphs(self)


def resolve_dtype(name: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        # fp32 on CPU (exact), except a GGUF, whose weights are already quantized: bf16 halves the bytes each
        # token reads, and on CPUs with AVX512-BF16 both prefill and decode run ~1.7x faster than fp32 (fp16
        # decodes faster still but prefills 3x slower: its matrix products have no fast CPU path).
        return torch.bfloat16 if config.source_format == "gguf" and _cpu_has_bf16() else torch.float32
    dtype = _DTYPES.get(config.torch_dtype.removeprefix("torch."), torch.bfloat16)
    return torch.bfloat16 if dtype == torch.float32 else dtype


def _cpu_has_bf16() -> bool:
    check = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(check and check())


# ---- the worker process ------------------------------------------------------------------------------------
def run_worker(rank: int, world_size: int, init_method: str, args: EngineArgs, device_type: str,
               parent_pid: int, log_files: list[str], num_threads: int | None) -> None:
    """Entry of worker process `rank` (1..N-1): build this rank's Worker, then replay rank 0's steps until
    rank 0 sends the end of the loop (None). Exits at once if rank 0 dies (it cannot send anything then)."""
    # Ctrl-C and a launcher's SIGTERM reach the engine's whole process group: rank 0 shuts down and stops its
    # workers itself (between steps, with nothing lost), or they exit when it is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _watch_parent(parent_pid)
    _setup_logging(rank, log_files)
    from engine.distributed.executor import STEP_WAIT_TIMEOUT_S
    from engine.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel

    if num_threads:
        torch.set_num_threads(num_threads)
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_tensor_parallel(rank, world_size, init_method, device, object_timeout_s=STEP_WAIT_TIMEOUT_S)
    worker = _build_worker(args, device)
    logger.info("tensor-parallel rank %d ready on %s: %d KV blocks", rank, device, worker.num_gpu_blocks)
    _step_loop(worker)
    destroy_tensor_parallel()


def _build_worker(args: EngineArgs, device: torch.device) -> Worker:
    from engine.model.loader import load_model_config

    config = load_model_config(args.model, args.quantization, args.load_format)
    image_processor = None
    if config.is_multimodal:      # for the images' pixels (ImageItem.to_pixels) and the profiled largest image
        from engine.inputs.image_processor import ImageProcessor
        kw = args.mm_processor_kwargs or {}
        image_processor = ImageProcessor.from_model_dir(args.model, min_pixels=kw.get("min_pixels"),
                                                        max_pixels=kw.get("max_pixels"))
    worker = Worker(args, config, resolve_dtype(args.dtype, config, device), device, image_processor)
    max_len = args.max_model_len or config.max_position_embeddings
    worker.load_model(max_len)
    worker.init_kv_cache(max_len)
    worker.capture_cuda_graphs()
    return worker


@torch.inference_mode()
def _step_loop(worker: Worker) -> None:
    from engine.distributed.parallel_state import broadcast_object

    runner, prev = worker.runner, None
    while True:
        so = broadcast_object(None)
        if so is None:                       # rank 0 is shutting down
            return
        for new in so.scheduled_new_reqs:    # rank 0 sends images without their pixel function (worker_view)
            for image in new.prompt.images:
                image.to_pixels = worker.image_processor.to_pixel_values
        if so.is_empty:                      # only requests to forget; rank 0 launched nothing either
            runner.update_states(so)
            prev = None
        else:
            prev = runner.launch(so, prev)


def _watch_parent(parent_pid: int) -> None:
    """A worker whose engine process died exits: no one is left to send it steps or to stop it."""
    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(0)
            time.sleep(PARENT_POLL_S)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _setup_logging(rank: int, log_files: list[str]) -> None:
    """The engine's log format with the rank in front, to the inherited stderr and to rank 0's log files."""
    from engine.logger import _DATEFMT, _FORMAT, add_log_file

    for path in log_files:
        add_log_file(path)
    formatter = logging.Formatter(f"(rank {rank} pid {os.getpid()}) {_FORMAT}", _DATEFMT)
    for handler in logging.getLogger("engine").handlers:
        handler.setFormatter(formatter)
