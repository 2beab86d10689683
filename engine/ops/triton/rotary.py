"""Rotary embedding (rotate-half layout) and Qwen3's fused per-head q/k RMSNorm + rotary, in one kernel.

Each program takes one token and every head of either q (axis 1 == 0) or k (axis 1 == 1). A head is loaded
as its two halves x1 = x[:D/2], x2 = x[D/2:], which is exactly the pair the rotation mixes, so no lane
shuffles are needed, and the RMS over the head is the sum over both halves. q and k may be strided views of
the fused qkv projection; the outputs are new contiguous [T, H, D] tensors, as the reference returns.

`rope_and_store_kv` is the decoder's form: the k program writes its rotated heads, and this token's v
heads, straight into the paged cache at the token's slot instead of returning k, which saves a kernel per
layer (a batch-1 decode step is ~250 kernels of a few microseconds each). An fp8 cache (--kv-cache-dtype fp8)
comes as bytes (kv_cache.kernel_view): the rotated k, rounded to its dtype as the reference rounds it, and v are
encoded as e4m3 there (KV_FP8).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.triton import pdl
from engine.ops.triton.kv_cache import kernel_view, to_cache


@triton.jit
def _rope_heads(x_ptr, out_ptr, out_off, stride_oh, valid, w_ptr, cos_ptr, sin_ptr, t, stride_xt, stride_xh,
                stride_ct, stride_st, eps, NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_HALF: tl.constexpr, NORM: tl.constexpr, DTYPE: tl.constexpr, KV_FP8: tl.constexpr):
    """Rotate (after the per-head RMSNorm if NORM) token t's heads of x; head h goes to out_ptr + out_off +
    h * stride_oh. Nothing is read or written unless `valid`. KV_FP8: out_ptr is an fp8 cache's bytes."""
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < HALF
    mask = valid & (heads[:, None] < NUM_HEADS) & col_mask[None, :]
    src = x_ptr + t.to(tl.int64) * stride_xt + heads[:, None] * stride_xh + cols[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = DTYPE   # the dtype the reference's rotation computes in (the output dtype of q or k)
    # Each product/sum below is rounded to `dtype` where torch rounds it (a no-op in fp32): the reference
    # computes in the tensor's dtype, so bf16 results match it bit for bit instead of within 1 ulp.
    if NORM:
        # RMSNorm over the head (fp32 math), rounded to q's dtype, times the weight in the output dtype.
        inv_rms = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        in_dtype = x_ptr.dtype.element_ty
        w1 = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + cols, mask=col_mask, other=0.0).to(tl.float32)
        x1 = (w1[None, :] * (x1 * inv_rms[:, None]).to(in_dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2[None, :] * (x2 * inv_rms[:, None]).to(in_dtype).to(tl.float32)).to(dtype).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_ct + cols, mask=col_mask, other=0.0).to(dtype).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * stride_st + cols, mask=col_mask, other=0.0).to(dtype).to(tl.float32)[None, :]
    o1 = (x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)
    o2 = (x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)
    dst = out_ptr + out_off + heads[:, None] * stride_oh + cols[None, :]
    tl.store(dst, to_cache(o1.to(dtype), out_ptr, KV_FP8), mask=mask)
    tl.store(dst + HALF, to_cache(o2.to(dtype), out_ptr, KV_FP8), mask=mask)


@triton.jit
def _qk_rope_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, v_out_ptr, slot_ptr, qw_ptr, kw_ptr,
                    cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_ct, stride_st, stride_cb, stride_cs, stride_ch, eps,
                    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
                    BLOCK_HALF: tl.constexpr, NORM: tl.constexpr, STORE: tl.constexpr,
                    Q_DTYPE: tl.constexpr, K_DTYPE: tl.constexpr, KV_FP8: tl.constexpr, GDC: tl.constexpr):
    # Grid (token, 2): program 0 rotates q into q_out. Program 1 rotates k: into k_out (contiguous [T, Hk, D]),
    # or with STORE into the paged cache k_out at the token's slot, copying v to v_out there too (slot -1:
    # padding, or KV already cached, writes nothing).
    pdl.start(GDC)   # between qkv_proj and decode attention
    t = tl.program_id(0)
    t64 = t.to(tl.int64)
    if tl.program_id(1) == 0:
        _rope_heads(q_ptr, q_out_ptr, t64 * NUM_Q_HEADS * 2 * HALF, 2 * HALF, True, qw_ptr, cos_ptr, sin_ptr, t,
                    stride_qt, stride_qh, stride_ct, stride_st, eps, NUM_Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF,
                    NORM, Q_DTYPE, False)
    elif STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        valid = slot >= 0
        slot = tl.where(valid, slot, 0)
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
        _rope_heads(k_ptr, k_out_ptr, dst, stride_ch, valid, kw_ptr, cos_ptr, sin_ptr, t,
                    stride_kt, stride_kh, stride_ct, stride_st, eps, NUM_K_HEADS, HALF, BLOCK_KH, BLOCK_HALF,
                    NORM, K_DTYPE, KV_FP8)
        heads = tl.arange(0, BLOCK_KH)
        cols = tl.arange(0, 2 * BLOCK_HALF)
        mask = valid & (heads[:, None] < NUM_K_HEADS) & (cols[None, :] < 2 * HALF)
        v = tl.load(v_ptr + t64 * stride_vt + heads[:, None] * stride_vh + cols[None, :], mask=mask)
        tl.store(v_out_ptr + dst + heads[:, None] * stride_ch + cols[None, :],
                 to_cache(v, v_out_ptr, KV_FP8), mask=mask)
    else:
        _rope_heads(k_ptr, k_out_ptr, t64 * NUM_K_HEADS * 2 * HALF, 2 * HALF, True, kw_ptr, cos_ptr, sin_ptr, t,
                    stride_kt, stride_kh, stride_ct, stride_st, eps, NUM_K_HEADS, HALF, BLOCK_KH, BLOCK_HALF,
                    NORM, K_DTYPE, False)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(q, k, q_weight, k_weight, eps, cos, sin, v=None, k_cache=None, v_cache=None, slot_mapping=None):
    """Rotated q, and rotated k (returned, or with k_cache given written to the cache with v instead)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    norm, store = q_weight is not None, k_cache is not None
    assert head_dim % 2 == 0 and k.shape[0] == num_tokens and k.shape[2] == head_dim
    q, k, cos, sin = (_unit_stride(x) for x in (q, k, cos, sin))
    # Output dtypes follow the reference's type promotion (the norm weight may be fp32 with bf16 q).
    q_dtype = torch.promote_types(q_weight.dtype, q.dtype) if norm else q.dtype
    k_dtype = torch.promote_types(k_weight.dtype, k.dtype) if norm else k.dtype
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q_dtype, device=q.device)
    if store:
        assert v.shape == k.shape and slot_mapping.numel() == num_tokens
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1, "caches must share one layout"
        (k_out, kv_fp8), (v_out, _) = kernel_view(k_cache), kernel_view(v_cache)
        v, slots = _unit_stride(v), slot_mapping
        cache_strides, block_size = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)), k_cache.shape[1]
    else:
        k_out = torch.empty((num_tokens, num_k_heads, head_dim), dtype=k_dtype, device=k.device)
        v, v_out, slots, cache_strides, block_size = k, k_out, q, (0, 0, 0), 1   # unused without STORE
        kv_fp8 = False
    if num_tokens:
        half = head_dim // 2
        _qk_rope_kernel[(num_tokens, 2)](
            q, k, v, q_out, k_out, v_out, slots, q_weight if norm else q, k_weight if norm else k, cos, sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            sin.stride(0), *cache_strides, eps,
            NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HALF=half, BLOCK_SIZE=block_size,
            BLOCK_QH=triton.next_power_of_2(num_q_heads), BLOCK_KH=triton.next_power_of_2(num_k_heads),
            BLOCK_HALF=triton.next_power_of_2(half), NORM=norm, STORE=store, Q_DTYPE=_TL_DTYPES[q_dtype],
            K_DTYPE=_TL_DTYPES[k_dtype], KV_FP8=kv_fp8, num_warps=4, **pdl.options(q.device, num_tokens),
        )
    return q_out, (None if store else k_out)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q: [T, Hq, D], k: [T, Hk, D], cos/sin: [T, D/2] -> new rotated (q, k)."""
    return _launch(q, k, None, None, 0.0, cos, sin)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 eps: float, cos: torch.Tensor, sin: torch.Tensor):
    """Per-head RMSNorm (q_norm / k_norm) then rotary, in one pass over q and k. Returns new (q, k)."""
    return _launch(q, k, q_weight, k_weight, eps, cos, sin)


def rope_and_store_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_weight=None, k_weight=None,
                      eps: float = 0.0) -> torch.Tensor:
    """Rotary (after the q/k RMSNorm when weights are given) for q and k, and k (rotated) and v written into
    the paged cache through slot_mapping. Returns the rotated q; see engine/ops/rotary.py for the reference."""
    return _launch(q, k, q_weight, k_weight, eps, cos, sin, v, k_cache, v_cache, slot_mapping)[0]


@triton.jit
def _vision_rope_kernel(qkv_ptr, cos_ptr, sin_ptr, stride_t, stride_c, stride_h, stride_ct, stride_st,
                        NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_HALF: tl.constexpr):
    # Grid (token, 2): q or k of one token, all heads, rotated in fp32 (no intermediate rounding, as the
    # reference) and written back in place; v is not touched. Each program reads its rows before writing them.
    t = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1)
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < NUM_HEADS) & (cols[None, :] < HALF)
    src = qkv_ptr + t * stride_t + which * stride_c + heads[:, None] * stride_h + cols[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    c = tl.load(cos_ptr + t * stride_ct + cols, mask=cols < HALF, other=0.0)[None, :]
    s = tl.load(sin_ptr + t * stride_st + cols, mask=cols < HALF, other=0.0)[None, :]
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(src, (a * c - b * s).to(x1.dtype), mask=mask)
    tl.store(src + HALF, (b * c + a * s).to(x1.dtype), mask=mask)


def vision_qkv_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """qkv [N, 3, H, D] -> (q, k, v) views of it, q and k rotated in place (see vision_qkv_rope_ref). In place,
    the three views share one layout, which the attention kernels take as they are: 2 x N x H x D elements
    read and written, where copying out contiguous q, k and v moved 3 x 2 (24.6 us per ViT layer on the H200)."""
    num_tokens, three, num_heads, head_dim = qkv.shape
    assert three == 3 and head_dim % 2 == 0 and qkv.stride(-1) == 1
    cos, sin = _unit_stride(cos), _unit_stride(sin)
    if num_tokens:
        half = head_dim // 2
        _vision_rope_kernel[(num_tokens, 2)](
            qkv, cos, sin, qkv.stride(0), qkv.stride(1), qkv.stride(2), cos.stride(0), sin.stride(0),
            NUM_HEADS=num_heads, HALF=half, BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_HALF=triton.next_power_of_2(half), num_warps=4)
    return qkv.unbind(1)
