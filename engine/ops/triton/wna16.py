"""4-/8-bit group-quantized weights x bf16/fp16 activations (Triton version of wna16_linear_ref).

With ENGINE_WNA16_KERNELS=fused, wna16_linear runs wna16_fused's kernels (a one-token GEMV and a GEMM that
dequantizes in its K loop) up to DEQUANT_MIN_M tokens, and this module's from there on. They stay opt-in until
they have passed the GPU tests and been timed on a GPU (so far only Triton's CPU interpreter has run them;
`STAGES=wna16 bash bench/device_check.sh` does both); by default this module's kernels, measured, run.
This module's three paths, chosen by the number of tokens M (choose_config; measured on an H200, BENCHMARKS.md):
- M == 1, GEMV: FMA dot products; each program streams a column strip of the packed weight once.
- 2 <= M <= 64, dot: a tiled kernel that dequantizes each packed tile in registers and feeds the tensor cores.
- M > 64: dequantize the whole weight to x.dtype, then cuBLAS (the GEMM is compute-bound there).
All are plain Triton (no Hopper-only features) and capture in CUDA graphs (no host syncs).

Unpacking: the int32 at packed row r of column n holds k = r*PACK + j in bits [BITS*j, BITS*(j+1)).
- The GEMV and the dequantize kernel split a [BKP, BN] packed tile into its PACK bit-planes: plane j holds the
  k = r*PACK + j and is multiplied with x[r*PACK + j] (a strided load of x) or stored to rows r*PACK + j.
- The dot kernel loads the tile transposed, [BN, BKP], and repeats each int32 PACK times along K with
  tl.interleave, so one shift by (k % PACK) * BITS per element gives W^T in plain k order for a single dot.
An integer q < 2**23 becomes a float with one OR and one subtract (the bits of float(2**23 + q) are
0x4B000000 | q), which avoids the slow int-to-float conversion.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from engine.ops.triton import wna16_fused
from engine.ops.triton.splitk import fit_split, partial_buffer, reduce_partials, store_output, tile_offsets

MAGIC = tl.constexpr(0x4B000000)   # float32 bits of 2**23: OR in an integer < 2**23 and it is 2**23 + q
MAGIC_F = tl.constexpr(8388608.0)


@triton.jit
def _dequant_plane(q, j: tl.constexpr, BITS: tl.constexpr):
    """Bit-plane j of packed int32 tile q, as float32 values 0 .. 2**BITS - 1."""
    v = ((q >> (BITS * j)) & ((1 << BITS) - 1)) | MAGIC
    return v.to(tl.float32, bitcast=True) - MAGIC_F


@triton.jit
def _group_params(s_ptr, z_ptr, kp0, kp, offs_n, n_mask, stride_sg, PACK: tl.constexpr, GROUP: tl.constexpr,
                  PER_ROW: tl.constexpr):
    """Scales and zeros for packed rows kp (kp0 the first): [BKP, BN] when a tile spans several groups, else
    [1, BN] (G % PACK == 0, so the PACK values of a packed row share one group)."""
    if PER_ROW:
        off = ((kp * PACK) // GROUP)[:, None].to(tl.int64) * stride_sg + offs_n[None, :]
    else:
        off = (((kp0 * PACK) // GROUP).to(tl.int64) * stride_sg + offs_n)[None, :]
    s = tl.load(s_ptr + off, mask=n_mask[None, :], other=0.0).to(tl.float32)
    z = tl.load(z_ptr + off, mask=n_mask[None, :], other=0.0).to(tl.float32)
    return s, z


@triton.jit
def _scaled_x(x_rows, j: tl.constexpr, BITS: tl.constexpr):
    """c_j x_j for plane j (wna16_fused.gemv_field's c_j: 16 for odd 4-bit planes, else 256), float32."""
    xj = tl.load(x_rows + j).to(tl.float32)
    if BITS == 4 and j % 2 == 1:
        return xj * 16.0
    return xj * 256.0


@triton.jit
def _fields_step(acc, q, x_rows, s, z, one, BITS: tl.constexpr):
    """acc + sum_j (q_j - z) x_j s over the PACK planes of packed tile q (x_rows: the rows' first activations),
    one LOP3 and one FMA per weight: v_j c_j x_j = c_j x_j + q_j x_j. The chain starts from
    -(sum_j c_j x_j + z sum_j x_j), so it ends at sum_j (q_j - z) x_j, and one FMA per element applies the scale."""
    PACK: tl.constexpr = 32 // BITS
    xs = tl.zeros(x_rows.shape, dtype=tl.float32)
    xc = tl.zeros(x_rows.shape, dtype=tl.float32)
    for j in tl.static_range(PACK):
        xs += tl.load(x_rows + j).to(tl.float32)
        xc += _scaled_x(x_rows, j, BITS)
    t = -xs[:, None] * z - xc[:, None]
    for j in tl.static_range(PACK):
        t += wna16_fused.gemv_field(q, j, BITS, one) * _scaled_x(x_rows, j, BITS)[:, None]
    return tl.fma(t, s, acc)


@triton.jit(do_not_specialize=["K_SPLIT", "one"])
def _wna16_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, N, K_SPLIT, one, stride_qk, stride_sg,
                       BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr,
                       FIELDS: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr):
    # One token. Program (n, s) owns columns [n*BN, (n+1)*BN) over K range [s*K_SPLIT, (s+1)*K_SPLIT).
    # Per element: shift+mask+or, subtract, FMA; the zero point and scale are applied once per packed row
    # to the sums over its PACK bit-planes (sum_j w_j x_j - z * sum_j x_j) * s.
    # FIELDS: per element one LOP3 and one FMA (and half a shift), _fields_step.
    PACK: tl.constexpr = 32 // BITS
    BLOCK_K: tl.constexpr = BLOCK_KP * PACK
    PER_ROW: tl.constexpr = BLOCK_K > GROUP
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_KP, BLOCK_N], dtype=tl.float32)
    k_begin = pid_k * K_SPLIT
    k_end = k_begin + K_SPLIT
    q_ptrs = qw_ptr + (k_begin // PACK + tl.arange(0, BLOCK_KP))[:, None].to(tl.int64) * stride_qk + offs_n[None, :]
    q_next = tl.load(q_ptrs, mask=n_mask[None, :], other=0)
    for k0 in range(k_begin, k_end, BLOCK_K):
        # Software prefetch: the next tile's load is issued before this tile's arithmetic (Triton's pipeliner
        # only stages loads that feed a dot), so each program keeps a tile of weights in flight.
        q = q_next
        q_ptrs += BLOCK_KP * stride_qk
        q_next = tl.load(q_ptrs, mask=n_mask[None, :] & (k0 + BLOCK_K < k_end), other=0)
        kp0 = k0 // PACK
        kp = kp0 + tl.arange(0, BLOCK_KP)
        s, z = _group_params(s_ptr, z_ptr, kp0, kp, offs_n, n_mask, stride_sg, PACK, GROUP, PER_ROW)
        if FIELDS:
            acc = _fields_step(acc, q, x_ptr + kp * PACK, s, z, one, BITS)
        else:
            t = tl.zeros([BLOCK_KP, BLOCK_N], dtype=tl.float32)
            xs = tl.zeros([BLOCK_KP], dtype=tl.float32)
            for j in tl.static_range(PACK):
                xj = tl.load(x_ptr + kp * PACK + j).to(tl.float32)
                t += _dequant_plane(q, j, BITS) * xj[:, None]
                xs += xj
            acc += (t - xs[:, None] * z) * s
    store_output(out_ptr, bias_ptr, tl.sum(acc, axis=0), offs_n, pid_k * N, offs_n, n_mask, n_mask, HAS_BIAS,
                 PARTIAL)


@triton.jit(do_not_specialize=["M", "K_SPLIT"])
def _wna16_dot_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, M, N, K_SPLIT, stride_xm, stride_qk,
                      stride_sg, stride_om, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr, HAS_BIAS: tl.constexpr,
                      PARTIAL: tl.constexpr):
    # Tile [BM, BN] over K range [s*K_SPLIT, (s+1)*K_SPLIT). The packed tile is loaded transposed, [BN, BKP],
    # and each int32 is repeated PACK times along K by interleaving (in registers), so one shift per element by
    # (k % PACK) * BITS yields W^T [BN, BK] in plain k order for a single tensor-core dot per K step.
    # SWAP_AB computes out^T = W^T x^T: the weight tile is the dot's M side (>= 64 rows on Hopper's wgmma)
    # and the few tokens its N side, which suits small M.
    PACK: tl.constexpr = 32 // BITS
    BLOCK_KP: tl.constexpr = BLOCK_K // PACK
    PER_ROW: tl.constexpr = BLOCK_K > GROUP
    dtype = x_ptr.dtype.element_ty
    pid_k = tl.program_id(2)
    offs_m, offs_n, m_mask, n_mask = tile_offsets(tl.program_id(0), tl.program_id(1), M, N, BLOCK_M, BLOCK_N)
    shifts = (tl.arange(0, BLOCK_K) % PACK) * BITS
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_begin = pid_k * K_SPLIT
    for k0 in range(k_begin, k_begin + K_SPLIT, BLOCK_K):
        kp = k0 // PACK + tl.arange(0, BLOCK_KP)
        q = tl.load(qw_ptr + kp[None, :].to(tl.int64) * stride_qk + offs_n[:, None], mask=n_mask[:, None],
                    other=0)
        q = tl.interleave(q, q)
        q = tl.interleave(q, q)
        if PACK == 8:
            q = tl.interleave(q, q)
        v = ((q >> shifts[None, :]) & ((1 << BITS) - 1)) | MAGIC
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if PER_ROW:
            off = (offs_k // GROUP)[None, :].to(tl.int64) * stride_sg + offs_n[:, None]
        else:
            off = (offs_n + (k0 // GROUP) * stride_sg)[:, None]
        s = tl.load(s_ptr + off, mask=n_mask[:, None], other=0.0).to(tl.float32)
        zs = tl.load(z_ptr + off, mask=n_mask[:, None], other=0.0).to(tl.float32) * s
        w = ((v.to(tl.float32, bitcast=True) - MAGIC_F) * s - zs).to(dtype)      # W^T tile [BN, BK]
        a = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(a), acc)
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    if SWAP_AB:
        res = tl.trans(acc)
    else:
        res = acc
    out_off = offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    store_output(out_ptr, bias_ptr, res, out_off, pid_k * M * N, offs_n, n_mask, m_mask[:, None] & n_mask[None, :],
                 HAS_BIAS, PARTIAL)


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
    s, z = _group_params(s_ptr, z_ptr, kp0, kp, offs_n, n_mask, stride_sg, PACK, GROUP, PER_ROW)
    for j in tl.static_range(PACK):
        w = (_dequant_plane(q, j, BITS) - z) * s
        tl.store(w_ptr + (kp * PACK + j)[:, None].to(tl.int64) * N + offs_n[None, :],
                 w.to(w_ptr.dtype.element_ty), mask=n_mask[None, :])


@dataclass(frozen=True)
class Wna16Config:
    path: str            # "gemv", "dot" or "dequant"
    block_m: int = 16
    block_n: int = 128
    block_kp: int = 16   # packed rows per K step (BLOCK_K = block_kp * 32 // bits)
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = True
    fields: bool = False  # gemv: the fields-as-floats arithmetic (_fields_step)


# Tokens above which dequantize-then-cuBLAS beats the dot kernel (measured, BENCHMARKS.md).
DEQUANT_MIN_M = 64


def choose_config(M: int, N: int, K: int, bits: int, group_size: int) -> Wna16Config:
    """Path and tiles by token count; the constants are the fastest of a sweep at the 8B shapes on an H200."""
    if M > DEQUANT_MIN_M:
        return Wna16Config("dequant", block_n=128, block_kp=8, num_warps=4)
    pack = 32 // bits
    if M == 1:
        # 32-column strips of 64 packed rows per step, 8 warps, K split so that the narrow projections still
        # fill the SMs: the fastest of a sweep at each 8B shape on an H100 (bench/tune_wna16.py --buckets 1).
        return Wna16Config("gemv", block_n=32, block_kp=64, split_k=4 if N <= 4096 else (2 if N <= 8192 else 1),
                           num_warps=8, fields=True)
    block_m = 16 if M <= 16 else (32 if M <= 32 else 64)
    cfg = Wna16Config("dot", block_m=block_m, block_n=64, block_kp=128 // pack, num_warps=4, num_stages=3,
                      swap_ab=True)
    programs = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    steps = K // (cfg.block_kp * pack)
    split = 1
    while programs * split < 1024 and steps % (split * 2) == 0 and split < 4:
        split *= 2
    return replace(cfg, split_k=split)


def _fit_block_kp(cfg: Wna16Config, K: int, bits: int) -> int:
    """The largest block_kp <= cfg's that divides K // pack (so no K step needs a mask)."""
    kp_total = K // (32 // bits)
    block_kp = cfg.block_kp
    while kp_total % block_kp:
        block_kp //= 2
    return block_kp


# Tokens for which wna16_fused's GEMM runs by default: it dequantizes in its K loop and measured faster than the
# dot kernel at 8 and 64 tokens on an H100 (per decoder layer 125 against 154 us at 8, 226 against 249 at 64),
# slower at 256 (BENCHMARKS.md).
FUSED_GEMM_TOKENS = (2, DEQUANT_MIN_M)


def fused_kernels_enabled() -> bool:
    """ENGINE_WNA16_KERNELS=fused selects wna16_fused's kernels instead of this module's (GEMV, dot,
    dequantize+cuBLAS); read per call, for A/B measurements in one process."""
    return os.environ.get("ENGINE_WNA16_KERNELS", "old") == "fused"


def wna16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, bits: int, bias: torch.Tensor | None = None,
                 config: Wna16Config | wna16_fused.FusedConfig | None = None) -> torch.Tensor:
    """config: None chooses (the fused kernels under ENGINE_WNA16_KERNELS=fused); a Wna16Config runs this
    module's kernels, a FusedConfig wna16_fused's."""
    lead = x.shape[:-1]
    K = x.shape[-1]
    N = qweight.shape[1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out.reshape(*lead, N)
    if config is None and (fused_kernels_enabled() or FUSED_GEMM_TOKENS[0] <= M <= FUSED_GEMM_TOKENS[1]):
        config = wna16_fused.choose_config(M, N, K, bits, group_size, wna16_fused.is_hopper(x.device))
    if isinstance(config, wna16_fused.FusedConfig):
        out = wna16_fused.fused_linear(x2, qweight.contiguous(), scales.contiguous(), zeros.contiguous(), group_size,
                                       bits, bias, out, config)
        return out.reshape(*lead, N)
    cfg = config or choose_config(M, N, K, bits, group_size)
    if cfg.path == "gemv" and M != 1:
        raise ValueError("the gemv path takes one token")
    qweight, scales, zeros = qweight.contiguous(), scales.contiguous(), zeros.contiguous()
    block_kp = _fit_block_kp(cfg, K, bits)
    if cfg.path == "dot" and block_kp * (32 // bits) < 16:   # tl.dot needs K >= 16
        cfg = Wna16Config("dequant", block_n=128, block_kp=8)
        block_kp = _fit_block_kp(cfg, K, bits)
    bias_arg = bias if bias is not None else out
    if cfg.path == "dequant":
        w = torch.empty((K, N), dtype=x.dtype, device=x.device)
        grid = (K // (32 // bits) // block_kp, triton.cdiv(N, cfg.block_n))
        _wna16_dequant_kernel[grid](qweight, scales, zeros, w, N, qweight.stride(0), scales.stride(0), BITS=bits,
                                    GROUP=group_size, BLOCK_N=cfg.block_n, BLOCK_KP=block_kp,
                                    num_warps=cfg.num_warps)
        if bias is not None:
            return torch.addmm(bias.to(x.dtype), x2, w, out=out).reshape(*lead, N)
        return torch.mm(x2, w, out=out).reshape(*lead, N)
    pack = 32 // bits
    split = fit_split(K // (block_kp * pack), cfg.split_k)
    k_split = K // split
    partial = split > 1
    dst = partial_buffer(out, split)
    if cfg.path == "gemv":
        grid = (triton.cdiv(N, cfg.block_n), split)
        _wna16_gemv_kernel[grid](x2, qweight, scales, zeros, bias_arg, dst, N, k_split, wna16_fused.ONE_BITS,
                                 qweight.stride(0), scales.stride(0), BITS=bits, GROUP=group_size,
                                 BLOCK_N=cfg.block_n, BLOCK_KP=block_kp, FIELDS=cfg.fields,
                                 HAS_BIAS=bias is not None, PARTIAL=partial,
                                 num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(N, cfg.block_n), split)
        _wna16_dot_kernel[grid](x2, qweight, scales, zeros, bias_arg, dst, M, N, k_split, x2.stride(0),
                                qweight.stride(0), scales.stride(0), N, BITS=bits, GROUP=group_size,
                                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_kp * pack,
                                SWAP_AB=cfg.swap_ab, HAS_BIAS=bias is not None, PARTIAL=partial,
                                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    reduce_partials(dst, bias, out)
    return out.reshape(*lead, N)
