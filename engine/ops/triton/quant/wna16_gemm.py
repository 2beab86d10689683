"""The 4-/8-bit GEMM for 2-64 tokens (and TUNED_W4G128's larger buckets; table.py): each K step loads a packed tile
(docs/QUANT_LAYOUTS.md) transposed, [BLOCK_N, BLOCK_KP], dequantizes its PACK planes (wna16_fields.plane: one LOP3
and one FMA per weight) and joins them along K into W^T [BLOCK_N, BLOCK_K] in x.dtype for one tensor-core dot.
SWAP_AB computes out^T = W^T x^T: the weight tile on the dot's M side, which on Hopper makes the dequantized weights
the wgmma's A operand, read from registers. Split-K partials end in splitk.splitk_epilogue.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.triton.quant.splitk import fit_split, grouped_tile, split_targets, splitk_epilogue
from engine.ops.triton.quant.table import KernelChoice, fit_block_k
from engine.ops.triton.quant.wna16_fields import ONE_BITS, plane


@triton.jit
def _dequant_wt(q, s, zs, one, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """Packed tile q [BN, BKP] -> W^T [BN, BK] in dtype, k = row * PACK + j: the planes joined along K (nested
    joins put plane j at position bitreverse(j), hence the order of the arguments)."""
    if BITS == 4:
        w0 = plane(q, 0, BITS, s, zs, one).to(dtype)
        w1 = plane(q, 1, BITS, s, zs, one).to(dtype)
        w2 = plane(q, 2, BITS, s, zs, one).to(dtype)
        w3 = plane(q, 3, BITS, s, zs, one).to(dtype)
        w4 = plane(q, 4, BITS, s, zs, one).to(dtype)
        w5 = plane(q, 5, BITS, s, zs, one).to(dtype)
        w6 = plane(q, 6, BITS, s, zs, one).to(dtype)
        w7 = plane(q, 7, BITS, s, zs, one).to(dtype)
        w = tl.join(tl.join(tl.join(w0, w4), tl.join(w2, w6)), tl.join(tl.join(w1, w5), tl.join(w3, w7)))
    else:
        w0 = plane(q, 0, BITS, s, zs, one).to(dtype)
        w1 = plane(q, 1, BITS, s, zs, one).to(dtype)
        w2 = plane(q, 2, BITS, s, zs, one).to(dtype)
        w3 = plane(q, 3, BITS, s, zs, one).to(dtype)
        w = tl.join(tl.join(w0, w2), tl.join(w1, w3))
    return tl.reshape(w, [BLOCK_N, BLOCK_K])


@triton.jit(do_not_specialize=["M", "K_SPLIT", "one"])
def _wna16_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, lock_ptr, M, N, K_SPLIT, one,
                       stride_xm, stride_qk, stride_sg, stride_om, BITS: tl.constexpr, GROUP: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       SWAP_AB: tl.constexpr, SPLIT: tl.constexpr, SERIAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                       EVEN_N: tl.constexpr):
    PACK: tl.constexpr = 32 // BITS
    BLOCK_KP: tl.constexpr = BLOCK_K // PACK
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.max_contiguous(tl.multiple_of(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), BLOCK_N), BLOCK_N)
    m_mask = offs_m < M
    n_mask = (offs_n < N) | EVEN_N
    k_begin = tl.multiple_of(pid_k * K_SPLIT, BLOCK_K)   # K_SPLIT is a multiple of BLOCK_K: aligned loads
    q_ptrs = qw_ptr + (k_begin // PACK + tl.arange(0, BLOCK_KP))[None, :].to(tl.int64) * stride_qk + offs_n[:, None]
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k_begin + tl.arange(0, BLOCK_K))[None, :]
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_begin + K_SPLIT, BLOCK_K):
        q = tl.load(q_ptrs, mask=n_mask[:, None], other=0)
        g_off = (k0 // GROUP) * stride_sg + offs_n   # scales are small: int32 offsets
        s = tl.load(s_ptr + g_off, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        zs = tl.load(z_ptr + g_off, mask=n_mask, other=0.0).to(tl.float32)[:, None] * s
        a = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        w = _dequant_wt(q, s, zs, one, BITS, BLOCK_N, BLOCK_K, dtype)
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(a), acc)
        else:
            acc = tl.dot(a, tl.trans(w), acc)
        q_ptrs += BLOCK_KP * stride_qk
        x_ptrs += BLOCK_K
    if SWAP_AB:
        res = tl.trans(acc)
    else:
        res = acc
    # The tile's lock: program_id(0) numbers the tiles once each (grouped_tile only reorders them).
    splitk_epilogue(res, offs_m, offs_n, M, N, stride_om, bias_ptr, out_ptr, ws_ptr, lock_ptr, tl.program_id(0),
                    pid_k, SPLIT, SERIAL, HAS_BIAS)


def wna16_gemm(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
               bits: int, bias: torch.Tensor | None, out: torch.Tensor, tiles: KernelChoice) -> torch.Tensor:
    """out [M, N] = x2 [M, K] @ W (+ bias); x2's last dim and the weights contiguous."""
    M, K = x2.shape
    N = qweight.shape[1]
    block_k = fit_block_k(tiles.block_k, group_size, 32 // bits)
    if block_k < 16:
        raise ValueError(f"the 4-bit GEMM needs a K step of at least 16 (group size {group_size})")
    split = fit_split(K // block_k, tiles.split_k)
    num_tiles = triton.cdiv(M, tiles.block_m) * triton.cdiv(N, tiles.block_n)
    to = split_targets(out, split, num_tiles, tiles.serial)
    _wna16_gemm_kernel[(num_tiles, split)](
        x2, qweight, scales, zeros, bias if bias is not None else out, out, to.ws, to.locks, M, N, K // split,
        ONE_BITS, x2.stride(0), qweight.stride(0), scales.stride(0), out.stride(0), BITS=bits, GROUP=group_size,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=block_k, GROUP_M=tiles.group_m, SWAP_AB=tiles.swap_ab,
        SPLIT=split, SERIAL=to.serial, HAS_BIAS=bias is not None, EVEN_N=N % tiles.block_n == 0,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    to.finish(bias, out)
    return out
