"""Writing this step's keys and values into the paged KV cache through the slot mapping.

The cache is in the model dtype or, with --kv-cache-dtype fp8, in float8_e4m3fn with a per-tensor scale of 1.0
(vLLM's behaviour for a checkpoint without k_scale/v_scale): values are rounded to nearest-even and saturated to
+-448 on the way in, and read back exactly (every e4m3 value is a bf16, fp16 and fp32 value)."""
from __future__ import annotations

import torch

from engine.ops.dispatch import use_triton

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0    # the largest finite e4m3fn value; beyond it the format has only NaN


def to_kv_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it. For fp8 the values are clamped first: an overflow then saturates to +-448, as
    vLLM's cache writes do, instead of depending on the cast's overflow behaviour (NaN in the e4m3fn format)."""
    if dtype == FP8_KV_DTYPE:
        return x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)
    return x.to(dtype)


def store_kvcache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hk, D]; caches: [num_blocks, block_size, Hk, D]; slot_mapping: [T] int, slot = block*bs + offset.
    A slot of -1 (padding in a CUDA-graph batch, or a token whose KV is already cached) is skipped."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    for x, cache in ((k, k_cache), (v, v_cache)):
        flat, src = cache.view(-1, *cache.shape[2:]), to_kv_cache_dtype(x[valid], cache.dtype)
        if cache.dtype == FP8_KV_DTYPE:      # torch has no CPU index_copy_ for float8: copy the bytes
            flat, src = flat.view(torch.uint8), src.view(torch.uint8)
        flat.index_copy_(0, slots, src)


def store_kvcache(k, v, k_cache, v_cache, slot_mapping) -> None:
    if use_triton(k):
        from engine.ops.triton import kv_cache
        return kv_cache.store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    return store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping)
