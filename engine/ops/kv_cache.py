"""Writing this step's keys and values into the paged KV cache through the slot mapping."""
from __future__ import annotations

import torch

from engine.ops.dispatch import use_triton


def store_kvcache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hk, D]; caches: [num_blocks, block_size, Hk, D]; slot_mapping: [T] int, slot = block*bs + offset.
    A slot of -1 (padding in a CUDA-graph batch, or a token whose KV is already cached) is skipped."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[valid].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[valid].to(v_cache.dtype))


def store_kvcache(k, v, k_cache, v_cache, slot_mapping) -> None:
    if use_triton(k):
        from engine.ops.triton import kv_cache
        return kv_cache.store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    return store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping)
