"""Block-wise FP8 (e4m3) weights x bf16/fp16 activations (Triton version of fp8_block_linear_ref).

Two families of paths (QUANT_CONTRACT.md), chosen per call by fp8_block_linear below:
- W8A8, on GPUs with FP8 tensor cores (sm89+): activations quantized to e4m3 per token and group of bk
  (`per_token_group_quant`), then a block-scaled GEMM: cuBLAS through torch._scaled_mm where it takes block
  scales (sm90, 128x128 weight blocks), else the Triton kernel `_w8a8_block_kernel`. On Hopper (elsewhere with
  ENGINE_FP8_KERNELS=fused) up to FUSED_MAX_M tokens run `_w8a8_fused_kernel` instead: one launch that quantizes
  its rows of x in the K loop (the same e4m3 values and scales), takes the weight tile on the dot's M side
  (swap-AB: an fp8 wgmma) and splits K to fill the GPU; measured faster at 1 and 8 tokens (BENCHMARKS.md).
  ENGINE_FP8_KERNELS=old keeps the two launches.
- weight-only: a GEMV for one token (e4m3 converted in registers and multiplied in float32 with the activations,
  which carry the block scales; split-K summed in one launch; PDL on sm90), and dequantize-then-cuBLAS for more
  tokens. This is the path of sm80/86 (no FP8 tensor
  cores: e4m3 bytes are decoded with integer ops there) and of ENGINE_FP8_WEIGHT_ONLY=1.
Everything captures in CUDA graphs (no host syncs).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.ops.triton import pdl
from engine.ops.triton.splitk import (fit_split, grouped_tile, split_for, split_targets, splitk_epilogue,
                                     tile_offsets)

FP8_MAX = tl.constexpr(448.0)


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def has_fp8_tensor_cores(device: torch.device) -> bool:
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (8, 9)


@triton.jit
def _e4m3_to_f32(w, NATIVE: tl.constexpr):
    """e4m3 values as float32. NATIVE: w is fp8e4nv (sm89+). Else w holds the raw bytes (uint8) and the bits are
    moved into a float16 (same sign, exponent bias 15 instead of 7: times 2**8), which also maps e4m3's
    subnormals exactly. The NaN byte (0x7f/0xff) decodes as 480; checkpoints hold no NaN weights."""
    if NATIVE:
        f = w.to(tl.float32)
    else:
        u = w.to(tl.uint16)
        h = ((u & 0x80) << 8) | ((u & 0x7F) << 7)
        f = h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return f


@triton.jit(do_not_specialize=["M"])
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_sm, stride_sg, GROUP: tl.constexpr,
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
def _w8a8_fused_kernel(x_ptr, b_ptr, bs_ptr, bias_ptr, out_ptr, ws_ptr, lock_ptr, M, N, K_SPLIT, stride_xm,
                       stride_bn, stride_bsn, stride_bsk, BN_BLK: tl.constexpr, BK_BLK: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, SERIAL: tl.constexpr,
                       HAS_BIAS: tl.constexpr, SWAP_AB: tl.constexpr, GDC: tl.constexpr):
    # Program (tile, K range): each K step is one scale block; the tile's rows of x are quantized there as
    # _act_quant_kernel does (scale = amax / 448, q = x / scale in e4m3), so no quantized copy of x is written or
    # read, and the weights stream on the FP8 tensor cores. Split-K partials end in splitk_epilogue.
    # SWAP_AB: out^T = W x^T, the weight tile on the dot's M side: Hopper's wgmma takes M in 64-row steps, so a
    # 16-token tile otherwise runs as an fp16 mma (its e4m3 operands converted) instead of an fp8 wgmma.
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
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    pdl.wait(GDC)   # a one-token launch is a programmatic dependent (pdl.py): x is the kernel before's output
    for _ in range(k_begin, k_begin + K_SPLIT, BK_BLK):
        x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0).to(tl.float32)
        a_s = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) / FP8_MAX
        a = tl.clamp(x / a_s[:, None], -FP8_MAX, FP8_MAX).to(b_ptr.dtype.element_ty)
        b = tl.load(b_ptrs, mask=n_mask[None, :], other=0.0)
        b_s = tl.load(bs_ptrs, mask=n_mask, other=0.0)
        if SWAP_AB:
            acc += tl.dot(tl.trans(b), tl.trans(a)) * b_s[:, None] * a_s[None, :]
        else:
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        x_ptrs += BK_BLK
        b_ptrs += BK_BLK
        bs_ptrs += stride_bsk
    pdl.launch_dependents(GDC)
    if SWAP_AB:
        acc = tl.trans(acc)
    splitk_epilogue(acc, offs_m, offs_n, M, N, N, bias_ptr, out_ptr, ws_ptr, lock_ptr, tile, pid_k, SPLIT, SERIAL,
                    HAS_BIAS)


@triton.jit
def _weight_tile(w_rows, ws_ptr, n0, k0, offs_n, n_mask, K, stride_sn, stride_sk, BN_BLK: tl.constexpr,
                 BK_BLK: tl.constexpr, BLOCK_K: tl.constexpr, UNIFORM: tl.constexpr, NATIVE: tl.constexpr):
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
    return _e4m3_to_f32(w, NATIVE) * s, offs_k, k_mask


@triton.jit(do_not_specialize=["K_SPLIT"])
def _fp8_gemv_kernel(x_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, N, K, K_SPLIT, stride_wn, stride_sn,
                     stride_sk, BN_BLK: tl.constexpr, BK_BLK: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, ROW_UNIFORM: tl.constexpr, NATIVE: tl.constexpr, SPLIT: tl.constexpr,
                     SERIAL: tl.constexpr, HAS_BIAS: tl.constexpr, GDC: tl.constexpr):
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
        # Software prefetch, as in wna16's GEMV: the next tile's load is issued before this tile's arithmetic.
        w = w_next
        w_ptrs += BLOCK_K
        k_mask = offs_k < k_end
        w_next = tl.load(w_ptrs, mask=n_mask[:, None] & (offs_k + BLOCK_K < k_end)[None, :], other=0.0)
        x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        if ROW_UNIFORM:
            s = tl.load(ws_ptr + (pid_n * BLOCK_N // BN_BLK) * stride_sn + (offs_k // BK_BLK) * stride_sk,
                        mask=k_mask, other=0.0)
            acc += _e4m3_to_f32(w, NATIVE) * (x * s)[None, :]
        else:
            s = tl.load(ws_ptr + (offs_n // BN_BLK)[:, None] * stride_sn + (offs_k // BK_BLK)[None, :] * stride_sk,
                        mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc += _e4m3_to_f32(w, NATIVE) * s * x[None, :]
        offs_k += BLOCK_K
    pdl.launch_dependents(GDC)
    one_row = tl.full([], 1, tl.int32)
    splitk_epilogue(tl.reshape(tl.sum(acc, axis=1), [1, BLOCK_N]), tl.arange(0, 1), offs_n, one_row, N, N,
                    bias_ptr, out_ptr, part_ptr, lock_ptr, pid_n, pid_k, SPLIT, SERIAL, HAS_BIAS)


@triton.jit
def _fp8_dequant_kernel(w_ptr, ws_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_sk, BN_BLK: tl.constexpr,
                        BK_BLK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        UNIFORM: tl.constexpr, NATIVE: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w, offs_k, k_mask = _weight_tile(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn, ws_ptr, n0,
                                     tl.program_id(1) * BLOCK_K, offs_n, n_mask, K, stride_sn, stride_sk, BN_BLK,
                                     BK_BLK, BLOCK_K, UNIFORM, NATIVE)
    tl.store(out_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :], w.to(out_ptr.dtype.element_ty),
             mask=n_mask[:, None] & k_mask[None, :])


@dataclass(frozen=True)
class Fp8Config:
    path: str            # "cublas" / "w8a8" / "fused" (W8A8), "gemv" / "dequant" (weight-only)
    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    swap_ab: bool = False    # "fused": out^T = W x^T (the weight tile on the dot's M side)


# Token counts where the paths cross over (measured on an H200, BENCHMARKS.md).
W8A8_MIN_M = 1           # cuBLAS's block-scaled GEMM streams FP8 weights faster than the weight-only GEMV
W8A8_TRITON_MIN_M = 2    # where cuBLAS has no block scales (sm89), one token goes to the weight-only GEMV
CUBLAS_ROW_ALIGN = 8     # cuBLAS refuses 1x128 activation scales for token counts that are not a multiple

FUSED_MAX_M = 16         # _w8a8_fused_kernel's one row tile

_cublas_refused: set[torch.dtype] = set()


def fused_kernels_enabled(hopper: bool) -> bool:
    """Whether W8A8 steps of up to FUSED_MAX_M tokens go to _w8a8_fused_kernel. ENGINE_FP8_KERNELS: "auto"
    (default) on Hopper, where it measured faster (BENCHMARKS.md); "fused" on every GPU with FP8 tensor cores;
    "old" never. Read per call, for A/B measurements in one process."""
    mode = os.environ.get("ENGINE_FP8_KERNELS", "auto")
    return mode == "fused" or (mode == "auto" and hopper)


def weight_only_forced() -> bool:
    return os.environ.get("ENGINE_FP8_WEIGHT_ONLY", "0") == "1"


def _cublas_blockwise_ok(x: torch.Tensor, N: int, K: int, block_size: tuple[int, int]) -> bool:
    """cuBLAS block scaling (torch._scaled_mm with 1x128 activation and 128x128 weight scales) exists on sm90
    only; it wants K-block counts in multiples of 4 (else padded scales) and 16-aligned matrices."""
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return (_capability(dev) == (9, 0) and tuple(block_size) == (128, 128) and K % 512 == 0 and N % 16 == 0
            and x.dtype not in _cublas_refused)


def choose_config(x: torch.Tensor, N: int, K: int, block_size: tuple[int, int]) -> Fp8Config:
    """Path and tiles by token count and GPU: the fastest measured at the 8B shapes (H200; the one-launch kernel's
    tiles on an H100)."""
    M = x.shape[0]
    bk = block_size[1]
    w8a8 = not weight_only_forced() and has_fp8_tensor_cores(x.device) and K % bk == 0 and M >= W8A8_MIN_M
    hopper = _capability(x.device.index or 0) >= (9, 0)
    # One token with K <= 4096: the Triton kernel streams the weights faster than cuBLAS (it needs no padded
    # rows); for larger K (down_proj) its grid, which has no split-K, is too small and cuBLAS wins.
    one_token_triton = M == 1 and K <= 4096
    if w8a8 and M <= FUSED_MAX_M and fused_kernels_enabled(hopper):
        # Hopper: swap-AB (an fp8 wgmma) with an H100 sweep's fastest tiles, split 2 for gate_up's 24576 columns.
        # sm89 (opt-in): 128 columns halve the in-loop quantization per weight; split-K fills the GPU, each range
        # at least 4 scale blocks.
        if hopper:
            return Fp8Config("fused", block_m=16, block_n=64, split_k=2 if N >= 16384 else 8, num_warps=4,
                             num_stages=3, swap_ab=True)
        split = split_for(triton.cdiv(N, 128), K // bk, cap=max(1, min(16, K // bk // 4)))
        return Fp8Config("fused", block_m=16, block_n=128, split_k=split, num_warps=4, num_stages=3)
    if w8a8 and not one_token_triton and _cublas_blockwise_ok(x, N, K, block_size):
        return Fp8Config("cublas")
    if w8a8 and (M >= W8A8_TRITON_MIN_M or one_token_triton):
        if M <= 16:
            return Fp8Config("w8a8", block_m=16, block_n=64, num_warps=4, num_stages=4 if hopper else 3)
        if M <= 64 or not hopper:
            return Fp8Config("w8a8", block_m=64, block_n=64 if hopper else 128, num_warps=4,
                             num_stages=4 if hopper else 3)
        return Fp8Config("w8a8", block_m=128, block_n=128, num_warps=8, num_stages=4)
    if M > 1:   # weight-only, 2+ tokens: dequantize to x.dtype, then cuBLAS (measured faster than a dot kernel)
        return Fp8Config("dequant", block_n=32, block_k=128, num_warps=4)
    # One token: 32 rows x 128 columns per step, 4 warps, K in at least two ranges (more where the tiles are few):
    # the fastest or second-fastest tiles of an H100 sweep at each 8B shape (bench/bench_quant.py --sweep).
    split = max(2, split_for(triton.cdiv(N, 32), triton.cdiv(K, 128), cap=8))
    return Fp8Config("gemv", block_n=32, block_k=128, split_k=split, num_warps=4, num_stages=1)


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
        _act_quant_kernel[grid](x, q, s, M, K, x.stride(0), s.stride(0), s.stride(1), GROUP=group,
                                GROUPS_PER_PROG=per_prog, num_warps=4)
    return q, s


def _uniform(cfg_n: int, cfg_k: int, block_size: tuple[int, int]) -> bool:
    return block_size[0] % cfg_n == 0 and block_size[1] % cfg_k == 0


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                     block_size: tuple[int, int], bias: torch.Tensor | None = None,
                     config: Fp8Config | None = None) -> torch.Tensor:
    lead = x.shape[:-1]
    N, K = weight.shape
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if M == 0:
        return torch.empty((*lead, N), dtype=x.dtype, device=x.device)
    bn, bk = block_size
    cfg = config or choose_config(x2, N, K, block_size)
    if cfg.path == "cublas":
        y = _cublas_w8a8(x2, weight, weight_scale_inv, bk, bias)
        if y is not None:
            return y.reshape(*lead, N)
        cfg = choose_config(x2, N, K, block_size)   # refused: _cublas_refused now holds this case
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    bias_arg = bias if bias is not None else out
    if cfg.path == "fused":
        return _fused_w8a8(x2, weight, weight_scale_inv, block_size, bias, out, cfg).reshape(*lead, N)
    if cfg.path == "w8a8":
        xq, xs = per_token_group_quant(x2, bk)
        grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
        _w8a8_block_kernel[grid](xq, xs, weight, weight_scale_inv, bias_arg, out, M, N, K, xs.stride(0),
                                 xs.stride(1), weight.stride(0), weight_scale_inv.stride(0),
                                 weight_scale_inv.stride(1), BN_BLK=bn, BK_BLK=bk, BLOCK_M=cfg.block_m,
                                 BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m, HAS_BIAS=bias is not None,
                                 num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return out.reshape(*lead, N)
    native = has_fp8_tensor_cores(x.device)
    w = weight if native else weight.view(torch.uint8)
    if cfg.path == "dequant":
        uniform = _uniform(cfg.block_n, cfg.block_k, block_size)
        wd = torch.empty((N, K), dtype=x.dtype, device=x.device)
        grid = (triton.cdiv(N, cfg.block_n), triton.cdiv(K, cfg.block_k))
        _fp8_dequant_kernel[grid](w, weight_scale_inv, wd, N, K, weight.stride(0), weight_scale_inv.stride(0),
                                  weight_scale_inv.stride(1), BN_BLK=bn, BK_BLK=bk, BLOCK_N=cfg.block_n,
                                  BLOCK_K=cfg.block_k, UNIFORM=uniform, NATIVE=native, num_warps=cfg.num_warps)
        return torch.nn.functional.linear(x2, wd, bias).reshape(*lead, N)
    if M != 1:
        raise ValueError("the gemv path takes one token")
    steps = triton.cdiv(K, cfg.block_k)
    split = fit_split(steps, cfg.split_k)
    tiles = triton.cdiv(N, cfg.block_n)
    to = split_targets(out, split, tiles)
    _fp8_gemv_kernel[(tiles, split)](
        x2, w, weight_scale_inv, bias_arg, out, to.ws, to.locks, N, K, steps // split * cfg.block_k, weight.stride(0),
        weight_scale_inv.stride(0), weight_scale_inv.stride(1), BN_BLK=bn, BK_BLK=bk, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, ROW_UNIFORM=bn % cfg.block_n == 0, NATIVE=native, SPLIT=split, SERIAL=to.serial,
        HAS_BIAS=bias is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.options(x.device, 1))
    to.finish(bias, out)
    return out.reshape(*lead, N)


def _fused_w8a8(x2: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block_size: tuple[int, int],
                bias: torch.Tensor | None, out: torch.Tensor, cfg: Fp8Config) -> torch.Tensor:
    """out = x2 @ W^T (+ bias) in one launch of _w8a8_fused_kernel (K a multiple of the scale block)."""
    M, K = x2.shape
    N = weight.shape[0]
    bn, bk = block_size
    split = fit_split(K // bk, cfg.split_k)
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    to = split_targets(out, split, tiles)
    _w8a8_fused_kernel[(tiles, split)](
        x2, weight, weight_scale_inv, bias if bias is not None else out, out, to.ws, to.locks,
        M, N, K // split, x2.stride(0), weight.stride(0), weight_scale_inv.stride(0), weight_scale_inv.stride(1),
        BN_BLK=bn, BK_BLK=bk, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT=split, SERIAL=to.serial,
        HAS_BIAS=bias is not None, SWAP_AB=cfg.swap_ab, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl.options(x2.device, M))
    to.finish(bias, out)
    return out


def _cublas_w8a8(x2, weight, weight_scale_inv, bk, bias):
    """cuBLAS block-scaled GEMM, or None (remembered) where this torch/cuBLAS refuses the case. Tokens are padded
    to a multiple of CUBLAS_ROW_ALIGN with zero rows; the result is a view of the first M rows."""
    M = x2.shape[0]
    xq, xs = per_token_group_quant(x2, bk, rows=-(-M // CUBLAS_ROW_ALIGN) * CUBLAS_ROW_ALIGN)
    try:
        # B = weight.T is column-major [K, N]; its scales weight_scale_inv.T [K/128, N/128] are K-major in memory.
        y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=weight_scale_inv.t(), out_dtype=x2.dtype)[:M]
    except (RuntimeError, NotImplementedError):
        _cublas_refused.add(x2.dtype)
        return None
    return y if bias is None else y + bias
