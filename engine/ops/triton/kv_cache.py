"""Writing this step's keys and values into the paged KV cache (Triton version of store_kvcache_ref)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                          stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_cb, stride_cs, stride_ch,
                          NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per token: all of its kv heads at once (Hk*D = 1024 elements for Qwen3-VL-8B), so each
    # head row is one contiguous 16-byte-vectorised copy. k/v may be strided views of the fused qkv output.
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # slot -1 (padding, or KV already cached): every access is masked off, so nothing is read or written.
    valid = slot >= 0
    safe_slot = tl.where(valid, slot, 0)
    dst = (safe_slot // BLOCK_SIZE) * stride_cb + (safe_slot % BLOCK_SIZE) * stride_cs

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = valid & (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    t64 = t.to(tl.int64)
    src_k = k_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = v_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst_off = dst + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    tl.store(k_cache_ptr + dst_off, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst_off, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hk, D]; caches: [num_blocks, block_size, Hk, D]; slot_mapping: [T] int (-1 = skip)."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1, "caches must share one dense layout"
    assert slot_mapping.numel() == num_tokens
    _store_kvcache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )
