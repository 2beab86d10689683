"""The engine's sizing rules that need no torch: the shapes CUDA graphs are captured at and the memory kept aside
under --gpu-memory-limit. The launcher's memory sum (app/memory_estimate.py) imports them, so the engine and the
launcher size the same graphs and the same slack; nothing here may import torch (the launcher runs without it).
"""
from __future__ import annotations

# Prefill CUDA graphs: one per token bucket, 8, 16 and 32 tokens, then every 64 up to 2048. The small buckets hold
# speculative verify steps (a few sequences of k + 1 tokens), which in a 64-token bucket would run the quantized
# linears at 64 rows. Padding (computed, then dropped) stays under 64 rows, 6% of a 1024-token prefill. A
# 1024x1024 image is 1024 tokens plus its question; with 128-token steps past 1024 it would run in the 1152
# bucket: 10% wasted GEMM work.
PREFILL_BUCKETS = (8, 16, 32) + tuple(range(64, 2049, 64))
# Sequences one prefill graph holds (the rest of its slots stay empty: no query rows, no context): a verify step
# of up to SpeculativeConfig.disable_by_batch_size - 1 requests (its default, 8), or a prefill chunk beside a few
# decodes, replays instead of paying ~400 eager launches.
GRAPH_SEQ_SLOTS = 8
# Vision CUDA graphs take images of up to this many patches: a 2048x2048 image (4096 tokens); larger ones run
# eagerly.
MAX_GRAPH_PATCHES = 16384
# Under a memory limit, room the profile does not see: blocks the caching allocator keeps split after the profiled
# step, so that a step's large transient tensor (a 4-bit layer's 192 MiB dequantized weight) needs a fresh
# segment. On an H200 capped at 8 GiB such a step failed with 256 MiB reserved but free and 0.12 GiB left under
# the cap.
LIMIT_SLACK_BYTES = 256 << 20


def batch_size_ladder(max_num_seqs: int) -> list[int]:
    """The decode CUDA graphs' batch sizes: 1, 2, 4, 8, then every 8 up to 64, every 16 up to 256, every 32
    beyond (vLLM-like), capped at max_num_seqs."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs]


def scratch_blocks_needed(block_size: int) -> int:
    """KV blocks the prefill graphs keep out of the pool: the dummy sequence's region, and a second one for the
    capture check."""
    return 2 * -(-PREFILL_BUCKETS[-1] // block_size)


def prefill_scratch_blocks(num_gpu_blocks: int, block_size: int) -> int:
    """The scratch blocks the prefill graphs take out of a profiled pool of num_gpu_blocks, or 0 where they would
    take half of it or more: then only the decode graphs are captured (they need none), since eager decode steps
    are ~10x slower and an eager prefill chunk only pays its launches once."""
    need = scratch_blocks_needed(block_size)
    return need if num_gpu_blocks > 2 * need else 0
