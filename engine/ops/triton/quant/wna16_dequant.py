"""Dequantize-then-cuBLAS for the 4-/8-bit weights past the GEMM's token counts (table.py): one kernel writes the
whole [K, N] weight (docs/QUANT_LAYOUTS.md) in x.dtype, then torch.mm multiplies (compute-bound there, where
cuBLAS is fastest). The kernel splits a [BKP, BN] packed tile into its PACK bit-planes: plane j holds the
k = r * PACK + j and is stored to rows r * PACK + j (wna16_fields.dequant_plane: an OR and a subtract per weight).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.triton.quant.table import KernelChoice
from engine.ops.triton.quant.wna16_fields import dequant_plane, group_params


@triton.jit
def _wna16_dequant_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, N, stride_qk, stride_sg, BITS: tl.constexpr,
                          GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr):
    PACK: tl.constexpr = 32 // BITS
    PER_ROW: tl.constexpr = BLOCK_KP * PACK > GROUP
    kp0 = tl.program_id(0) * BLOCK_KP
    kp = kp0 + tl.arange(0, BLOCK_KP)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    q = tl.load(qw_ptr + kp[:, None].to(tl.int64) * stride_qk + offs_n[None, :], mask=n_mask[None, :], other=0)
    s, z = group_params(s_ptr, z_ptr, kp0, kp, offs_n, n_mask, stride_sg, PACK, GROUP, PER_ROW)
    for j in tl.static_range(PACK):
        w = (dequant_plane(q, j, BITS) - z) * s
        tl.store(w_ptr + (kp * PACK + j)[:, None].to(tl.int64) * N + offs_n[None, :],
                 w.to(w_ptr.dtype.element_ty), mask=n_mask[None, :])


def wna16_dequant_linear(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                         group_size: int, bits: int, bias: torch.Tensor | None, out: torch.Tensor,
                         tiles: KernelChoice) -> torch.Tensor:
    """out [M, N] = x2 [M, K] @ W (+ bias) through the dequantized weight; the weights contiguous."""
    K, N, pack = x2.shape[1], qweight.shape[1], 32 // bits
    block_k = tiles.block_k
    while K % block_k:
        block_k //= 2
    w = torch.empty((K, N), dtype=x2.dtype, device=x2.device)
    grid = (K // block_k, triton.cdiv(N, tiles.block_n))
    _wna16_dequant_kernel[grid](qweight, scales, zeros, w, N, qweight.stride(0), scales.stride(0), BITS=bits,
                                GROUP=group_size, BLOCK_N=tiles.block_n, BLOCK_KP=block_k // pack,
                                num_warps=tiles.num_warps)
    if bias is not None:
        return torch.addmm(bias.to(x2.dtype), x2, w, out=out)
    return torch.mm(x2, w, out=out)
