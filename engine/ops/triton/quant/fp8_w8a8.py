"""FP8 block weights (docs/QUANT_LAYOUTS.md) on FP8 tensor cores (W8A8; table.py: sm89+): activations quantized to
e4m3 per token and group of bk (the checkpoints' dynamic activation scheme: scale = amax / 448), then a
block-scaled product.
- `w8a8_one_launch` (Hopper, up to 16 tokens): `_w8a8_one_launch_kernel` quantizes its rows of x inside the K loop
  (the same e4m3 values and scales as `_fp8_act_quant_kernel`), puts the weight tile on the dot's M side
  (swap-AB: Hopper's wgmma takes M in 64-row steps, so a 16-token tile would otherwise run as an fp16 mma with its
  e4m3 operands converted) and splits K to fill the GPU; a programmatic dependent launch at one token (pdl.py).
- `cublas_w8a8` (Hopper, more tokens): `per_token_group_quant`, then torch._scaled_mm with 1x128 activation and
  128x128 weight scales.
- `w8a8`: `per_token_group_quant`, then Triton's `_w8a8_block_kernel` (sm89; Hopper where cuBLAS refuses).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.triton import pdl
from engine.ops.triton.quant.splitk import fit_split, grouped_tile, split_targets, splitk_epilogue, tile_offsets
from engine.ops.triton.quant.table import CUBLAS_REFUSED, KernelChoice

FP8_MAX = tl.constexpr(448.0)
CUBLAS_ROW_ALIGN = 8     # cuBLAS refuses 1x128 activation scales for token counts that are not a multiple


@triton.jit(do_not_specialize=["M"])
def _fp8_act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_sm, stride_sg, GROUP: tl.constexpr,
                          GROUPS_PER_PROG: tl.constexpr):
    # One token, GROUPS_PER_PROG groups of GROUP: scale = amax / 448 (>= 1e-10 / 448), q = x / scale.
    # Rows past M (padding that cuBLAS needs) quantize zeros.
    m = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = cols < K
    x = tl.load(x_ptr + m * stride_xm + cols, mask=mask & (m < M), other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) / FP8_MAX
    q = tl.clamp(x / scale[:, None], -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + m * K + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + m * stride_sm + g * stride_sg, scale, mask=g * GROUP < K)


@triton.jit(do_not_specialize=["M"])
def _w8a8_block_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, M, N, K, stride_asm, stride_asg,
                       stride_bn, stride_bsn, stride_bsk, BN_BLK: tl.constexpr, BK_BLK: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                       HAS_BIAS: tl.constexpr):
    # C[M, N] = sum over K blocks of (A_q @ B_q^T)_block * a_scale[m, kb] * b_scale[n // bn, kb]; the K step is
    # one scale block (BLOCK_K = bk), so each partial product is scaled once and added in float32.
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m, offs_n, m_mask, n_mask = tile_offsets(pid_m, pid_n, M, N, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BK_BLK)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    as_ptrs = as_ptr + offs_m.to(tl.int64) * stride_asm
    bs_ptrs = bs_ptr + (offs_n // BN_BLK) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK_BLK)):
        k_mask = offs_k < K - kb * BK_BLK
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        a_s = tl.load(as_ptrs + kb * stride_asg, mask=m_mask, other=0.0)
        b_s = tl.load(bs_ptrs + kb * stride_bsk, mask=n_mask, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BK_BLK
        b_ptrs += BK_BLK
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    c_off = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(c_ptr + c_off, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["M", "K_SPLIT"])
def _w8a8_one_launch_kernel(x_ptr, b_ptr, bs_ptr, bias_ptr, out_ptr, ws_ptr, lock_ptr, M, N, K_SPLIT, stride_xm,
                            stride_bn, stride_bsn, stride_bsk, BN_BLK: tl.constexpr, BK_BLK: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, SERIAL: tl.constexpr,
                            HAS_BIAS: tl.constexpr, GDC: tl.constexpr):
    # Program (tile, K range): each K step is one scale block; the tile's rows of x are quantized there as
    # _fp8_act_quant_kernel does (scale = amax / 448, q = x / scale in e4m3), so no quantized copy of x is written
    # or read, and the weights stream on the FP8 tensor cores: out^T = W x^T, the weight tile on the dot's M side.
    # Split-K partials end in splitk_epilogue.
    tile = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    offs_m = (tile // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (tile % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_begin = tl.multiple_of(pid_k * K_SPLIT, BK_BLK)    # K_SPLIT is whole scale blocks: aligned loads
    offs_k = k_begin + tl.arange(0, BK_BLK)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    bs_ptrs = bs_ptr + (offs_n // BN_BLK) * stride_bsn + (k_begin // BK_BLK) * stride_bsk
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    pdl.wait(GDC)   # a one-token launch is a programmatic dependent (pdl.py): x is the kernel before's output
    for _ in range(k_begin, k_begin + K_SPLIT, BK_BLK):
        x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0).to(tl.float32)
        a_s = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) / FP8_MAX
        a = tl.clamp(x / a_s[:, None], -FP8_MAX, FP8_MAX).to(b_ptr.dtype.element_ty)
        b = tl.load(b_ptrs, mask=n_mask[None, :], other=0.0)
        b_s = tl.load(bs_ptrs, mask=n_mask, other=0.0)
        acc += tl.dot(tl.trans(b), tl.trans(a)) * b_s[:, None] * a_s[None, :]
        x_ptrs += BK_BLK
        b_ptrs += BK_BLK
        bs_ptrs += stride_bsk
    pdl.launch_dependents(GDC)
    splitk_epilogue(tl.trans(acc), offs_m, offs_n, M, N, N, bias_ptr, out_ptr, ws_ptr, lock_ptr, tile, pid_k, SPLIT,
                    SERIAL, HAS_BIAS)


def per_token_group_quant(x: torch.Tensor, group: int, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K % group == 0) -> (e4m3 [rows, K], float32 scales [rows, K // group]); rows >= M (default M)
    pads with zero rows. The scales are stored column-major (stride (1, rows)): the layout cuBLAS wants for
    1x128 block scales."""
    M, K = x.shape
    rows = M if rows is None else rows
    q = torch.empty((rows, K), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((K // group, rows), dtype=torch.float32, device=x.device).t()
    if rows:
        per_prog = max(1, min(8, 1024 // group, triton.next_power_of_2(K // group)))
        grid = (rows, triton.cdiv(K // group, per_prog))
        _fp8_act_quant_kernel[grid](x, q, s, M, K, x.stride(0), s.stride(0), s.stride(1), GROUP=group,
                                    GROUPS_PER_PROG=per_prog, num_warps=4)
    return q, s


def w8a8_one_launch(x2: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                    block_size: tuple[int, int], bias: torch.Tensor | None, out: torch.Tensor,
                    tiles: KernelChoice) -> torch.Tensor:
    """out = x2 @ W^T (+ bias) in one launch of _w8a8_one_launch_kernel (K a multiple of the scale block)."""
    M, K = x2.shape
    N = weight.shape[0]
    bn, bk = block_size
    split = fit_split(K // bk, tiles.split_k)
    num_tiles = triton.cdiv(M, tiles.block_m) * triton.cdiv(N, tiles.block_n)
    to = split_targets(out, split, num_tiles, tiles.serial)
    _w8a8_one_launch_kernel[(num_tiles, split)](
        x2, weight, weight_scale_inv, bias if bias is not None else out, out, to.ws, to.locks,
        M, N, K // split, x2.stride(0), weight.stride(0), weight_scale_inv.stride(0), weight_scale_inv.stride(1),
        BN_BLK=bn, BK_BLK=bk, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, SPLIT=split, SERIAL=to.serial,
        HAS_BIAS=bias is not None, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **pdl.options(x2.device, M))
    to.finish(bias, out)
    return out


def w8a8_gemm(x2: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block_size: tuple[int, int],
              bias: torch.Tensor | None, out: torch.Tensor, tiles: KernelChoice) -> torch.Tensor:
    """out = x2 @ W^T (+ bias): x2 quantized per token and group, then _w8a8_block_kernel."""
    M, K = x2.shape
    N = weight.shape[0]
    bn, bk = block_size
    xq, xs = per_token_group_quant(x2, bk)
    grid = (triton.cdiv(M, tiles.block_m) * triton.cdiv(N, tiles.block_n),)
    _w8a8_block_kernel[grid](xq, xs, weight, weight_scale_inv, bias if bias is not None else out, out, M, N, K,
                             xs.stride(0), xs.stride(1), weight.stride(0), weight_scale_inv.stride(0),
                             weight_scale_inv.stride(1), BN_BLK=bn, BK_BLK=bk, BLOCK_M=tiles.block_m,
                             BLOCK_N=tiles.block_n, GROUP_M=tiles.group_m, HAS_BIAS=bias is not None,
                             num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


def cublas_w8a8(x2: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, bk: int,
                bias: torch.Tensor | None) -> torch.Tensor | None:
    """cuBLAS block-scaled GEMM, or None (remembered) where this torch/cuBLAS refuses the case. Tokens are padded
    to a multiple of CUBLAS_ROW_ALIGN with zero rows; the result is a view of the first M rows."""
    M = x2.shape[0]
    xq, xs = per_token_group_quant(x2, bk, rows=-(-M // CUBLAS_ROW_ALIGN) * CUBLAS_ROW_ALIGN)
    try:
        # B = weight.T is column-major [K, N]; its scales weight_scale_inv.T [K/128, N/128] are K-major in memory.
        y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=weight_scale_inv.t(), out_dtype=x2.dtype)[:M]
    except (RuntimeError, NotImplementedError):
        CUBLAS_REFUSED.add(x2.dtype)
        return None
    return y if bias is None else y + bias
