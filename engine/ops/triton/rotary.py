"""Rotary embedding (rotate-half layout) and Qwen3's fused per-head q/k RMSNorm + rotary, in one kernel.

Each program takes one token and every head of either q (axis 1 == 0) or k (axis 1 == 1). A head is loaded
as its two halves x1 = x[:D/2], x2 = x[D/2:], which is exactly the pair the rotation mixes, so no lane
shuffles are needed, and the RMS over the head is the sum over both halves. q and k may be strided views of
the fused qkv projection; the outputs are new contiguous [T, H, D] tensors, as the reference returns.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_heads(x_ptr, out_ptr, w_ptr, cos_ptr, sin_ptr, t, stride_xt, stride_xh, stride_ct, stride_st, eps,
                NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                NORM: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < HALF
    mask = (heads[:, None] < NUM_HEADS) & col_mask[None, :]
    src = x_ptr + t.to(tl.int64) * stride_xt + heads[:, None] * stride_xh + cols[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty  # the dtype the reference's rotation computes in
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
    dst = out_ptr + (t.to(tl.int64) * NUM_HEADS + heads[:, None]) * (2 * HALF) + cols[None, :]
    tl.store(dst, o1.to(dtype), mask=mask)
    tl.store(dst + HALF, o2.to(dtype), mask=mask)


@triton.jit
def _qk_rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st, eps,
                    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
                    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr, NORM: tl.constexpr):
    t = tl.program_id(0)
    if tl.program_id(1) == 0:
        _rope_heads(q_ptr, q_out_ptr, qw_ptr, cos_ptr, sin_ptr, t, stride_qt, stride_qh, stride_ct, stride_st,
                    eps, NUM_Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF, NORM)
    else:
        _rope_heads(k_ptr, k_out_ptr, kw_ptr, cos_ptr, sin_ptr, t, stride_kt, stride_kh, stride_ct, stride_st,
                    eps, NUM_K_HEADS, HALF, BLOCK_KH, BLOCK_HALF, NORM)


def _launch(q, k, q_weight, k_weight, eps, cos, sin, norm: bool):
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert head_dim % 2 == 0 and k.shape[0] == num_tokens and k.shape[2] == head_dim
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    # Output dtypes follow the reference's type promotion (the norm weight may be fp32 with bf16 q).
    q_dtype = torch.promote_types(q_weight.dtype, q.dtype) if norm else q.dtype
    k_dtype = torch.promote_types(k_weight.dtype, k.dtype) if norm else k.dtype
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q_dtype, device=q.device)
    k_out = torch.empty((num_tokens, num_k_heads, head_dim), dtype=k_dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _qk_rope_kernel[(num_tokens, 2)](
        q, k, q_out, k_out, q_weight if norm else q, k_weight if norm else k, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0), eps,
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HALF=half,
        BLOCK_QH=triton.next_power_of_2(num_q_heads), BLOCK_KH=triton.next_power_of_2(num_k_heads),
        BLOCK_HALF=triton.next_power_of_2(half), NORM=norm, num_warps=4,
    )
    return q_out, k_out


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q: [T, Hq, D], k: [T, Hk, D], cos/sin: [T, D/2] -> new rotated (q, k)."""
    return _launch(q, k, None, None, 0.0, cos, sin, norm=False)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 eps: float, cos: torch.Tensor, sin: torch.Tensor):
    """Per-head RMSNorm (q_norm / k_norm) then rotary, in one pass over q and k. Returns new (q, k)."""
    return _launch(q, k, q_weight, k_weight, eps, cos, sin, norm=True)
