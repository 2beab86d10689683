"""FP8 block weights (docs/QUANT_LAYOUTS.md), weight-only (table.py: GPUs without FP8 tensor cores, sm80/86, and
any K that is not a multiple of the scale block): the activations stay in x.dtype and the e4m3 weights are
converted in registers.
- One token: `_fp8_gemv_kernel` streams rows of the [N, K] weight (contiguous along K) and sums each row once, at
  the end; where a tile's rows share one scale row the block scales multiply the activations, so a weight costs
  one conversion and one FMA. The next tile's load is issued before this tile's arithmetic; split-K is summed by
  the tile's last program; a programmatic dependent launch where the device has PDL (pdl.py).
- 2-64 tokens: `_fp8_gemm_kernel` reads each weight tile once for all the tokens of its row tile, converts it to
  x.dtype in registers and multiplies it on the tensor cores (tl.dot: mma on sm80+), split-K to fill the SMs;
  swap-AB up to 32 tokens (the weight tile on the dot's M side, the tokens on its narrow N side). Dequantizing
  the whole weight first would write and read it again in x.dtype at every step: three times the bytes.
- More tokens: `_fp8_dequant_kernel` writes the weight in x.dtype, then cuBLAS multiplies (compute-bound there:
  the dequantization's traffic is small beside the GEMM).
NATIVE (DeviceCaps.fp8_tensor_cores): Triton converts e4m3; else the raw bytes are decoded with integer ops, four
at a time in PTX on the GPU (PACKED: kv_cache.fp8e4m3_to_float), which is what keeps these kernels from being
instruction-bound on the cards that take them. Where a tile lies inside one scale block the decoded values (exact
in x.dtype) go to the tensor cores unscaled and the block's scale multiplies the fp32 partial product.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.platform import DeviceCaps
from engine.ops.triton import pdl
from engine.ops.triton.kv_cache import fp8e4m3_to_float
from engine.ops.triton.quant.splitk import fit_split, grouped_tile, split_targets, splitk_epilogue
from engine.ops.triton.quant.table import KernelChoice


@triton.jit
def _weight_tile(w_rows, ws_ptr, n0, k0, offs_n, n_mask, K, stride_sn, stride_sk, BN_BLK: tl.constexpr,
                 BK_BLK: tl.constexpr, BLOCK_K: tl.constexpr, UNIFORM: tl.constexpr, NATIVE: tl.constexpr,
                 PACKED: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at rows offs_n (starting at n0; w_rows: where they start in memory) and
    column k0, dequantized to float32, with its columns and their mask. The scale is one scalar when the tile lies
    inside one scale block (the caller's tile sizes divide the block sizes), else one per element."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    if UNIFORM:
        s = tl.load(ws_ptr + (n0 // BN_BLK) * stride_sn + (k0 // BK_BLK) * stride_sk)
    else:
        s = tl.load(ws_ptr + (offs_n[:, None] // BN_BLK) * stride_sn + (offs_k[None, :] // BK_BLK) * stride_sk)
    return fp8e4m3_to_float(w, tl.float32, NATIVE, PACKED) * s, offs_k, k_mask


@triton.jit(do_not_specialize=["K_SPLIT"])
def _fp8_gemv_kernel(x_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, N, K, K_SPLIT, stride_wn, stride_sn,
                     stride_sk, BN_BLK: tl.constexpr, BK_BLK: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, ROW_UNIFORM: tl.constexpr, NATIVE: tl.constexpr, PACKED: tl.constexpr,
                     SPLIT: tl.constexpr, SERIAL: tl.constexpr, HAS_BIAS: tl.constexpr, GDC: tl.constexpr):
    # One token, weight-only: program (n, s) streams rows [n*BN, (n+1)*BN) of the [N, K] weight (contiguous along
    # K) over K range s and sums each row once, at the end. ROW_UNIFORM (the tile's rows share one scale row):
    # the block scales multiply the activations, so a weight costs one conversion and one FMA.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    offs_k = k_begin + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    w_next = tl.load(w_ptrs, mask=n_mask[:, None] & (offs_k < k_end)[None, :], other=0.0)
    # The first tile is in flight while the kernel before finishes (pdl.py); x is that kernel's output.
    pdl.wait(GDC)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for _ in range(k_begin, k_end, BLOCK_K):
        # Software prefetch, as in the 4-bit GEMV: the next tile's load is issued before this tile's arithmetic.
        w = w_next
        w_ptrs += BLOCK_K
        k_mask = offs_k < k_end
        w_next = tl.load(w_ptrs, mask=n_mask[:, None] & (offs_k + BLOCK_K < k_end)[None, :], other=0.0)
        x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        if ROW_UNIFORM:
            s = tl.load(ws_ptr + (pid_n * BLOCK_N // BN_BLK) * stride_sn + (offs_k // BK_BLK) * stride_sk,
                        mask=k_mask, other=0.0)
            acc += fp8e4m3_to_float(w, tl.float32, NATIVE, PACKED) * (x * s)[None, :]
        else:
            s = tl.load(ws_ptr + (offs_n // BN_BLK)[:, None] * stride_sn + (offs_k // BK_BLK)[None, :] * stride_sk,
                        mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc += fp8e4m3_to_float(w, tl.float32, NATIVE, PACKED) * s * x[None, :]
        offs_k += BLOCK_K
    pdl.launch_dependents(GDC)
    one_row = tl.full([], 1, tl.int32)
    splitk_epilogue(tl.reshape(tl.sum(acc, axis=1), [1, BLOCK_N]), tl.arange(0, 1), offs_n, one_row, N, N,
                    bias_ptr, out_ptr, part_ptr, lock_ptr, pid_n, pid_k, SPLIT, SERIAL, HAS_BIAS)


@triton.jit(do_not_specialize=["M", "K_SPLIT"])
def _fp8_gemm_kernel(x_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, M, N, K, K_SPLIT, stride_xm,
                     stride_wn, stride_sn, stride_sk, stride_om, BN_BLK: tl.constexpr, BK_BLK: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     SWAP_AB: tl.constexpr, UNIFORM: tl.constexpr, NATIVE: tl.constexpr, PACKED: tl.constexpr,
                     SPLIT: tl.constexpr, SERIAL: tl.constexpr, HAS_BIAS: tl.constexpr):
    # A few tokens, weight-only: program (tile, s) converts its [BLOCK_N, BLOCK_K] weight tiles over K range s to
    # x.dtype once and multiplies them with all BLOCK_M rows of x (K_SPLIT is a multiple of BLOCK_K). UNIFORM (the
    # tile inside one scale block): the e4m3 values themselves (exact in x.dtype) meet x, and the block's scale
    # multiplies the tile's fp32 product.
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    offs_k = k_begin + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    w_next = tl.load(w_ptrs, mask=n_mask[:, None] & (offs_k < k_end)[None, :], other=0.0)
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        # Software prefetch, as in the GEMV: the next weight tile's load is issued before this tile's arithmetic.
        w = w_next
        k_mask = offs_k < k_end
        w_ptrs += BLOCK_K
        w_next = tl.load(w_ptrs, mask=n_mask[:, None] & (offs_k + BLOCK_K < k_end)[None, :], other=0.0)
        a = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if UNIFORM:
            s = tl.load(ws_ptr + (pid_n * BLOCK_N // BN_BLK) * stride_sn + (k0 // BK_BLK) * stride_sk)
            wt = fp8e4m3_to_float(w, dtype, NATIVE, PACKED)
            if SWAP_AB:
                acc += tl.dot(wt, tl.trans(a)) * s
            else:
                acc += tl.dot(a, tl.trans(wt)) * s
        else:
            s = tl.load(ws_ptr + (offs_n[:, None] // BN_BLK) * stride_sn + (offs_k[None, :] // BK_BLK) * stride_sk,
                        mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            wt = (fp8e4m3_to_float(w, tl.float32, NATIVE, PACKED) * s).to(dtype)
            if SWAP_AB:
                acc = tl.dot(wt, tl.trans(a), acc)
            else:
                acc = tl.dot(a, tl.trans(wt), acc)
        offs_k += BLOCK_K
    if SWAP_AB:
        res = tl.trans(acc)
    else:
        res = acc
    splitk_epilogue(res, offs_m, offs_n, M, N, stride_om, bias_ptr, out_ptr, part_ptr, lock_ptr, tl.program_id(0),
                    pid_k, SPLIT, SERIAL, HAS_BIAS)


@triton.jit
def _fp8_dequant_kernel(w_ptr, ws_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_sk, BN_BLK: tl.constexpr,
                        BK_BLK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        UNIFORM: tl.constexpr, NATIVE: tl.constexpr, PACKED: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w, offs_k, k_mask = _weight_tile(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn, ws_ptr, n0,
                                     tl.program_id(1) * BLOCK_K, offs_n, n_mask, K, stride_sn, stride_sk, BN_BLK,
                                     BK_BLK, BLOCK_K, UNIFORM, NATIVE, PACKED)
    tl.store(out_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :], w.to(out_ptr.dtype.element_ty),
             mask=n_mask[:, None] & k_mask[None, :])


def _raw_bytes(weight: torch.Tensor, caps: DeviceCaps) -> torch.Tensor:
    return weight if caps.fp8_tensor_cores else weight.view(torch.uint8)


def _decode(caps: DeviceCaps) -> dict[str, bool]:
    """How the kernels turn e4m3 into numbers on this device: Triton's conversion (sm89+), else integer ops, in PTX
    four bytes at a time where PTX runs (not in the interpreter)."""
    return dict(NATIVE=caps.fp8_tensor_cores, PACKED=caps.ptx and not caps.fp8_tensor_cores)


def fp8_gemv(x2: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block_size: tuple[int, int],
             bias: torch.Tensor | None, out: torch.Tensor, tiles: KernelChoice, caps: DeviceCaps) -> torch.Tensor:
    """out [1, N] = x2 [1, K] @ W^T (+ bias), weight-only."""
    if x2.shape[0] != 1:
        raise ValueError(f"the FP8 GEMV takes one token, got {x2.shape[0]}")
    (N, K), (bn, bk) = weight.shape, block_size
    steps = triton.cdiv(K, tiles.block_k)
    split = fit_split(steps, tiles.split_k)
    grid = (triton.cdiv(N, tiles.block_n), split)
    to = split_targets(out, split, grid[0], tiles.serial)
    _fp8_gemv_kernel[grid](
        x2, _raw_bytes(weight, caps), weight_scale_inv, bias if bias is not None else out, out, to.ws, to.locks,
        N, K, steps // split * tiles.block_k, weight.stride(0), weight_scale_inv.stride(0),
        weight_scale_inv.stride(1), BN_BLK=bn, BK_BLK=bk, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        ROW_UNIFORM=bn % tiles.block_n == 0, **_decode(caps), SPLIT=split, SERIAL=to.serial, HAS_BIAS=bias is not None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl.options(x2.device, 1))
    to.finish(bias, out)
    return out


def fp8_gemm(x2: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block_size: tuple[int, int],
             bias: torch.Tensor | None, out: torch.Tensor, tiles: KernelChoice, caps: DeviceCaps) -> torch.Tensor:
    """out [M, N] = x2 [M, K] @ W^T (+ bias), weight-only, each weight tile read once per row tile of x2."""
    (M, K), (N, _), (bn, bk) = x2.shape, weight.shape, block_size
    steps = triton.cdiv(K, tiles.block_k)
    split = fit_split(steps, tiles.split_k)
    num_tiles = triton.cdiv(M, tiles.block_m) * triton.cdiv(N, tiles.block_n)
    to = split_targets(out, split, num_tiles, tiles.serial)
    _fp8_gemm_kernel[(num_tiles, split)](
        x2, _raw_bytes(weight, caps), weight_scale_inv, bias if bias is not None else out, out, to.ws, to.locks,
        M, N, K, steps // split * tiles.block_k, x2.stride(0), weight.stride(0), weight_scale_inv.stride(0),
        weight_scale_inv.stride(1), out.stride(0), BN_BLK=bn, BK_BLK=bk, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m, SWAP_AB=tiles.swap_ab,
        UNIFORM=bn % tiles.block_n == 0 and bk % tiles.block_k == 0, **_decode(caps), SPLIT=split, SERIAL=to.serial,
        HAS_BIAS=bias is not None, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    to.finish(bias, out)
    return out


def fp8_dequant_linear(x2: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                       block_size: tuple[int, int], bias: torch.Tensor | None, tiles: KernelChoice,
                       caps: DeviceCaps) -> torch.Tensor:
    """x2 [M, K] @ W^T (+ bias) through the weight dequantized to x2.dtype."""
    (N, K), (bn, bk) = weight.shape, block_size
    wd = torch.empty((N, K), dtype=x2.dtype, device=x2.device)
    grid = (triton.cdiv(N, tiles.block_n), triton.cdiv(K, tiles.block_k))
    _fp8_dequant_kernel[grid](_raw_bytes(weight, caps), weight_scale_inv, wd, N, K, weight.stride(0),
                              weight_scale_inv.stride(0), weight_scale_inv.stride(1), BN_BLK=bn, BK_BLK=bk,
                              BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                              UNIFORM=bn % tiles.block_n == 0 and bk % tiles.block_k == 0, **_decode(caps),
                              num_warps=tiles.num_warps)
    return torch.nn.functional.linear(x2, wd, bias)
