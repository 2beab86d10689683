"""wna16_linear's fused kernels: a split-K GEMV for 1-8 tokens and a tiled GEMM that dequantizes inside its K loop
(QUANT_CONTRACT.md's layout: qweight int32 [K // pack, N] packed along K; scales and zeros [K // G, N]).

Dequantization costs one LOP3 and one FMA per weight, plus two shifts per 8 weights at 4 bits. A BITS-wide field q
moved to mantissa bits [P, P + BITS) of 1.0f (0x3F800000) reads as v = 1 + q * 2**(P - 23), so

    w = v * s' + c   with   s' = s * 2**(23 - P),   c = -(2**(23 - P) + z) * s   gives   w = (q - z) * s

in one FMA; s' and c are per column and group, computed once per K step. The product v * s' is exact inside the
FMA and c is exact in float32 for P >= 11 (fp16 scales: at most 24 - P + 11 significant bits), so w carries a
single rounding. The 4-bit fields: nibbles 0-2 from q << 11 at P = 11, 15, 19; nibbles 3-4 in place at P = 12, 16;
nibbles 5-7 from q >> 9 at P = 11, 15, 19. The 8-bit fields: each byte shifted to P = 15.

GEMV (M <= 8): programs (column strip, K split). Each step loads a [BLOCK_KP, BLOCK_N] packed tile (16-byte loads
along N), one scale/zero row (a step never spans groups: BLOCK_K divides G), the tokens' [BLOCK_M, BLOCK_KP, PACK]
activations, and accumulates in float32 with FMAs on the CUDA cores.
GEMM (more tokens): the packed tile is loaded transposed, [BLOCK_N, BLOCK_KP], its PACK planes dequantized and
joined along K into W^T [BLOCK_N, BLOCK_K] in x.dtype for one tensor-core dot per step (SWAP_AB: out^T = W^T x^T).

Split-K partials go to a float32 workspace [SPLIT, M, N]. SERIAL: the last program of a tile to finish (an atomic
counter per tile, reset by that program) sums them in split order and writes the output, so the op is one launch;
else a second kernel sums them. Either way the result does not depend on which split finishes first.
No host syncs: every launch parameter follows from shapes, so the ops capture in CUDA graphs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

ONE_BITS = tl.constexpr(0x3F800000)   # float32 bits of 1.0


@triton.jit
def _field(src, P: tl.constexpr, BITS: tl.constexpr, s, zs):
    """(q - z) * s for the BITS-bit field q at bits [P, P + BITS) of src; s and zs = z * s in float32."""
    v = ((src & (((1 << BITS) - 1) << P)) | ONE_BITS).to(tl.float32, bitcast=True)
    sp = s * (1 << (23 - P))
    return tl.fma(v, sp, -(sp + zs))


@triton.jit
def _plane(q, j: tl.constexpr, BITS: tl.constexpr, s, zs):
    """Dequantized plane j of packed tile q: the weights at k = row * PACK + j."""
    if BITS == 4:
        if j < 3:
            w = _field(q << 11, 11 + 4 * j, 4, s, zs)
        elif j < 5:
            w = _field(q, 4 * j, 4, s, zs)
        else:
            w = _field(q >> 9, 4 * j - 9, 4, s, zs)
    else:
        if j < 2:
            w = _field(q << (15 - 8 * j), 15, 8, s, zs)
        else:
            w = _field(q >> (8 * j - 15), 15, 8, s, zs)
    return w


@triton.jit
def _gemv_plane(acc, w, xj, ACC_ROWS: tl.constexpr):
    """acc += x_j w_j: acc [BM, BKP, BN] (rows summed after the K loop) or [BM, BN] (rows summed every step)."""
    p = w[None, :, :] * xj[:, :, None]
    if ACC_ROWS:
        acc += p
    else:
        acc += tl.sum(p, axis=1)
    return acc


@triton.jit
def _gemv_step(acc, q, xt, s, zs, BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_KP: tl.constexpr,
               ACC_ROWS: tl.constexpr):
    # xt [BM, BKP, PACK] is split into its PACK planes (each [BM, BKP]) by halving the last axis.
    if BITS == 4:
        xe, xo = tl.split(tl.reshape(xt, [BLOCK_M, BLOCK_KP, 4, 2]))        # j even / odd
        x04, x26 = tl.split(tl.reshape(xe, [BLOCK_M, BLOCK_KP, 2, 2]))
        x15, x37 = tl.split(tl.reshape(xo, [BLOCK_M, BLOCK_KP, 2, 2]))
        x0, x4 = tl.split(x04)
        x2, x6 = tl.split(x26)
        x1, x5 = tl.split(x15)
        x3, x7 = tl.split(x37)
        acc = _gemv_plane(acc, _plane(q, 0, BITS, s, zs), x0, ACC_ROWS)
        acc = _gemv_plane(acc, _plane(q, 1, BITS, s, zs), x1, ACC_ROWS)
        acc = _gemv_plane(acc, _plane(q, 2, BITS, s, zs), x2, ACC_ROWS)
        acc = _gemv_plane(acc, _plane(q, 3, BITS, s, zs), x3, ACC_ROWS)
        acc = _gemv_plane(acc, _plane(q, 4, BITS, s, zs), x4, ACC_ROWS)
        acc = _gemv_plane(acc, _plane(q, 5, BITS, s, zs), x5, ACC_ROWS)
        acc = _gemv_plane(acc, _plane(q, 6, BITS, s, zs), x6, ACC_ROWS)
        acc = _gemv_plane(acc, _plane(q, 7, BITS, s, zs), x7, ACC_ROWS)
    else:
        x02, x13 = tl.split(tl.reshape(xt, [BLOCK_M, BLOCK_KP, 2, 2]))
        x0, x2 = tl.split(x02)
        x1, x3 = tl.split(x13)
        acc = _gemv_plane(acc, _plane(q, 0, BITS, s, zs), x0, ACC_ROWS)
        acc = _gemv_plane(acc, _plane(q, 1, BITS, s, zs), x1, ACC_ROWS)
        acc = _gemv_plane(acc, _plane(q, 2, BITS, s, zs), x2, ACC_ROWS)
        acc = _gemv_plane(acc, _plane(q, 3, BITS, s, zs), x3, ACC_ROWS)
    return acc


@triton.jit
def _store_out(acc, offs_m, offs_n, mask, n_mask, bias_ptr, out_ptr, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _epilogue(acc, offs_m, offs_n, M, N, stride_om, bias_ptr, out_ptr, ws_ptr, lock_ptr, tile, pid_k,
              SPLIT: tl.constexpr, SERIAL: tl.constexpr, HAS_BIAS: tl.constexpr):
    """acc [BM, BN] float32 -> out (one split), or the split's partial (and the sum, by the tile's last split)."""
    n_mask = offs_n < N
    mask = (offs_m < M)[:, None] & n_mask[None, :]
    if SPLIT == 1:
        _store_out(acc, offs_m, offs_n, mask, n_mask, bias_ptr, out_ptr, stride_om, HAS_BIAS)
    else:
        ws_off = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        MN = M.to(tl.int64) * N
        tl.store(ws_ptr + pid_k * MN + ws_off, acc, mask=mask)
        if SERIAL:
            # Every thread's partial is issued before the counter moves (barrier, then a release at GPU scope);
            # the last split reads the others' partials from L2 (.cg) after its acquire.
            tl.debug_barrier()
            done = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if done == SPLIT - 1:
                total = tl.zeros_like(acc)
                for s in tl.static_range(SPLIT):
                    total += tl.load(ws_ptr + s * MN + ws_off, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(lock_ptr + tile, 0)       # ready for the next launch (and graph replay)
                _store_out(total, offs_m, offs_n, mask, n_mask, bias_ptr, out_ptr, stride_om, HAS_BIAS)


@triton.jit(do_not_specialize=["M", "K_SPLIT"])
def _wna16_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, lock_ptr, M, N, K_SPLIT,
                       stride_xm, stride_qk, stride_sg, stride_om, BITS: tl.constexpr, GROUP: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr,
                       ACC_ROWS: tl.constexpr, SPLIT: tl.constexpr, SERIAL: tl.constexpr,
                       HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr):
    PACK: tl.constexpr = 32 // BITS
    BLOCK_K: tl.constexpr = BLOCK_KP * PACK
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = tl.max_contiguous(tl.multiple_of(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), BLOCK_N), BLOCK_N)
    n_mask = (offs_n < N) | EVEN_N
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_KP)
    k_begin = pid_k * K_SPLIT
    k_end = k_begin + K_SPLIT
    q_ptrs = qw_ptr + (k_begin // PACK + offs_r)[:, None].to(tl.int64) * stride_qk + offs_n[None, :]
    x_ptrs = (x_ptr + offs_m[:, None, None].to(tl.int64) * stride_xm
              + (k_begin + offs_r[None, :, None] * PACK + tl.arange(0, PACK)[None, None, :]))
    x_mask = (offs_m < M)[:, None, None]
    if ACC_ROWS:
        acc = tl.zeros([BLOCK_M, BLOCK_KP, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    q_next = tl.load(q_ptrs, mask=n_mask[None, :], other=0)
    for k0 in range(k_begin, k_end, BLOCK_K):
        # Software prefetch: the next tile's load is issued before this tile's arithmetic.
        q = q_next
        q_ptrs += BLOCK_KP * stride_qk
        q_next = tl.load(q_ptrs, mask=n_mask[None, :] & (k0 + BLOCK_K < k_end), other=0)
        g_off = (k0 // GROUP) * stride_sg + offs_n   # scales are small: int32 offsets
        s = tl.load(s_ptr + g_off, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        zs = tl.load(z_ptr + g_off, mask=n_mask, other=0.0).to(tl.float32)[None, :] * s
        xt = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)
        acc = _gemv_step(acc, q, xt, s, zs, BITS, BLOCK_M, BLOCK_KP, ACC_ROWS)
        x_ptrs += BLOCK_K
    if ACC_ROWS:
        res = tl.sum(acc, axis=1)
    else:
        res = acc
    _epilogue(res, offs_m, offs_n, M, N, stride_om, bias_ptr, out_ptr, ws_ptr, lock_ptr, pid_n, pid_k,
              SPLIT, SERIAL, HAS_BIAS)


@triton.jit
def _dequant_wt(q, s, zs, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """Packed tile q [BN, BKP] -> W^T [BN, BK] in dtype, k = row * PACK + j: the planes joined along K (nested
    joins put plane j at position bitreverse(j), hence the order of the arguments)."""
    if BITS == 4:
        w0 = _plane(q, 0, BITS, s, zs).to(dtype)
        w1 = _plane(q, 1, BITS, s, zs).to(dtype)
        w2 = _plane(q, 2, BITS, s, zs).to(dtype)
        w3 = _plane(q, 3, BITS, s, zs).to(dtype)
        w4 = _plane(q, 4, BITS, s, zs).to(dtype)
        w5 = _plane(q, 5, BITS, s, zs).to(dtype)
        w6 = _plane(q, 6, BITS, s, zs).to(dtype)
        w7 = _plane(q, 7, BITS, s, zs).to(dtype)
        w = tl.join(tl.join(tl.join(w0, w4), tl.join(w2, w6)), tl.join(tl.join(w1, w5), tl.join(w3, w7)))
    else:
        w0 = _plane(q, 0, BITS, s, zs).to(dtype)
        w1 = _plane(q, 1, BITS, s, zs).to(dtype)
        w2 = _plane(q, 2, BITS, s, zs).to(dtype)
        w3 = _plane(q, 3, BITS, s, zs).to(dtype)
        w = tl.join(tl.join(w0, w2), tl.join(w1, w3))
    return tl.reshape(w, [BLOCK_N, BLOCK_K])


@triton.jit(do_not_specialize=["M", "K_SPLIT"])
def _wna16_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, lock_ptr, M, N, K_SPLIT,
                       stride_xm, stride_qk, stride_sg, stride_om, BITS: tl.constexpr, GROUP: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       SWAP_AB: tl.constexpr, SPLIT: tl.constexpr, SERIAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                       EVEN_N: tl.constexpr):
    PACK: tl.constexpr = 32 // BITS
    BLOCK_KP: tl.constexpr = BLOCK_K // PACK
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    # Grouped order: GROUP_M row tiles walk the same weight columns together, so a packed tile is read from
    # memory once and from L2 by the other row tiles.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.max_contiguous(tl.multiple_of(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), BLOCK_N), BLOCK_N)
    m_mask = offs_m < M
    n_mask = (offs_n < N) | EVEN_N
    k_begin = pid_k * K_SPLIT
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
        w = _dequant_wt(q, s, zs, BITS, BLOCK_N, BLOCK_K, dtype)
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
    _epilogue(res, offs_m, offs_n, M, N, stride_om, bias_ptr, out_ptr, ws_ptr, lock_ptr, pid_m * num_n + pid_n,
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
    acc_rows: bool = True   # gemv: per-row partial sums kept until after the K loop
    swap_ab: bool = False   # gemm: out^T = W^T x^T (the weight tile on the dot's M side, for few tokens)
    group_m: int = 8        # gemm: row tiles that walk the same weight columns together
    serial: bool = True     # split-K: the tile's last program sums the partials (one launch)


GEMV_MAX_M = 8
# Tokens from which dequantize-then-cuBLAS replaces the gemm (prefill); `choose_config` returns None there.
DEQUANT_MIN_M = 1024
SMS = 132                   # programs to fill at least twice (H200; more SMs only lengthen the tail a little)

# 4-bit group-128 configs per (N, K, M bucket), measured on the GPU: `python bench/tune_wna16.py` prints this
# table. Shapes and buckets not listed take `default_config`.
TUNED_W4G128: dict[tuple[int, int, int], FusedConfig] = {}


def m_bucket(M: int) -> int:
    """The power of two >= M, at most DEQUANT_MIN_M."""
    return min(triton.next_power_of_2(M), DEQUANT_MIN_M)


def _split_for(programs: int, steps: int, cap: int = 16) -> int:
    split = 1
    while programs * split < 2 * SMS and split < cap and steps % (split * 2) == 0:
        split *= 2
    return split


def default_config(M: int, N: int, K: int, bits: int, group_size: int) -> FusedConfig:
    pack = 32 // bits
    if M <= GEMV_MAX_M:
        # 128 columns per warp (4 int32 per thread, 16-byte loads), so a packed tile's rows stay in a thread;
        # 8 packed rows per step (4 from 3 tokens on: each thread holds every token's activations of a step).
        warps = 4 if N >= 16384 else 2 if N >= 4096 else 1
        block_k = _fit_block_k((8 if M <= 2 else 4) * pack, group_size, pack)
        split = _split_for(triton.cdiv(N, 128 * warps), K // block_k)
        return FusedConfig("gemv", block_n=128 * warps, block_k=block_k, split_k=split, num_warps=warps,
                           acc_rows=M == 1)
    block_k = _fit_block_k(128, group_size, pack)
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64 if M <= 64 else 128
    block_n = 64 if M <= 64 else 128
    programs = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    split = _split_for(programs, K // block_k, cap=4) if M <= 64 else 1
    return FusedConfig("gemm", block_n=block_n, block_k=block_k, split_k=split, block_m=block_m,
                       num_warps=8 if block_m == 128 else 4, num_stages=4 if block_m <= 64 else 3,
                       swap_ab=M <= 32)


def choose_config(M: int, N: int, K: int, bits: int, group_size: int) -> FusedConfig | None:
    """The fused kernel and tiles for M tokens, or None where dequantize-then-cuBLAS (or the older kernels) run:
    prefill-sized M, and groups too small or odd for a 16-deep dot."""
    if M >= DEQUANT_MIN_M:
        return None
    cfg = (TUNED_W4G128.get((N, K, m_bucket(M))) if bits == 4 and group_size == 128 else None) or \
        default_config(M, N, K, bits, group_size)
    if cfg.path == "gemm" and _fit_block_k(cfg.block_k, group_size, 32 // bits) < 16:
        return None
    return cfg


def _fit_block_k(block_k: int, group_size: int, pack: int) -> int:
    """The largest power of two <= block_k that divides the group size (at least one packed row)."""
    bk = max(triton.next_power_of_2(block_k), pack)
    while group_size % bk and bk > pack:
        bk //= 2
    return bk


_LOCKS: dict[torch.device, torch.Tensor] = {}
LOCK_SLOTS = 1 << 16


def _locks(device: torch.device) -> torch.Tensor | None:
    """The per-device split-K counters (zero between launches). Not allocated inside a graph capture (the memory
    would belong to the graph's pool): a capture before any eager call sums its partials in a second kernel."""
    t = _LOCKS.get(device)
    if t is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        t = _LOCKS[device] = torch.zeros(LOCK_SLOTS, dtype=torch.int32, device=device)
    return t


def fused_linear(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, bits: int, bias: torch.Tensor | None, out: torch.Tensor,
                 cfg: FusedConfig) -> torch.Tensor:
    """out [M, N] = x2 [M, K] @ W (+ bias); x2's last dim and the weights contiguous."""
    from engine.ops.triton.wna16 import _splitk_reduce_kernel
    M, K = x2.shape
    N = qweight.shape[1]
    pack = 32 // bits
    block_k = _fit_block_k(cfg.block_k, group_size, pack)
    steps = K // block_k
    split = cfg.split_k
    while steps % split:
        split //= 2
    if cfg.path == "gemv":
        if M > GEMV_MAX_M:
            raise ValueError(f"the gemv path takes at most {GEMV_MAX_M} tokens, got {M}")
        tiles = triton.cdiv(N, cfg.block_n)
        grid = (tiles, split)
    else:
        if block_k < 16:
            raise ValueError(f"the gemm path needs a K step of at least 16 (group size {group_size})")
        tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
        grid = (tiles, split)
    locks = _locks(out.device) if split > 1 and cfg.serial and tiles <= LOCK_SLOTS else None
    ws = torch.empty((split, M, N), dtype=torch.float32, device=out.device) if split > 1 else out
    bias_arg = bias if bias is not None else out
    common = dict(BITS=bits, GROUP=group_size, SPLIT=split, SERIAL=locks is not None, HAS_BIAS=bias is not None,
                  EVEN_N=N % cfg.block_n == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    args = (x2, qweight, scales, zeros, bias_arg, out, ws, locks if locks is not None else ws, M, N, K // split,
            x2.stride(0), qweight.stride(0), scales.stride(0), out.stride(0))
    if cfg.path == "gemv":
        _wna16_gemv_kernel[grid](*args, BLOCK_M=triton.next_power_of_2(M), BLOCK_N=cfg.block_n,
                                 BLOCK_KP=block_k // pack, ACC_ROWS=cfg.acc_rows, **common)
    else:
        _wna16_gemm_kernel[grid](*args, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
                                 GROUP_M=cfg.group_m, SWAP_AB=cfg.swap_ab, **common)
    if split > 1 and locks is None:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(M * N, block),)](ws, bias_arg, out, M * N, N, SPLIT=split, BLOCK=block,
                                                            HAS_BIAS=bias is not None, num_warps=4)
    return out
