"""Deciding the KV pool size at start-up (GPU pool and CPU swap pool) and logging it the way vLLM users know."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import psutil
import torch

from engine.worker.cache_engine import CacheEngine
from engine.distributed.parallel_state import all_gather_object, get_tp_size
from engine.errors import ModelLoadError
from engine.logger import init_logger
from engine.sizing import LIMIT_SLACK_BYTES, PREFILL_BUCKETS, prefill_scratch_blocks
from engine.worker.memory import (GiB, MemoryProfile, check_weights_fit, cpu_kv_budget,
                                  encoder_cache_bytes, no_kv_room_message, non_torch_bytes, profile_cuda,
                                  steps_out_of_memory)

if TYPE_CHECKING:
    from engine.worker.worker import Worker

logger = init_logger(__name__)


@dataclass
class KVCachePlan:
    num_gpu_blocks: int
    num_cpu_blocks: int
    bytes_per_block: int
    source: str                          # how num_gpu_blocks was decided
    profile: MemoryProfile | None = None
    dtype: torch.dtype | None = None     # the KV cache dtype (--kv-cache-dtype)

    def log(self, worker: Worker) -> None:
        args, bs = worker.args, worker.args.block_size
        gpu_bytes, cpu_bytes = self.num_gpu_blocks * self.bytes_per_block, self.num_cpu_blocks * self.bytes_per_block
        logger.info("Using PagedAttention for KV cache.")
        logger.info("KV cache block size: %d tokens", bs)
        logger.info("KV cache dtype: %s (--kv-cache-dtype %s), %.1f KiB per token%s",
                    str(self.dtype).removeprefix("torch."), args.kv_cache_dtype, self.bytes_per_block / bs / 1024,
                    " on each rank" if get_tp_size() > 1 else "")
        per_rank = " on each of %d ranks" % get_tp_size() if get_tp_size() > 1 else ""
        logger.info("Total blocks allocated: %d (%.1f MB%s)", self.num_gpu_blocks, gpu_bytes / 2**20, per_rank)
        if self.profile is not None and self.profile.limit_bytes is not None:
            logger.info("GPU memory utilization: not used (--gpu-memory-limit %.2f GiB)",
                        self.profile.limit_bytes / GiB)
        elif worker.device.type == "cuda":
            logger.info("GPU memory utilization: %.2f", args.gpu_memory_utilization)
        else:
            logger.info("GPU memory utilization: %.2f (not used on CPU; KV pool from %s)",
                        args.gpu_memory_utilization, self.source)
        if self.profile is not None:
            p = self.profile
            cap = "" if p.limit_bytes is None else (
                f"; limit {p.limit_bytes / 1e9:.2f} GB ({p.limit_bytes / GiB:.2f} GiB): outside torch "
                f"{p.non_torch_bytes / 1e9:.2f} GB, CUDA graphs + encoder cache + slack {p.reserve_bytes / 1e9:.2f} GB")
            logger.info("Memory profile: weights %.2f GB, activation peak %.2f GB, KV cache %.2f GB of %.2f GB "
                        "total%s", p.weights_bytes / 1e9, p.activation_peak_bytes / 1e9, gpu_bytes / 1e9,
                        p.total_bytes / 1e9, cap)
        logger.info("CPU swap space: %d blocks (%.2f GiB)", self.num_cpu_blocks, cpu_bytes / GiB)
        logger.info("Maximum concurrency for %d tokens per request: %.2fx", worker.max_model_len,
                    self.num_gpu_blocks * bs / worker.max_model_len)


def plan_kv_cache(worker: Worker, max_len: int) -> KVCachePlan:
    """The pool of one rank's Worker (engine/worker/worker.py): profiled on CUDA, from --cpu-kv-cache-space
    on CPU, or as overridden; the same block counts on every rank."""
    args, cfg = worker.args, worker.model_config
    per_block = CacheEngine.bytes_per_block(cfg, args.block_size, worker.kv_cache_dtype)
    profile = None
    if args.num_gpu_blocks_override:
        num_gpu, source = args.num_gpu_blocks_override, "num_gpu_blocks_override"
    elif worker.device.type == "cuda":
        profile = _profile(worker, max_len, per_block)
        num_gpu = blocks_beside_draft_kv(worker, profile.kv_budget_bytes, per_block)
        source = "gpu_memory_utilization" if profile.limit_bytes is None else "gpu_memory_limit"
    else:
        budget = cpu_kv_budget(args.cpu_kv_cache_space)
        num_gpu = blocks_beside_draft_kv(worker, budget, per_block)
        source = f"cpu_kv_cache_space = {budget / GiB:.2f} GiB"
    swap_gib = args.swap_space if args.swap_space is not None else (4.0 if worker.device.type == "cuda" else 1.0)
    swap_bytes = min(int(swap_gib * GiB), psutil.virtual_memory().available // 2)
    num_gpu, num_cpu = _smallest_over_ranks(int(num_gpu), swap_bytes // per_block)
    if profile is not None:     # prefill graphs only where every rank set their pool aside
        profile = replace(profile, prefill_graphs=all(all_gather_object(profile.prefill_graphs)))
    if num_gpu < 1:
        if profile is not None:
            raise ModelLoadError(no_kv_room_message(profile, per_block, args.block_size))
        raise ModelLoadError(f"no memory left for the KV cache ({source}); lower max_num_batched_tokens, raise "
                             f"gpu_memory_utilization, or use a smaller model")
    return KVCachePlan(num_gpu, num_cpu, per_block, source, profile, worker.kv_cache_dtype)


def blocks_beside_draft_kv(worker: Worker, budget: int, per_block: int) -> int:
    """KV blocks that fit `budget` beside an EAGLE-3 drafter's own KV (engine/spec_decode/eagle3.py DraftKV):
    only running requests hold one (a preempted request's is forgotten), and each holds at most twice its
    context, grown by doubling from 16 rows, so the pool's tokens and the draft rows share the budget."""
    drafter = getattr(worker, "drafter", None)
    if drafter is None:
        return max(budget, 0) // per_block
    row = drafter.kv_bytes_per_token()
    left = budget - drafter.kv_min_rows * row * worker.args.max_num_seqs
    blocks = max(left, 0) // (per_block + 2 * row * worker.args.block_size)
    logger.info("EAGLE-3 draft KV: %.2f GB of the KV budget set aside (%d bytes a row, two rows per pooled token "
                "and %d per running request)", max(budget - blocks * per_block, 0) / 1e9, row,
                drafter.kv_min_rows)
    return blocks


def _smallest_over_ranks(num_gpu: int, num_cpu: int) -> tuple[int, int]:
    """Under tensor parallelism every rank holds the same blocks (its share of each block's KV heads): the pool
    is the smallest rank's. At TP=1 the counts as they are."""
    counts = all_gather_object((num_gpu, num_cpu))
    return min(c[0] for c in counts), min(c[1] for c in counts)


def _profile(worker: Worker, max_len: int, bytes_per_block: int) -> MemoryProfile:
    """The memory profile on CUDA: weights as loaded, then the profiled steps (and, under a limit, the reserve)."""
    args, dev, limit = worker.args, worker.device, worker.gpu_memory_limit
    weights = torch.cuda.memory_allocated(dev)
    if limit is not None:
        check_weights_fit(limit, weights, non_torch_bytes(dev))
    tokens = min(args.batched_tokens_budget, max_len)
    # Under a limit the largest prefill graph's step is measured too: it writes up to PREFILL_BUCKETS[-1] tokens.
    scratch_tokens = tokens if limit is None else max(tokens, min(PREFILL_BUCKETS[-1], max_len))
    try:
        # The profiled steps write their K/V here, outside the measured peaks: at run time the pool holds them.
        scratch = CacheEngine(worker.model_config, -(-scratch_tokens // args.block_size), 0, args.block_size,
                              worker.kv_cache_dtype, dev)
        reserve, decode_only = (0, 0) if limit is None else _limit_reserves(worker, max_len, scratch)
    except torch.cuda.OutOfMemoryError as err:
        if limit is None:
            raise
        raise steps_out_of_memory(limit, weights, err) from None
    profile = profile_cuda(lambda: _worst_case_step(worker, tokens, max_len, scratch), weights,
                           args.gpu_memory_utilization, dev, limit, reserve)
    del scratch
    torch.cuda.empty_cache()        # its freed segment would otherwise stay reserved beside the pool
    if limit is not None and not prefill_scratch_blocks(max(profile.kv_budget_bytes, 0) // bytes_per_block,
                                                        args.block_size):
        # The pool could not spare the prefill graphs' scratch blocks: the decode graphs alone, and only their
        # pool set aside.
        profile = replace(profile, reserve_bytes=decode_only, prefill_graphs=False,
                          kv_budget_bytes=profile.kv_budget_bytes + profile.reserve_bytes - decode_only)
    return profile


def _limit_reserves(worker: Worker, max_len: int, scratch: CacheEngine) -> tuple[int, int]:
    """Under a limit, what the utilization's headroom holds otherwise: the CUDA graph pools (when graphs will
    be captured), a full encoder cache and the allocator's slack (LIMIT_SLACK_BYTES); with the prefill graphs,
    and with the decode graphs alone."""
    from engine.worker.cuda_graphs import cuda_graphs_wanted

    fixed = encoder_cache_bytes(worker.model_config, worker.args.encoder_cache_size, worker.dtype) + \
        LIMIT_SLACK_BYTES
    if not cuda_graphs_wanted(worker.args, worker.device):
        return fixed, fixed
    from engine.sizing import batch_size_ladder
    fixed += _vision_graph_pool_bytes(worker, max_len)
    per_graph = _graph_outside_torch_bytes(worker, max_len, scratch)
    decode_graphs = len(batch_size_ladder(worker.args.max_num_seqs))
    return (fixed + _decoder_graph_pool_bytes(worker, max_len, scratch, prefill=True)
            + per_graph * (decode_graphs + len(PREFILL_BUCKETS)),
            fixed + _decoder_graph_pool_bytes(worker, max_len, scratch, prefill=False) + per_graph * decode_graphs)


@torch.inference_mode()
def _graph_outside_torch_bytes(worker: Worker, max_len: int, scratch: CacheEngine) -> int:
    """What one CUDA graph holds outside torch's allocator, which the graphs' pool leaves out and nvidia-smi
    counts: the instantiated graph (its nodes and their kernel parameters). Measured on a decode graph of the
    largest batch captured here on the scratch cache (the device's free memory lost, less what the allocator
    reserved); every graph runs the decoder's kernels, so it has about as many nodes. First, one eager decode
    step of every batch size: the kernels the decode graphs launch are loaded now (their code is device memory
    outside torch), so that the profile's outside-torch reading holds them too."""
    from engine.sizing import batch_size_ladder
    dev = worker.device
    ladder = batch_size_ladder(worker.args.max_num_seqs)
    for rows in ladder:
        _padded_decode_forward(worker, rows, max_len, scratch)
    torch.cuda.synchronize(dev)
    free, reserved = torch.cuda.mem_get_info(dev)[0], torch.cuda.memory_reserved(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _padded_decode_forward(worker, ladder[-1], max_len, scratch)
    torch.cuda.synchronize(dev)
    per_graph = max(free - torch.cuda.mem_get_info(dev)[0] - (torch.cuda.memory_reserved(dev) - reserved), 0)
    del graph
    torch.cuda.empty_cache()
    return per_graph


@torch.inference_mode()
def _decoder_graph_pool_bytes(worker: Worker, max_len: int, scratch: CacheEngine, prefill: bool) -> int:
    """The decoder graphs' private pool, measured on an eager run of its largest shape: the graphs share it,
    captured largest first (the 2048-token prefill bucket, or without prefill graphs the largest decode batch):
    that step's transient peak, plus every graph's output (each stays alive)."""
    from engine.sizing import batch_size_ladder

    itemsize = torch.tensor([], dtype=worker.dtype).element_size()
    ladder = batch_size_ladder(worker.args.max_num_seqs)
    rows = sum(ladder) + (sum(PREFILL_BUCKETS) if prefill else 0)
    largest = (lambda: _prefill_forward(worker, min(PREFILL_BUCKETS[-1], max_len), scratch)) if prefill else \
        (lambda: _padded_decode_forward(worker, ladder[-1], max_len, scratch))
    return _peak_bytes(largest, worker.device) + rows * worker.model_config.hidden_size * itemsize


@torch.inference_mode()
def _vision_graph_pool_bytes(worker: Worker, max_len: int) -> int:
    """The vision graphs' pool: the ViT's peak on the largest image a graph takes, plus that graph's static
    inputs (0 for a text-only model)."""
    from engine.worker.vision_graphs import MAX_GRAPH_PATCHES

    image = _largest_image(worker, max_len, MAX_GRAPH_PATCHES)
    if image is None:
        return 0
    pixels, grid = image
    itemsize = torch.tensor([], dtype=worker.dtype).element_size()
    static = pixels.shape[0] * (pixels.shape[1] + worker.model_config.vision.hidden_size) * itemsize
    return _peak_bytes(lambda: worker.model.encode_images(pixels, grid), worker.device) + static


def _peak_bytes(fn, device: torch.device) -> int:
    """Bytes the allocator reserves at the peak of fn() beyond what it held before."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_reserved(device)
    fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device) - before
    torch.cuda.empty_cache()
    return peak


def _largest_image(worker: Worker, max_len: int, max_patches: int | None = None):
    """Random pixels and grid of the largest image a request may carry (its tokens within max_len, its patches
    within max_patches), or None for a text-only model."""
    processor = worker.image_processor
    if processor is None:
        return None
    budget = min(processor.max_pixels, max_len * processor.factor ** 2)
    if max_patches is not None:
        budget = min(budget, max_patches * processor.patch_size ** 2)
    side = max(int(budget ** 0.5) // processor.factor, 1) * processor.factor
    h, w = processor.resized_size(side, side)
    t, gh, gw = processor.grid_thw(h, w)
    pixels = torch.randn(t * gh * gw, 3 * processor.temporal_patch_size * processor.patch_size ** 2,
                         device=worker.device)
    return pixels, torch.tensor([[t, gh, gw]])


@torch.inference_mode()
def _worst_case_step(worker: Worker, tokens: int, max_len: int, scratch: CacheEngine) -> None:
    """The largest step the scheduler can build: `tokens` (max_num_batched_tokens) prompt tokens through the
    decoder into the scratch KV cache, logits and top-p sampling for max_num_seqs rows, and the largest image
    through the ViT."""
    from engine.sampler import SamplingMetadata, sample

    args, dev = worker.args, worker.device
    hidden = _prefill_forward(worker, tokens, scratch)
    rows = min(args.max_num_seqs, tokens)
    logits = worker.model.compute_logits(hidden[-rows:])
    del hidden
    fake = SamplingMetadata(
        temperature=torch.ones(rows, device=dev), greedy=torch.zeros(rows, dtype=torch.bool, device=dev),
        all_greedy=False, top_k=None, top_p=torch.full((rows,), 0.9, device=dev), min_p=None, presence=None,
        frequency=None, repetition=None, output_ids=[[]] * rows, prompt_ids=[[]] * rows, banned=[], generators={},
        max_logprobs=None)
    sample(logits, fake)
    image = _largest_image(worker, max_len)
    if image is not None:
        # The largest image a request may carry is encoded in one piece (chunked prefill splits only its
        # placeholder tokens): profile the vision encoder on it.
        worker.model.encode_images(*image)


def _padded_decode_forward(worker: Worker, rows: int, max_len: int, scratch: CacheEngine) -> torch.Tensor:
    """A decode step of `rows` rows as a decode graph runs its padding rows (no K/V read or written), with block
    tables as wide as max_len."""
    from engine.worker.cuda_graphs import padded_decode_metadata

    cfg, dev, bs = worker.model_config, worker.device, worker.args.block_size
    md = padded_decode_metadata(torch.full((rows,), -1, dtype=torch.int64, device=dev),
                                torch.arange(rows + 1, dtype=torch.int32, device=dev),
                                torch.zeros(rows, dtype=torch.int32, device=dev),
                                torch.zeros(rows, -(-max_len // bs), dtype=torch.int32, device=dev), bs)
    positions = torch.zeros((3, rows) if cfg.mrope_section is not None else (rows,), dtype=torch.int64, device=dev)
    return worker.model(torch.zeros(rows, dtype=torch.int64, device=dev), positions, scratch.layer_caches(), md)


def _prefill_forward(worker: Worker, tokens: int, scratch: CacheEngine) -> torch.Tensor:
    """One sequence of `tokens` prompt tokens through the decoder into `scratch`; its hidden states."""
    from engine.ops import AttentionMetadata

    cfg, dev, bs = worker.model_config, worker.device, worker.args.block_size
    blocks = -(-tokens // bs)
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
    return worker.model(ids, positions, scratch.layer_caches(), md)
