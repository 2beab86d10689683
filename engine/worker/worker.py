"""One rank's worker (vLLM's Worker): its share of the model, its KV cache, its runner and CUDA graphs.

The executor holds rank 0's Worker in the engine process (engine/executor/); under tensor parallelism ranks
1..N-1 build theirs in the processes it spawns. Every rank builds the same things in the same order, because the
model's collectives (the row-parallel all-reduces, the logits' all-gather) pair the ranks' calls one to one: the
model and its weights, the KV pool (each rank profiles its own capacity and all take the smallest), the CUDA
graphs, then the steps. A worker's step is rank 0's step replayed: it receives the SchedulerOutput, launches it
on its own runner, and receives the token ids rank 0 sampled, so that its pending inputs match rank 0's.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from engine import load_progress
from engine.args import EngineArgs
from engine.worker.cache_engine import CacheEngine, resolve_kv_cache_dtype
from engine.config import ModelConfig
from engine.worker.cuda_graphs import cuda_graphs_wanted, enable_cuda_graphs
from engine.core.scheduler_output import SchedulerOutput
from engine.distributed.parallel_state import get_tp_rank
from engine.logger import init_logger
from engine.model.loader import build_model, load_weights
from engine.sizing import prefill_scratch_blocks, scratch_blocks_needed
from engine.structured_output import Grammar
from engine.worker.inflight import InflightStep
from engine.worker.kv_sizing import plan_kv_cache
from engine.worker.memory import GiB, apply_gpu_memory_limit, hold_to_limit, weights_out_of_memory
from engine.worker.model_runner import ModelRunner

logger = init_logger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16, "float32": torch.float32,
           "float": torch.float32}


@dataclass(frozen=True)
class KVCacheConfig:
    """What the engine core learns of the workers' KV pools (the same on every rank) at start-up."""
    num_gpu_blocks: int
    num_cpu_blocks: int
    bytes_per_block: int           # one rank's bytes of one block
    cache_dtype: torch.dtype
    max_model_len: int             # the longest sequence the pool can hold (at most the model's)
    gpu_memory_limit: int | None   # --gpu-memory-limit in bytes, as applied


class Worker:
    """The model, KV cache and runner of one rank; the same class on rank 0 and in every worker process.
    `image_processor` gives the images' pixels and the largest image the profiled step holds (kv_sizing);
    `grammars` is rank 0's registry of structured-output matchers (ModelRunner)."""

    def __init__(self, args: EngineArgs, model_config: ModelConfig, device: torch.device,
                 image_processor=None, grammars: dict[str, Grammar] | None = None):
        self.args = args
        self.model_config = model_config
        self.dtype = resolve_dtype(args.dtype, model_config, device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, self.dtype)
        self.device = device
        self.image_processor = image_processor
        self.grammars = grammars
        self.rank = get_tp_rank()
        if args.seed is not None:
            set_random_seed(args.seed)
        # Capped before the weights arrive, so that loading too runs as on a card of that size.
        self.gpu_memory_limit = apply_gpu_memory_limit(args.gpu_memory_limit, device)

    def initialize(self) -> KVCacheConfig:
        """Load the model, size and allocate the KV pool, capture the CUDA graphs: the rank ready for steps."""
        max_len = self.args.max_model_len or self.model_config.max_position_embeddings
        load_progress.report("building the model", 0.03)
        self.load_model(max_len)
        load_progress.report("sizing the KV cache", 0.87)
        self.init_kv_cache(max_len)
        if self.max_model_len < max_len and self.rank == 0:
            under = "" if self.gpu_memory_limit is None else \
                f" under --gpu-memory-limit {self.gpu_memory_limit / GiB:.2f} GiB"
            logger.warning("max_model_len reduced from %d to %d: the KV pool holds %d tokens%s", max_len,
                           self.max_model_len, self.num_gpu_blocks * self.args.block_size, under)
        if self.use_graphs:
            load_progress.report("capturing CUDA graphs", 0.9)
            enable_cuda_graphs(self)
        elif self.device.type == "cuda":
            logger.info("CUDA graphs off (--enforce-eager, or no Triton): eager steps")
        if self.gpu_memory_limit is not None and self.device.type == "cuda":
            hold_to_limit(self.gpu_memory_limit, self.device)
        return KVCacheConfig(self.num_gpu_blocks, self.num_cpu_blocks, self.bytes_per_block, self.kv_cache_dtype,
                             self.max_model_len, self.gpu_memory_limit)

    def execute_model(self, so: SchedulerOutput) -> InflightStep:
        return self.model_runner.launch(so)

    def encoder_cache_stats(self) -> dict:
        enc = self.model_runner.encoder_cache
        return {"encoder_cache_hits": enc.hits, "encoder_cache_misses": enc.misses,
                "encoder_cache_entries": len(enc.entries)}

    def load_model(self, max_len: int) -> None:
        try:
            self.model = build_model(self.model_config, max_len, self.dtype, self.device, self.args.cpu_embeddings)
            if self.args.quantize_lm_head and self.device.type == "cpu":
                logger.warning("--quantize-lm-head on the CPU: the logits are computed by dequantizing the lm_head "
                               "at every step, slower than without the flag (it is meant for GPUs)")
            load_weights(self.model, self.args.model, self.args.load_format, self.device,
                         fp8_kv_cache=self.args.kv_cache_dtype != "auto", quantize_lm_head=self.args.quantize_lm_head)
            self.model.decoder.embed_tokens.check_host_lookup(self.device)
            self.drafter = self._load_drafter()
        except torch.cuda.OutOfMemoryError as err:
            if self.gpu_memory_limit is None:
                raise
            raise weights_out_of_memory(self.gpu_memory_limit, self.device, err) from None

    def _load_drafter(self):
        """The EAGLE-3 draft head on the sampling rank (loaded before the KV pool is sized, so its weights are
        counted), and the target's capture of the hidden states it reads; None without one."""
        spec = self.args.speculative_config
        if spec is None or spec.method != "eagle3" or self.rank != 0:
            return None
        from engine.spec_decode.eagle3_proposer import Eagle3Proposer
        drafter = Eagle3Proposer(spec.model, self.model, self.device, self.dtype, spec.num_speculative_tokens)
        self.model.decoder.aux_hidden_state_layers = drafter.aux_layer_ids
        return drafter

    def init_kv_cache(self, max_len: int) -> None:
        """Size the pool (the same block counts on every rank), allocate it and build the runner."""
        args = self.args
        plan = plan_kv_cache(self, max_len)
        self.num_gpu_blocks, self.num_cpu_blocks = plan.num_gpu_blocks, plan.num_cpu_blocks
        self.bytes_per_block = plan.bytes_per_block
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
        self.model_runner = ModelRunner(self.model, self.model_config, self.cache, args.block_size, self.device,
                                        args.encoder_cache_size, self.image_processor, self.grammars,
                                        drafter=getattr(self, "drafter", None))
        if self.rank == 0:          # the same pool on every rank: logged once
            plan.log(self)


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


def set_random_seed(seed: int) -> None:
    """--seed: every random draw of the process starts from it (vLLM's meaning), so the same requests in the
    same order sample the same tokens after a restart. A request's own seed still gives it its own generator."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
