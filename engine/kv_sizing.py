"""Deciding the KV pool size at start-up (GPU pool and CPU swap pool) and logging it the way vLLM users know."""
from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from engine.cache_engine import CacheEngine
from engine.errors import ModelLoadError
from engine.logger import init_logger
from engine.memory import GiB, MemoryProfile, cpu_kv_budget, profile_cuda

logger = init_logger(__name__)


@dataclass
class KVCachePlan:
    num_gpu_blocks: int
    num_cpu_blocks: int
    bytes_per_block: int
    source: str                          # how num_gpu_blocks was decided
    profile: MemoryProfile | None = None

    def log(self, engine) -> None:
        args, bs = engine.args, engine.args.block_size
        gpu_bytes, cpu_bytes = self.num_gpu_blocks * self.bytes_per_block, self.num_cpu_blocks * self.bytes_per_block
        logger.info("Using PagedAttention for KV cache.")
        logger.info("KV cache block size: %d tokens", bs)
        logger.info("Total blocks allocated: %d (%.1f MB)", self.num_gpu_blocks, gpu_bytes / 2**20)
        if engine.device.type == "cuda":
            logger.info("GPU memory utilization: %.2f", args.gpu_memory_utilization)
        else:
            logger.info("GPU memory utilization: %.2f (not used on CPU; KV pool from %s)",
                        args.gpu_memory_utilization, self.source)
        if self.profile is not None:
            p = self.profile
            logger.info("Memory profile: weights %.2f GB, activation peak %.2f GB, KV cache %.2f GB of %.2f GB "
                        "total", p.weights_bytes / 1e9, p.activation_peak_bytes / 1e9, gpu_bytes / 1e9,
                        p.total_bytes / 1e9)
        logger.info("CPU swap space: %d blocks (%.2f GiB)", self.num_cpu_blocks, cpu_bytes / GiB)
        logger.info("Maximum concurrency for %d tokens per request: %.2fx", engine.max_model_len,
                    self.num_gpu_blocks * bs / engine.max_model_len)


def plan_kv_cache(engine, max_len: int) -> KVCachePlan:
    args, cfg = engine.args, engine.model_config
    per_block = CacheEngine.bytes_per_block(cfg, args.block_size, engine.dtype)
    profile = None
    if args.num_gpu_blocks_override:
        num_gpu, source = args.num_gpu_blocks_override, "num_gpu_blocks_override"
    elif engine.device.type == "cuda":
        weights = torch.cuda.memory_allocated(engine.device)
        profile = profile_cuda(lambda: _worst_case_step(engine, max_len), weights,
                               args.gpu_memory_utilization, engine.device)
        num_gpu, source = profile.kv_budget_bytes // per_block, "gpu_memory_utilization"
    else:
        budget = cpu_kv_budget(args.cpu_kv_cache_space)
        num_gpu, source = budget // per_block, f"cpu_kv_cache_space = {budget / GiB:.2f} GiB"
    if num_gpu < 1:
        raise ModelLoadError(f"no memory left for the KV cache ({source}); lower max_num_batched_tokens, raise "
                             f"gpu_memory_utilization, or use a smaller model")
    swap_gib = args.swap_space if args.swap_space is not None else (4.0 if engine.device.type == "cuda" else 1.0)
    swap_bytes = min(int(swap_gib * GiB), psutil.virtual_memory().available // 2)
    return KVCachePlan(int(num_gpu), swap_bytes // per_block, per_block, source, profile)


@torch.inference_mode()
def _worst_case_step(engine, max_len: int) -> None:
    """The largest step the scheduler can build: max_num_batched_tokens prompt tokens through the decoder into a
    scratch KV cache, logits and top-p sampling for max_num_seqs rows, and the largest image through the ViT."""
    from engine.ops import AttentionMetadata
    from engine.sampler import SamplingMetadata, sample

    args, cfg, dev, bs = engine.args, engine.model_config, engine.device, engine.args.block_size
    tokens = min(args.batched_tokens_budget, max_len)
    blocks = -(-tokens // bs)
    scratch = CacheEngine(cfg, blocks, 0, bs, engine.dtype, dev)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), device=dev)
    positions = torch.arange(tokens, device=dev)
    if cfg.mrope_section is not None:
        positions = positions.expand(3, -1)
    md = AttentionMetadata(
        slot_mapping=torch.arange(tokens, device=dev), query_start_loc=torch.tensor([0, tokens], dtype=torch.int32,
                                                                                    device=dev),
        seq_lens=torch.tensor([tokens], dtype=torch.int32, device=dev),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=dev)[None], num_decodes=0, num_decode_tokens=0,
        max_query_len=tokens, max_seq_len=tokens, query_start_loc_cpu=[0, tokens], seq_lens_cpu=[tokens])
    hidden = engine.model(ids, positions, scratch.layer_caches(), md)
    rows = min(args.max_num_seqs, tokens)
    logits = engine.model.compute_logits(hidden[-rows:])
    del hidden, scratch
    fake = SamplingMetadata(
        temperature=torch.ones(rows, device=dev), greedy=torch.zeros(rows, dtype=torch.bool, device=dev),
        all_greedy=False, top_k=None, top_p=torch.full((rows,), 0.9, device=dev), min_p=None, presence=None,
        frequency=None, repetition=None, output_ids=[[]] * rows, prompt_ids=[[]] * rows, banned=[], generators={},
        max_logprobs=None)
    sample(logits, fake)
    processor = engine.input_processor.image_processor
    if processor is not None:
        # The largest image a request may carry is encoded in one piece (chunked prefill splits only its
        # placeholder tokens): profile the vision encoder on it.
        side = int(min(processor.max_pixels, max_len * processor.factor ** 2) ** 0.5) // processor.factor
        side = max(side, 1) * processor.factor
        h, w = processor.resized_size(side, side)
        t, gh, gw = processor.grid_thw(h, w)
        pixels = torch.randn(t * gh * gw, 3 * processor.temporal_patch_size * processor.patch_size ** 2, device=dev)
        engine.model.encode_images(pixels, torch.tensor([[t, gh, gw]]))
