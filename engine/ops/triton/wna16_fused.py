"""wna16_linear's fused kernels: a split-K GEMV for one token and a tiled GEMM that dequantizes inside its K loop
(QUANT_CONTRACT.md's layout: qweight int32 [K // pack, N] packed along K; scales and zeros [K // G, N]).

Fields as floats without conversions: a BITS-wide field q moved to mantissa bits [P, P + BITS) of 1.0f
(0x3F800000, one LOP3 with the mask) reads as v = 1 + q * 2**(P - 23).
- GEMM: w = v * s' + c with s' = s * 2**(23 - P), c = -(2**(23 - P) + z) * s is (q - z) * s in one FMA (v * s' is
  exact inside the FMA; c is exact in float32 for P >= 11 with fp16 scales and integer z), then x.dtype for the
  dot. 4-bit fields: nibbles 0-2 from q << 11 at P = 11, 15, 19; 3-4 in place at P = 12, 16; 5-7 from q >> 9 at
  P = 11, 15, 19 (two shifts per 8 weights). 8-bit: each byte shifted to P = 15.
- GEMV: the scale and zero point wait for the end of each K step (one group at most): see _gemv_step.
(Instruction counts per weight, from the sm90 SASS of the compiled kernels, are in docs/perf-log.md.)

GEMV (M == 1 by default; up to 8 tokens, one program each): programs (column strip, K split, token). Each step
loads a [BLOCK_KP, BLOCK_N] packed tile (16-byte loads along N; a thread's columns hold all the tile's rows), one
scale/zero row (a step never spans groups: BLOCK_K divides G) and the step's activations.
GEMM (more tokens): the packed tile is loaded transposed, [BLOCK_N, BLOCK_KP], its PACK planes dequantized and
joined along K into W^T [BLOCK_N, BLOCK_K] in x.dtype for one tensor-core dot per step (SWAP_AB: out^T = W^T x^T).

Split-K partials go to a float32 workspace [SPLIT, M, N]. SERIAL: the last program of a tile to finish (an atomic
counter per tile, reset by that program) sums them in split order and writes the output, so the op is one launch;
else a second kernel sums them. Either way the result does not depend on which split finishes first.
No host syncs: every launch parameter follows from shapes, so the ops capture in CUDA graphs.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.ops.triton.splitk import fit_split, grouped_tile, split_for, split_targets, splitk_epilogue

ONE_BITS = 0x3F800000   # float32 bits of 1.0


@triton.jit
def _raw(src, P: tl.constexpr, BITS: tl.constexpr, one):
    """1 + q * 2**(P - 23) for the BITS-bit field q at bits [P, P + BITS) of src. `one` holds the bits of 1.0 in a
    register (a kernel argument): with the mask as the immediate, AND and OR are one LOP3 (two immediates would
    take two)."""
    return ((src & (((1 << BITS) - 1) << P)) | one).to(tl.float32, bitcast=True)


@triton.jit
def _field(src, P: tl.constexpr, BITS: tl.constexpr, s, zs, one):
    """(q - z) * s for the field at bits [P, P + BITS) of src; s and zs = z * s in float32."""
    v = _raw(src, P, BITS, one)
    sp = s * (1 << (23 - P))
    return tl.fma(v, sp, -(sp + zs))


@triton.jit
def _plane(q, j: tl.constexpr, BITS: tl.constexpr, s, zs, one):
    """Dequantized plane j of packed tile q: the weights at k = row * PACK + j."""
    if BITS == 4:
        if j < 3:
            w = _field(q << 11, 11 + 4 * j, 4, s, zs, one)
        elif j < 5:
            w = _field(q, 4 * j, 4, s, zs, one)
        else:
            w = _field(q >> 9, 4 * j - 9, 4, s, zs, one)
    else:
        if j < 2:
            w = _field(q << (15 - 8 * j), 15, 8, s, zs, one)
        else:
            w = _field(q >> (8 * j - 15), 15, 8, s, zs, one)
    return w


@triton.jit
def gemv_field(q, j: tl.constexpr, BITS: tl.constexpr, one):
    """Plane j of packed tile q as v = 1 + q_j / c_j, one LOP3 (_raw, c_j = 2**(23 - P)): 4-bit nibbles 2i and
    2i + 1 share one shift and land at P = 15 and 19 (c = 256 and 16); 8-bit fields at P = 15 (c = 256)."""
    if BITS == 4:
        if j < 4:
            src = q << (15 - 4 * (j - j % 2))
        else:
            src = q >> (4 * (j - j % 2) - 15)
        if j % 2 == 0:
            v = _raw(src, 15, 4, one)
        else:
            v = _raw(src, 19, 4, one)
    else:
        if j < 2:
            src = q << (15 - 8 * j)
        else:
            src = q >> (8 * j - 15)
        v = _raw(src, 15, 8, one)
    return v


@triton.jit
def field_scaled(xj, j: tl.constexpr, BITS: tl.constexpr):
    """c_j x_j for plane j, gemv_field's c_j (16 for odd 4-bit planes, else 256): v_j c_j x_j = c_j x_j + q_j x_j."""
    if BITS == 4 and j % 2 == 1:
        return xj * 16.0
    return xj * 256.0


@triton.jit
def _gemv_step(acc, q, x_ptrs, x_step, s, z, one, BITS: tl.constexpr):
    """One group step with the scale and zero point applied once per column. The raw fields
    v = 1 + q * 2**(P - 23) (P = 15 for 4-bit even planes and every 8-bit plane, P = 19 for 4-bit odd planes)
    times x' = x * 2**(23 - P) give x' + q * x, so one chain of FMAs over the tile's rows and planes sums to
    t = X' + sum_k q_k x_k, X' the sum of x'; then acc += (t - X' - z * X) * s. Per weight: one LOP3, one FFMA
    and half a shift. X' is some 20-40x the q x part (fields in the top mantissa bits): about 5 of float32's
    24 bits cancel.
    Layouts: the chain stays in the packed tile's layout ([BKP, BN] accumulator, x_ptrs [BKP, 1]; acc, s, z
    [1, BN]; the chain first assigned from a product, not from zeros); X and X' come from x_step, the step's
    activations [BK] spread over the threads, as scalars (cheaper than every thread adding all BK values)."""
    k = tl.arange(0, x_step.shape[0])
    if BITS == 4:
        X = tl.sum(x_step)
        X_scaled = tl.sum(tl.where(k % 2 == 0, x_step * 256.0, x_step * 16.0))
    else:
        X = tl.sum(x_step)
        X_scaled = X * 256.0
    for j in tl.static_range(32 // BITS):
        xj = tl.load(x_ptrs + j).to(tl.float32)
        p = gemv_field(q, j, BITS, one) * field_scaled(xj, j, BITS)
        if j == 0:
            t = p
        else:
            t += p
    t = tl.sum(t, axis=0, keep_dims=True)
    return acc + (t - X_scaled - z * X) * s


@triton.jit(do_not_specialize=["M", "K_SPLIT", "one"])
def _wna16_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, lock_ptr, M, N, K_SPLIT, one,
                       stride_xm, stride_qk, stride_sg, stride_om, BITS: tl.constexpr, GROUP: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr, SPLIT: tl.constexpr, SERIAL: tl.constexpr,
                       HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr):
    # Program (column strip, K split, token).
    PACK: tl.constexpr = 32 // BITS
    BLOCK_K: tl.constexpr = BLOCK_KP * PACK
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = tl.max_contiguous(tl.multiple_of(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), BLOCK_N), BLOCK_N)
    n_mask = (offs_n < N) | EVEN_N
    offs_r = tl.arange(0, BLOCK_KP)
    k_begin = tl.multiple_of(pid_k * K_SPLIT, BLOCK_K)   # K_SPLIT is a multiple of BLOCK_K: aligned loads
    k_end = k_begin + K_SPLIT
    q_ptrs = qw_ptr + (k_begin // PACK + offs_r)[:, None].to(tl.int64) * stride_qk + offs_n[None, :]
    x_row = x_ptr + pid_m.to(tl.int64) * stride_xm + k_begin
    x_ptrs = (x_row + offs_r * PACK)[:, None]
    acc = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    q_next = tl.load(q_ptrs, mask=n_mask[None, :], other=0)
    for k0 in range(k_begin, k_end, BLOCK_K):
        # Software prefetch: the next tile's load is issued before this tile's arithmetic.
        q = q_next
        q_ptrs += BLOCK_KP * stride_qk
        q_next = tl.load(q_ptrs, mask=n_mask[None, :] & (k0 + BLOCK_K < k_end), other=0)
        g_off = (k0 // GROUP) * stride_sg + offs_n   # scales are small: int32 offsets
        s = tl.load(s_ptr + g_off, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        z = tl.load(z_ptr + g_off, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        x_step = tl.load(x_row + (k0 - k_begin) + tl.arange(0, BLOCK_K)).to(tl.float32)
        acc = _gemv_step(acc, q, x_ptrs, x_step, s, z, one, BITS)
        x_ptrs += BLOCK_K
    splitk_epilogue(acc, pid_m + tl.arange(0, 1), offs_n, M, N, stride_om, bias_ptr, out_ptr, ws_ptr, lock_ptr,
              pid_m * tl.num_programs(0) + pid_n, pid_k, SPLIT, SERIAL, HAS_BIAS)


@triton.jit
def _dequant_wt(q, s, zs, one, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """Packed tile q [BN, BKP] -> W^T [BN, BK] in dtype, k = row * PACK + j: the planes joined along K (nested
    joins put plane j at position bitreverse(j), hence the order of the arguments)."""
    if BITS == 4:
        w0 = _plane(q, 0, BITS, s, zs, one).to(dtype)
        w1 = _plane(q, 1, BITS, s, zs, one).to(dtype)
        w2 = _plane(q, 2, BITS, s, zs, one).to(dtype)
        w3 = _plane(q, 3, BITS, s, zs, one).to(dtype)
        w4 = _plane(q, 4, BITS, s, zs, one).to(dtype)
        w5 = _plane(q, 5, BITS, s, zs, one).to(dtype)
        w6 = _plane(q, 6, BITS, s, zs, one).to(dtype)
        w7 = _plane(q, 7, BITS, s, zs, one).to(dtype)
        w = tl.join(tl.join(tl.join(w0, w4), tl.join(w2, w6)), tl.join(tl.join(w1, w5), tl.join(w3, w7)))
    else:
        w0 = _plane(q, 0, BITS, s, zs, one).to(dtype)
        w1 = _plane(q, 1, BITS, s, zs, one).to(dtype)
        w2 = _plane(q, 2, BITS, s, zs, one).to(dtype)
        w3 = _plane(q, 3, BITS, s, zs, one).to(dtype)
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


@dataclass(frozen=True)
class FusedConfig:
    path: str               # "gemv" (at most 8 tokens) or "gemm"
    block_n: int = 256
    block_k: int = 128      # weights along K per step; clamped to a power of two that divides the group size
    split_k: int = 1        # halved until it divides the number of K steps
    num_warps: int = 4
    num_stages: int = 1
    block_m: int = 16       # gemm only (the gemv takes all tokens in one program)
    swap_ab: bool = False   # gemm: out^T = W^T x^T (the weight tile on the dot's M side, for few tokens)
    group_m: int = 8        # gemm: row tiles that walk the same weight columns together
    serial: bool = True     # split-K: the tile's last program sums the partials (one launch)


GEMV_MAX_M = 8              # the gemv takes up to 8 tokens (one program per token); by default it runs 1
# Tokens from which dequantize-then-cuBLAS replaces the gemm (prefill); `choose_config` returns None there.
DEQUANT_MIN_M = 1024

# 4-bit group-128 configs per (N, K, M bucket) on Hopper where an H100 sweep's fastest differs from `default_config`
# (`python bench/tune_wna16.py --buckets 8 16 32 64 128 256` prints this table; BENCHMARKS.md): at the 8B shapes
# the rule gives the sweep's fastest for the other 15 (shape, bucket) pairs from 8 to 64 tokens. Past
# wna16.DEQUANT_MIN_M tokens the GEMM runs only where this table holds a config (`tuned_config`): the shapes
# where it measured faster than dequantize + cuBLAS (qkv and gate_up; o and down lose to cuBLAS there).
TUNED_W4G128: dict[tuple[int, int, int], FusedConfig] = {
    (4096, 4096, 16): FusedConfig('gemm', block_n=64, split_k=4, num_stages=4, swap_ab=True),  # 11.6 us
    # dequantize + cuBLAS: 48.8 us
    (6144, 4096, 256): FusedConfig('gemm', block_n=128, num_warps=8, num_stages=4, block_m=128, swap_ab=True),  # 42.3 us
    # dequantize + cuBLAS: 176.8 us
    (24576, 4096, 256): FusedConfig('gemm', block_n=128, num_warps=8, num_stages=3, block_m=256, swap_ab=True),  # 120.5 us
}


def m_bucket(M: int) -> int:
    """The power of two >= M, at most DEQUANT_MIN_M."""
    return min(triton.next_power_of_2(M), DEQUANT_MIN_M)


def default_config(M: int, N: int, K: int, bits: int, group_size: int, hopper: bool = True) -> FusedConfig:
    """Tiles from the instruction counts of the compiled kernels (sm90 SASS) and bench/tune_wna16.py's sweeps:
    - one token: the gemv, 2 warps of 256 columns each (8 int32 per thread per packed row: each
      activation a thread loads serves 8 columns), 4 packed rows per step, split-K to fill the SMs;
    - 2-64 tokens on Hopper: swap-AB, so that the dequantized weights are the wgmma's A operand, read from
      registers (no round trip through shared memory), 64 columns per program and split-K to fill the SMs: the
      H100 sweep's fastest tiles at 15 of the 16 (8B shape, bucket) pairs (TUNED_W4G128 holds the 16th);
    - more: 256-row tiles on Hopper from 129 tokens (one dequantization per weight up to 256 tokens). Ampere/Ada
      (sm80-89) have less shared memory and keep the mma accumulators in registers: swap-AB up to 32 tokens,
      then 8 warps and 2 stages for the large tiles (no spills there)."""
    pack = 32 // bits
    if M == 1:
        block_k = _fit_block_k(4 * pack, group_size, pack)
        split = split_for(triton.cdiv(N, 512), K // block_k, cap=32)
        return FusedConfig("gemv", block_n=512, block_k=block_k, split_k=split, num_warps=2)
    block_k = _fit_block_k(128 if M <= 64 else 64, group_size, pack)
    if hopper and M <= 64:
        block_m = 16 if M <= 16 else 32 if M <= 32 else 64
        split = split_for(triton.cdiv(N, 64), K // block_k, cap=8 if M <= 16 else 4)
        return FusedConfig("gemm", block_n=64, block_k=block_k, split_k=split, block_m=block_m, num_warps=4,
                           num_stages=4 if M <= 32 else 3, swap_ab=True)
    if M <= 32:
        block_m = 16 if M <= 16 else 32
        split = split_for(triton.cdiv(N, 128), K // block_k, cap=8)
        return FusedConfig("gemm", block_n=128, block_k=block_k, split_k=split, block_m=block_m, num_warps=4,
                           num_stages=4, swap_ab=True)
    if not hopper:
        return FusedConfig("gemm", block_n=128, block_k=_fit_block_k(64, group_size, pack),
                           block_m=64 if M <= 64 else 128, num_warps=8, num_stages=2)
    if M <= 128:
        return FusedConfig("gemm", block_n=128, block_k=block_k, block_m=128, num_warps=4, num_stages=4)
    return FusedConfig("gemm", block_n=128, block_k=block_k, block_m=256, num_warps=8, num_stages=3)


def tuned_config(M: int, N: int, K: int, bits: int, group_size: int, hopper: bool = True) -> FusedConfig | None:
    """TUNED_W4G128's config for this shape and M's bucket, if it holds one."""
    if bits != 4 or group_size != 128 or not hopper or M >= DEQUANT_MIN_M:
        return None
    return TUNED_W4G128.get((N, K, m_bucket(M)))


def choose_config(M: int, N: int, K: int, bits: int, group_size: int, hopper: bool = True) -> FusedConfig | None:
    """The fused kernel and tiles for M tokens, or None where dequantize-then-cuBLAS (or the older kernels) run:
    prefill-sized M, and groups too small or odd for a 16-deep dot."""
    if M >= DEQUANT_MIN_M:
        return None
    cfg = tuned_config(M, N, K, bits, group_size, hopper) or default_config(M, N, K, bits, group_size, hopper)
    if cfg.path == "gemm" and _fit_block_k(cfg.block_k, group_size, 32 // bits) < 16:
        if M > GEMV_MAX_M:
            return None
        cfg = default_config(1, N, K, bits, group_size, hopper)      # the gemv, one program per token
    return cfg


@functools.cache
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def is_hopper(device: torch.device) -> bool:
    """sm90+ (wgmma, 228 KB of shared memory per SM); CPU tensors (Triton's interpreter) count as Hopper."""
    if device.type != "cuda":
        return True
    return _is_hopper(device.index if device.index is not None else torch.cuda.current_device())


def _fit_block_k(block_k: int, group_size: int, pack: int) -> int:
    """The largest power of two <= block_k that divides the group size (at least one packed row)."""
    bk = max(triton.next_power_of_2(block_k), pack)
    while group_size % bk and bk > pack:
        bk //= 2
    return bk


def fused_linear(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, bits: int, bias: torch.Tensor | None, out: torch.Tensor,
                 cfg: FusedConfig) -> torch.Tensor:
    """out [M, N] = x2 [M, K] @ W (+ bias); x2's last dim and the weights contiguous."""
    M, K = x2.shape
    N = qweight.shape[1]
    pack = 32 // bits
    block_k = _fit_block_k(cfg.block_k, group_size, pack)
    split = fit_split(K // block_k, cfg.split_k)
    if cfg.path == "gemv":
        if M > GEMV_MAX_M:
            raise ValueError(f"the gemv path takes at most {GEMV_MAX_M} tokens, got {M}")
        tiles = triton.cdiv(N, cfg.block_n) * M
        grid = (triton.cdiv(N, cfg.block_n), split, M)
    else:
        if block_k < 16:
            raise ValueError(f"the gemm path needs a K step of at least 16 (group size {group_size})")
        tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
        grid = (tiles, split)
    to = split_targets(out, split, tiles, cfg.serial)
    bias_arg = bias if bias is not None else out
    common = dict(BITS=bits, GROUP=group_size, SPLIT=split, SERIAL=to.serial, HAS_BIAS=bias is not None,
                  EVEN_N=N % cfg.block_n == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    args = (x2, qweight, scales, zeros, bias_arg, out, to.ws, to.locks, M, N, K // split,
            ONE_BITS, x2.stride(0), qweight.stride(0), scales.stride(0), out.stride(0))
    if cfg.path == "gemv":
        _wna16_gemv_kernel[grid](*args, BLOCK_N=cfg.block_n, BLOCK_KP=block_k // pack, **common)
    else:
        _wna16_gemm_kernel[grid](*args, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
                                 GROUP_M=cfg.group_m, SWAP_AB=cfg.swap_ab, **common)
    to.finish(bias, out)
    return out
