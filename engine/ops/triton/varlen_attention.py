"""The vision encoder's non-causal varlen attention (each image's patches attend to each other), on contiguous
q/k/v. Semantics: varlen_attention_ref in engine/ops/attention.py. The online-softmax loop is attention.py's
`attend`; a head width that is not a power of two (Qwen3-VL's 72) runs split in two power-of-two parts
(`_attend_split`) instead of padded to the next power of two.

One segment over all rows (a single image, as most requests send) goes to cuDNN's fused attention instead on
Hopper, where it is faster: 211 against 252 us for 4096 patches x 16 heads x 72 on the H200
(bench/image_gpu_parts.py; torch's FlashAttention takes 338 us), 1.1 ms of a 1024x1024 image's 27 layers.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import triton
import triton.language as tl

from engine.ops.triton import attention as paged   # tile_config is read at call time (bench sweeps patch it)
from engine.ops.triton.attention import LOG2E, attend, dot_precision, softmax_step

MIN_CUDNN_ROWS = 256          # a tiny segment gains nothing from cuDNN (and one row has no cuDNN kernel)


@triton.jit
def _segment_block(cu_ptr, stride_qh, stride_kh, stride_oh, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   ALIGN: tl.constexpr):
    """Where this program works. Grid (query block, segment, head); max_seqlen sizes axis 0, so blocks past a
    short segment get kv_hi 0 and exit idle. Returns the head offsets of q, k and out, the segment's first
    row, its query rows and their mask, and the key range: [0, full_hi) whole tiles, [full_hi, kv_hi) the
    ragged last one."""
    m0 = tl.program_id(0) * BLOCK_M
    seg = tl.program_id(1)
    head = tl.program_id(2)
    # Head offsets are multiples of ALIGN elements (host-checked). With head_dim 72 the head stride (72) is
    # no multiple of 16, so without the hint the compiler cannot prove 16-byte alignment and falls back to
    # narrow, unpipelined loads.
    q_head = tl.multiple_of(head * stride_qh, ALIGN)
    k_head = tl.multiple_of(head * stride_kh, ALIGN)
    o_head = tl.multiple_of(head * stride_oh, ALIGN)
    start = tl.load(cu_ptr + seg)
    seg_len = tl.load(cu_ptr + seg + 1) - start
    offs_m = m0 + tl.arange(0, BLOCK_M)
    kv_hi = tl.where(m0 < seg_len, seg_len, 0)
    return (q_head, k_head, o_head, start, (start + offs_m).to(tl.int64), offs_m < seg_len, kv_hi,
            kv_hi // BLOCK_N * BLOCK_N)


@triton.jit
def _varlen_kernel(q_ptr, k_ptr, v_ptr, cu_ptr, out_ptr, qk_scale,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   ALIGN: tl.constexpr, DOT_PREC: tl.constexpr):
    q_head, k_head, o_head, start, q_rows, m_mask, kv_hi, full_hi = _segment_block(
        cu_ptr, stride_qh, stride_kh, stride_oh, BLOCK_M, BLOCK_N, ALIGN)
    offs_m = tl.arange(0, BLOCK_M)   # the rows' own positions: the attend loop's q_pos, unused without CAUSAL
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM  # head_dim 72 runs padded to 128: zero columns add nothing to q.k
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + q_head + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    kv_off = start.to(tl.int64) * stride_kt + k_head
    # Whole tiles without a mask, then the segment's ragged last tile with one.
    acc, m_i, l_i = attend(acc, m_i, l_i, q, k_ptr + kv_off, v_ptr + kv_off, k_ptr, 0, full_hi, offs_m,
                            qk_scale, 0, stride_kt, offs_d, d_mask, 1, BLOCK_N,
                            PAGED=False, MASKED=False, CAUSAL=False, DOT_PREC=DOT_PREC,
                            KV_FP8=False, FP8_NATIVE=False, FP8_PACKED=False)
    acc, m_i, l_i = attend(acc, m_i, l_i, q, k_ptr + kv_off, v_ptr + kv_off, k_ptr, full_hi, kv_hi, offs_m,
                            qk_scale, 0, stride_kt, offs_d, d_mask, 1, BLOCK_N,
                            PAGED=False, MASKED=True, CAUSAL=False, DOT_PREC=DOT_PREC,
                            KV_FP8=False, FP8_NATIVE=False, FP8_PACKED=False)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + o_head + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _attend_split(acc0, acc1, m_i, l_i, q0, q1, k_ptr, v_ptr, n_lo, n_hi, qk_scale, stride_s, offs_d0, offs_d1,
                  d1_mask, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_PREC: tl.constexpr):
    """attend for contiguous keys with the head dimension in two power-of-two parts, [0, D0) and [D0, D0 + D1)
    (masked past HEAD_DIM): a head of 72 runs as 64 + 16 columns instead of padded to 128."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(n_lo, n_hi, BLOCK_N):
        pos = start_n + offs_n
        n_mask = pos < n_hi
        row = pos.to(tl.int64) * stride_s
        k0 = tl.load(k_ptr + row[:, None] + offs_d0[None, :], mask=n_mask[:, None], other=0.0)
        k1 = tl.load(k_ptr + row[:, None] + offs_d1[None, :], mask=n_mask[:, None] & d1_mask[None, :], other=0.0)
        s = tl.dot(q0, tl.trans(k0), input_precision=DOT_PREC)
        s = tl.dot(q1, tl.trans(k1), s, input_precision=DOT_PREC) * qk_scale
        if MASKED:
            s = tl.where(n_mask[None, :], s, float("-inf"))
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i)
        v0 = tl.load(v_ptr + row[:, None] + offs_d0[None, :], mask=n_mask[:, None], other=0.0)
        v1 = tl.load(v_ptr + row[:, None] + offs_d1[None, :], mask=n_mask[:, None] & d1_mask[None, :], other=0.0)
        p = p.to(v0.dtype)
        acc0 = acc0 * alpha[:, None] + tl.dot(p, v0, input_precision=DOT_PREC)
        acc1 = acc1 * alpha[:, None] + tl.dot(p, v1, input_precision=DOT_PREC)
    return acc0, acc1, m_i, l_i


@triton.jit
def _varlen_split_kernel(q_ptr, k_ptr, v_ptr, cu_ptr, out_ptr, qk_scale,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh,
                         HEAD_DIM: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, ALIGN: tl.constexpr, DOT_PREC: tl.constexpr):
    # _varlen_kernel with the head split in D0 + D1 columns (see _attend_split); same grid and masking.
    q_head, k_head, o_head, start, q_rows, m_mask, kv_hi, full_hi = _segment_block(
        cu_ptr, stride_qh, stride_kh, stride_oh, BLOCK_M, BLOCK_N, ALIGN)
    offs_d0 = tl.arange(0, D0)
    offs_d1 = D0 + tl.arange(0, D1)
    d1_mask = offs_d1 < HEAD_DIM
    q_base = q_ptr + q_rows[:, None] * stride_qt + q_head
    q0 = tl.load(q_base + offs_d0[None, :], mask=m_mask[:, None], other=0.0)
    q1 = tl.load(q_base + offs_d1[None, :], mask=m_mask[:, None] & d1_mask[None, :], other=0.0)
    acc0 = tl.zeros([BLOCK_M, D0], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_M, D1], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    kv_off = start.to(tl.int64) * stride_kt + k_head
    acc0, acc1, m_i, l_i = _attend_split(acc0, acc1, m_i, l_i, q0, q1, k_ptr + kv_off, v_ptr + kv_off, 0, full_hi,
                                         qk_scale, stride_kt, offs_d0, offs_d1, d1_mask, BLOCK_N,
                                         MASKED=False, DOT_PREC=DOT_PREC)
    acc0, acc1, m_i, l_i = _attend_split(acc0, acc1, m_i, l_i, q0, q1, k_ptr + kv_off, v_ptr + kv_off, full_hi,
                                         kv_hi, qk_scale, stride_kt, offs_d0, offs_d1, d1_mask, BLOCK_N,
                                         MASKED=True, DOT_PREC=DOT_PREC)
    l_safe = tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_base = out_ptr + q_rows[:, None] * stride_ot + o_head
    tl.store(o_base + offs_d0[None, :], (acc0 / l_safe).to(out_ptr.dtype.element_ty), mask=m_mask[:, None])
    tl.store(o_base + offs_d1[None, :], (acc1 / l_safe).to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & d1_mask[None, :])


def _head_split(head_dim: int) -> tuple[int, int] | None:
    """(D0, D1) when a head that is not a power of two is cheaper as two power-of-two parts than padded to
    the next one (72 -> 64 + 16 = 80 columns instead of 128); None otherwise."""
    if head_dim & (head_dim - 1) == 0 or head_dim < 32:
        return None
    d0 = triton.next_power_of_2(head_dim) // 2
    return d0, max(16, triton.next_power_of_2(head_dim - d0))


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, scale: float) -> torch.Tensor:
    """Bidirectional attention within each segment [cu_seqlens[i], cu_seqlens[i+1]). q, k, v: [N, H, D]."""
    num_tokens, num_heads, head_dim = q.shape
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    if k.stride() != v.stride():  # the kernel addresses k and v with one set of strides
        k, v = k.contiguous(), v.contiguous()
    num_segments = cu_seqlens.numel() - 1
    if (num_segments == 1 and max_seqlen == num_tokens >= MIN_CUDNN_ROWS
            and paged.cudnn_attention_usable(q.dtype, head_dim, q.device)):
        try:
            return _one_segment_cudnn(q, k, v, scale)
        except RuntimeError:   # "No available kernel": cuDNN refuses some shapes; the Triton kernel takes all
            pass
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_segments <= 0 or max_seqlen <= 0:
        return out
    block_d = paged.padded_head_dim(head_dim)
    split = _head_split(head_dim)
    block_m, block_n, warps, stages = paged.tile_config(sum(split) if split else block_d, q.dtype, q.device)
    grid = (triton.cdiv(max_seqlen, block_m), num_segments, num_heads)
    common = (q, k, v, cu_seqlens, out, scale * LOG2E,
              q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0), out.stride(1))
    align = math.gcd(16, q.stride(1), k.stride(1), out.stride(1))
    if split:
        _varlen_split_kernel[grid](*common, HEAD_DIM=head_dim, D0=split[0], D1=split[1], BLOCK_M=block_m,
                                   BLOCK_N=block_n, ALIGN=align, DOT_PREC=dot_precision(q.dtype),
                                   num_warps=warps, num_stages=stages)
    else:
        _varlen_kernel[grid](*common, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
                             ALIGN=align, DOT_PREC=dot_precision(q.dtype), num_warps=warps, num_stages=stages)
    return out


def _one_segment_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Every row attends to every row: [N, H, D] -> [N, H, D] (a transposed view of cuDNN's output)."""
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), scale=scale)
    return out[0].transpose(0, 1)
