"""The quantized linears' dispatch table: (weight format, tokens, device class) -> kernel and tiles.

Read top to bottom: for a format, the first row whose device class matches, whose token bound holds the call's
token count M, and whose tile rule applies to the shape (it returns None where it does not) is the one that runs.
Device classes come from DeviceCaps (engine/ops/platform.py): "sm90" has wgmma (Hopper), "sm89" FP8 tensor cores
without wgmma (RTX 40, and Blackwell until measured), "sm80" neither (A100, RTX 30); "any" matches all three.

    format  class  tokens    kernel            tiles
    wna16   any    1         wna16_gemv        32 columns x 64 packed rows, 8 warps, split-K 4/2/1 by N
    wna16   any    2-64      wna16_gemm        sm90: swap-AB, 64 columns, split-K to fill the SMs;
                                               else swap-AB 128 columns to 32 tokens, then 8 warps, 2 stages
                                               (groups too small for a 16-deep dot: next rows)
    wna16   sm90   65-1023   wna16_gemm        only where TUNED_W4G128 holds the shape and token bucket
    wna16   any    all       wna16_dequant     dequantize to x.dtype, then cuBLAS
    fp8     sm80   1         fp8_gemv          weight-only (also any K not a multiple of the scale block)
    fp8     sm80   2-64      fp8_gemm          weight-only: each weight tile converted once for all the tokens, tl.dot;
                                               swap-AB 64 columns to 32 tokens, then 64x64; split-K to fill the SMs
    fp8     sm80   all       fp8_dequant       weight-only: dequantize, then cuBLAS
    fp8     sm90   1-16      w8a8_one_launch   x quantized in the K loop, swap-AB (an fp8 wgmma), split-K
    fp8     sm90   all       cublas_w8a8       torch._scaled_mm's block scales (128x128 blocks, K % 512 == 0)
    fp8     sm90   all       w8a8              activation quantization, then Triton's block-scaled GEMM
    fp8     sm89   1         w8a8              K <= 4096 (larger K: the GEMV streams faster than the unsplit GEMM)
    fp8     sm89   1         fp8_gemv
    fp8     sm89   all       w8a8

Every tile and crossover was measured at Qwen3-VL-8B's shapes (BENCHMARKS.md, "Quantized linear layers";
docs/perf-log.md); the sm89 and sm80 tiles are chosen to fit those GPUs' shared memory and registers
(tests/test_ops_portable.py), not measured on them.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from engine.ops.platform import DeviceCaps
from engine.ops.triton.quant.splitk import split_for

INF = 1 << 62


@dataclass(frozen=True)
class KernelChoice:
    """A kernel and its launch tiles. block_k counts weights along K per step (a 4-bit packed row holds 8)."""
    kernel: str
    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1         # halved until it divides the number of K steps
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8         # row tiles that walk the same weight columns together
    swap_ab: bool = False    # out^T = W^T x^T: the weight tile on the dot's M side (wgmma takes M in 64s)
    serial: bool = True      # split-K: the tile's last program sums the partials (one launch)


@dataclass(frozen=True)
class Problem:
    """One call: M tokens of x [M, K] (dtype) times an [K -> N] quantized weight."""
    M: int
    N: int
    K: int
    dtype: torch.dtype
    bits: int = 4                              # wna16
    group_size: int = 128                      # wna16
    block_size: tuple[int, int] = (128, 128)   # fp8: (bn, bk)


@dataclass(frozen=True)
class Row:
    devices: str             # "sm90", "sm89", "sm80" or "any"
    max_tokens: int
    tiles: Callable[[Problem], KernelChoice | None]


def device_class(caps: DeviceCaps) -> str:
    return "sm90" if caps.wgmma and caps.fp8_tensor_cores else "sm89" if caps.fp8_tensor_cores else "sm80"


# ---------------------------------------------------------------- 4-bit / 8-bit integer groups (wna16)

# Tokens above which dequantize-then-cuBLAS runs (the GEMM is compute-bound there), except TUNED_W4G128's entries.
WNA16_DEQUANT_ABOVE = 64
WNA16_TUNED_BELOW = 1024


def fit_block_k(block_k: int, group_size: int, pack: int) -> int:
    """The largest power of two <= block_k that divides the group size (at least one packed row)."""
    bk = max(triton.next_power_of_2(block_k), pack)
    while group_size % bk and bk > pack:
        bk //= 2
    return bk


def wna16_gemv_tiles(p: Problem) -> KernelChoice:
    # 32-column strips of 64 packed rows per step, 8 warps, K split so that the narrow projections still fill
    # the SMs: the fastest of a sweep at each 8B shape on an H100 (bench/tune_wna16.py --buckets 1).
    split = 4 if p.N <= 4096 else 2 if p.N <= 8192 else 1
    return KernelChoice("wna16_gemv", block_n=32, block_k=64 * (32 // p.bits), split_k=split, num_warps=8)


def _wna16_gemm_tiles(p: Problem, hopper: bool) -> KernelChoice | None:
    """From the compiled kernels' instruction counts and bench/tune_wna16.py's sweeps. Hopper: swap-AB, so that
    the dequantized weights are the wgmma's A operand, read from registers, 64 columns per program and split-K to
    fill the SMs (the H100 sweep's fastest at 15 of the 16 (8B shape, bucket) pairs; TUNED_W4G128 holds the 16th).
    Ampere/Ada have less shared memory and keep the mma accumulators in registers: swap-AB up to 32 tokens, then
    8 warps and 2 stages (no spills)."""
    M, N, K, pack = p.M, p.N, p.K, 32 // p.bits
    block_k = fit_block_k(128, p.group_size, pack)
    if block_k < 16:
        return None          # groups too small for a 16-deep dot
    if hopper:
        block_m = 16 if M <= 16 else 32 if M <= 32 else 64
        split = split_for(triton.cdiv(N, 64), K // block_k, cap=8 if M <= 16 else 4)
        return KernelChoice("wna16_gemm", block_n=64, block_k=block_k, split_k=split, block_m=block_m,
                            num_warps=4, num_stages=4 if M <= 32 else 3, swap_ab=True)
    if M <= 32:
        split = split_for(triton.cdiv(N, 128), K // block_k, cap=8)
        return KernelChoice("wna16_gemm", block_n=128, block_k=block_k, split_k=split,
                            block_m=16 if M <= 16 else 32, num_warps=4, num_stages=4, swap_ab=True)
    return KernelChoice("wna16_gemm", block_n=128, block_k=fit_block_k(64, p.group_size, pack), block_m=64,
                        num_warps=8, num_stages=2)


def wna16_tuned_tiles(p: Problem) -> KernelChoice | None:
    """TUNED_W4G128's tiles for this shape and token bucket (4-bit, group 128), if it holds them."""
    if p.bits != 4 or p.group_size != 128:
        return None
    return TUNED_W4G128.get((p.N, p.K, token_bucket(p.M)))


def token_bucket(M: int) -> int:
    """The power of two >= M: TUNED_W4G128's token key."""
    return triton.next_power_of_2(M)


def wna16_gemm_sm90(p: Problem) -> KernelChoice | None:
    return wna16_tuned_tiles(p) or _wna16_gemm_tiles(p, hopper=True)


def wna16_gemm_mma(p: Problem) -> KernelChoice | None:
    return _wna16_gemm_tiles(p, hopper=False)


def wna16_dequant_tiles(p: Problem) -> KernelChoice:
    return KernelChoice("wna16_dequant", block_n=128, block_k=8 * (32 // p.bits), num_warps=4)


# 4-bit group-128 tiles per (N, K, token bucket) on Hopper where an H100 sweep's fastest differs from the rule
# (`python bench/tune_wna16.py --buckets 8 16 32 64 128 256` prints this table; BENCHMARKS.md). Past
# WNA16_DEQUANT_ABOVE tokens the GEMM runs only where this table holds tiles: the shapes where it measured faster
# than dequantize + cuBLAS (qkv and gate_up at 256 tokens; o and down lose to cuBLAS there).
TUNED_W4G128: dict[tuple[int, int, int], KernelChoice] = {
    (4096, 4096, 16): KernelChoice("wna16_gemm", block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=4,
                                   block_m=16, swap_ab=True),  # 11.6 us
    # dequantize + cuBLAS: 48.8 us
    (6144, 4096, 256): KernelChoice("wna16_gemm", block_n=128, block_k=128, num_warps=8, num_stages=4,
                                    block_m=128, swap_ab=True),  # 42.3 us
    # dequantize + cuBLAS: 176.8 us
    (24576, 4096, 256): KernelChoice("wna16_gemm", block_n=128, block_k=128, num_warps=8, num_stages=3,
                                     block_m=256, swap_ab=True),  # 120.5 us
}

WNA16_TABLE = (
    Row("any", 1, wna16_gemv_tiles),
    Row("sm90", WNA16_DEQUANT_ABOVE, wna16_gemm_sm90),
    Row("any", WNA16_DEQUANT_ABOVE, wna16_gemm_mma),
    Row("sm90", WNA16_TUNED_BELOW - 1, wna16_tuned_tiles),
    Row("any", INF, wna16_dequant_tiles),
)


# ---------------------------------------------------------------- FP8 e4m3 weights in 128x128 blocks (fp8)

ONE_LAUNCH_MAX_M = 16     # the one-launch kernel's one row tile
FP8_DEQUANT_ABOVE = 64    # weight-only: tokens above which dequantize-then-cuBLAS runs (compute-bound there)
CUBLAS_REFUSED: set[torch.dtype] = set()   # activation dtypes this torch/cuBLAS refused block scales for


def fp8_gemv_tiles(p: Problem) -> KernelChoice:
    # 32 rows x 128 columns per step, 4 warps, K in at least two ranges (more where the tiles are few): the
    # fastest or second-fastest tiles of an H100 sweep at each 8B shape (bench/bench_quant.py --sweep).
    split = max(2, split_for(triton.cdiv(p.N, 32), triton.cdiv(p.K, 128), cap=8))
    return KernelChoice("fp8_gemv", block_n=32, block_k=128, split_k=split, num_warps=4, num_stages=1)


def fp8_gemm_tiles(p: Problem) -> KernelChoice:
    # Chosen like the 4-bit GEMM's non-Hopper tiles (fit sm86's 99 KB of shared memory, no spills), 64 columns
    # so that a 128-row scale block holds whole tiles (one scale per tile) and split-K fills the SMs.
    split = split_for(triton.cdiv(p.N, 64), triton.cdiv(p.K, 128), cap=8)
    if p.M <= 32:
        return KernelChoice("fp8_gemm", block_m=16 if p.M <= 16 else 32, block_n=64, block_k=128, split_k=split,
                            num_warps=4, num_stages=3, swap_ab=True)
    return KernelChoice("fp8_gemm", block_m=64, block_n=64, block_k=64, split_k=split, num_warps=4, num_stages=3)


def fp8_dequant_tiles(p: Problem) -> KernelChoice:
    return KernelChoice("fp8_dequant", block_n=32, block_k=128, num_warps=4)


def one_launch_tiles(p: Problem) -> KernelChoice:
    # swap-AB (an fp8 wgmma) with an H100 sweep's fastest tiles; split 2 for gate_up's 24576 columns.
    return KernelChoice("w8a8_one_launch", block_m=16, block_n=64, split_k=2 if p.N >= 16384 else 8, num_warps=4,
                        num_stages=3, swap_ab=True)


def cublas_tiles(p: Problem) -> KernelChoice | None:
    """cuBLAS's block-scaled GEMM (1x128 activation and 128x128 weight scales) where it takes the case: K-block
    counts in multiples of 4 (else padded scales), 16-aligned matrices, and a dtype it has not refused."""
    if tuple(p.block_size) == (128, 128) and p.K % 512 == 0 and p.N % 16 == 0 and p.dtype not in CUBLAS_REFUSED:
        return KernelChoice("cublas_w8a8")
    return None


def w8a8_sm90_tiles(p: Problem) -> KernelChoice:
    if p.M <= 64:
        return KernelChoice("w8a8", block_m=64, block_n=64, num_warps=4, num_stages=4)
    return KernelChoice("w8a8", block_m=128, block_n=128, num_warps=8, num_stages=4)


def w8a8_sm89_tiles(p: Problem) -> KernelChoice:
    if p.M <= 16:
        return KernelChoice("w8a8", block_m=16, block_n=64, num_warps=4, num_stages=3)
    return KernelChoice("w8a8", block_m=64, block_n=128, num_warps=4, num_stages=3)


def w8a8_one_token_tiles(p: Problem) -> KernelChoice | None:
    # K <= 4096: the Triton kernel streams the weights faster than the alternatives; for larger K (down_proj)
    # its grid, which has no split-K, is too small.
    return w8a8_sm89_tiles(p) if p.K <= 4096 else None


FP8_TABLE = (
    Row("sm80", 1, fp8_gemv_tiles),
    Row("sm80", FP8_DEQUANT_ABOVE, fp8_gemm_tiles),
    Row("sm80", INF, fp8_dequant_tiles),
    Row("sm90", ONE_LAUNCH_MAX_M, one_launch_tiles),
    Row("sm90", INF, cublas_tiles),
    Row("sm90", INF, w8a8_sm90_tiles),
    Row("sm89", 1, w8a8_one_token_tiles),
    Row("sm89", 1, fp8_gemv_tiles),
    Row("sm89", INF, w8a8_sm89_tiles),
)


def _first(table: tuple[Row, ...], devices: str, p: Problem) -> KernelChoice:
    for row in table:
        if row.devices in (devices, "any") and p.M <= row.max_tokens:
            choice = row.tiles(p)
            if choice is not None:
                return choice
    raise AssertionError(f"no row of the table for {devices} {p}")   # every table ends with a catch-all row


def choose_wna16(p: Problem, caps: DeviceCaps) -> KernelChoice:
    return _first(WNA16_TABLE, "sm90" if caps.wgmma else "sm80", p)


def choose_fp8(p: Problem, caps: DeviceCaps) -> KernelChoice:
    """FP8's rows; a K that is not a multiple of the scale block runs weight-only (the W8A8 kernels quantize x
    in whole blocks)."""
    devices = device_class(caps) if p.K % p.block_size[1] == 0 else "sm80"
    return _first(FP8_TABLE, devices, p)
