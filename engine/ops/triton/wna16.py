"""4-/8-bit group-quantized weights x bf16/fp16 activations (Triton version of wna16_linear_ref).

wna16_linear chooses by the number of tokens M (measured on an H100, BENCHMARKS.md):
- M == 1: this module's GEMV. Each program streams a column strip of the packed weight; the fields-as-floats
  arithmetic (_fields_step) spends one LOP3 and one FMA per weight. Split-K ranges are summed by the tile's last
  program (splitk.splitk_epilogue), and on sm90+ the kernel is a programmatic dependent launch (pdl.py).
- 2 <= M <= DEQUANT_MIN_M: wna16_fused's GEMM, which dequantizes each packed tile in its K loop for the tensor
  cores (also the fallback: groups too small for a 16-deep dot go to dequantize-then-cuBLAS).
- M > DEQUANT_MIN_M: dequantize the whole weight to x.dtype, then cuBLAS (the GEMM is compute-bound there),
  except at the shapes and token counts where wna16_fused.TUNED_W4G128 holds a GEMM config measured faster.
ENGINE_WNA16_KERNELS=fused runs wna16_fused's kernels wherever they apply (its one-token GEMV too, and its GEMM up
to wna16_fused.DEQUANT_MIN_M tokens), for A/B measurements. All paths are plain Triton (PDL's two instructions
only where the GPU has them) and capture in CUDA graphs (no host syncs).

Unpacking: the int32 at packed row r of column n holds k = r*PACK + j in bits [BITS*j, BITS*(j+1)). The GEMV and
the dequantize kernel split a [BKP, BN] packed tile into its PACK bit-planes: plane j holds the k = r*PACK + j and
is multiplied with x[r*PACK + j] (a strided load of x) or stored to rows r*PACK + j. The dequantize kernel turns an
integer q < 2**23 into a float with one OR and one subtract (the bits of float(2**23 + q) are 0x4B000000 | q),
which avoids the slow int-to-float conversion.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.ops.triton import pdl, wna16_fused
from engine.ops.triton.splitk import fit_split, split_targets, splitk_epilogue

MAGIC = tl.constexpr(0x4B000000)   # float32 bits of 2**23: OR in an integer < 2**23 and it is 2**23 + q
MAGIC_F = tl.constexpr(8388608.0)


@triton.jit
def _dequant_plane(q, j: tl.constexpr, BITS: tl.constexpr):
    """Bit-plane j of packed int32 tile q, as float32 values 0 .. 2**BITS - 1 (the dequantize kernel)."""
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
def _fields_step(acc, q, x_rows, s, z, one, BITS: tl.constexpr):
    """acc + sum_j (q_j - z) x_j s over the PACK planes of packed tile q (x_rows: the rows' first activations),
    one LOP3 and one FMA per weight: v_j c_j x_j = c_j x_j + q_j x_j. The chain starts from
    -(sum_j c_j x_j + z sum_j x_j), so it ends at sum_j (q_j - z) x_j, and one FMA per element applies the scale."""
    PACK: tl.constexpr = 32 // BITS
    xs = tl.zeros(x_rows.shape, dtype=tl.float32)
    xc = tl.zeros(x_rows.shape, dtype=tl.float32)
    for j in tl.static_range(PACK):
        xj = tl.load(x_rows + j).to(tl.float32)
        xs += xj
        xc += wna16_fused.field_scaled(xj, j, BITS)
    t = -xs[:, None] * z - xc[:, None]
    for j in tl.static_range(PACK):
        cx = wna16_fused.field_scaled(tl.load(x_rows + j).to(tl.float32), j, BITS)
        t += wna16_fused.gemv_field(q, j, BITS, one) * cx[:, None]
    return tl.fma(t, s, acc)


@triton.jit(do_not_specialize=["K_SPLIT", "one"])
def _wna16_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, lock_ptr, N, K_SPLIT, one, stride_qk,
                       stride_sg, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_KP: tl.constexpr, SPLIT: tl.constexpr, SERIAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                       GDC: tl.constexpr):
    # One token. Program (n, s) owns columns [n*BN, (n+1)*BN) over K range [s*K_SPLIT, (s+1)*K_SPLIT); the tile's
    # rows spread over the warps and are summed once, at the end.
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
    # The first tile is in flight while the kernel before finishes (pdl.py); x is that kernel's output.
    pdl.wait(GDC)
    for k0 in range(k_begin, k_end, BLOCK_K):
        # Software prefetch: the next tile's load is issued before this tile's arithmetic (Triton's pipeliner
        # only stages loads that feed a dot), so each program keeps a tile of weights in flight.
        q = q_next
        q_ptrs += BLOCK_KP * stride_qk
        q_next = tl.load(q_ptrs, mask=n_mask[None, :] & (k0 + BLOCK_K < k_end), other=0)
        kp0 = k0 // PACK
        kp = kp0 + tl.arange(0, BLOCK_KP)
        s, z = _group_params(s_ptr, z_ptr, kp0, kp, offs_n, n_mask, stride_sg, PACK, GROUP, PER_ROW)
        acc = _fields_step(acc, q, x_ptr + kp * PACK, s, z, one, BITS)
    pdl.launch_dependents(GDC)
    one_row = tl.full([], 1, tl.int32)
    splitk_epilogue(tl.sum(acc, axis=0, keep_dims=True), tl.arange(0, 1), offs_n, one_row, N, N, bias_ptr, out_ptr,
                    ws_ptr, lock_ptr, pid_n, pid_k, SPLIT, SERIAL, HAS_BIAS)


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
    path: str            # "gemv" or "dequant"
    block_n: int = 128
    block_kp: int = 16   # packed rows per K step (BLOCK_K = block_kp * 32 // bits)
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


# Tokens above which dequantize-then-cuBLAS runs (below: wna16_fused's GEMM; measured, BENCHMARKS.md).
DEQUANT_MIN_M = 64


def choose_config(M: int, N: int, K: int, bits: int, group_size: int) -> Wna16Config:
    """This module's path and tiles for M tokens: the GEMV for one, else dequantize-then-cuBLAS."""
    if M == 1:
        # 32-column strips of 64 packed rows per step, 8 warps, K split so that the narrow projections still
        # fill the SMs: the fastest of a sweep at each 8B shape on an H100 (bench/tune_wna16.py --buckets 1).
        return Wna16Config("gemv", block_n=32, block_kp=64, split_k=4 if N <= 4096 else (2 if N <= 8192 else 1),
                           num_warps=8)
    return Wna16Config("dequant", block_n=128, block_kp=8, num_warps=4)


def _fit_block_kp(cfg: Wna16Config, K: int, bits: int) -> int:
    """The largest block_kp <= cfg's that divides K // pack (so no K step needs a mask)."""
    kp_total = K // (32 // bits)
    block_kp = cfg.block_kp
    while kp_total % block_kp:
        block_kp //= 2
    return block_kp


def fused_kernels_enabled() -> bool:
    """ENGINE_WNA16_KERNELS=fused runs wna16_fused's kernels wherever they apply; read per call, for A/B
    measurements in one process."""
    return os.environ.get("ENGINE_WNA16_KERNELS", "old") == "fused"


def wna16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, bits: int, bias: torch.Tensor | None = None,
                 config: Wna16Config | wna16_fused.FusedConfig | None = None) -> torch.Tensor:
    """config: None chooses (module docstring); a Wna16Config runs this module's kernels, a FusedConfig
    wna16_fused's."""
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
    if config is None and (fused_kernels_enabled() or 2 <= M <= DEQUANT_MIN_M):
        config = wna16_fused.choose_config(M, N, K, bits, group_size, wna16_fused.is_hopper(x.device))
    elif config is None and M > DEQUANT_MIN_M:
        config = wna16_fused.tuned_config(M, N, K, bits, group_size, wna16_fused.is_hopper(x.device))
    if isinstance(config, wna16_fused.FusedConfig):
        out = wna16_fused.fused_linear(x2, qweight.contiguous(), scales.contiguous(), zeros.contiguous(), group_size,
                                       bits, bias, out, config)
        return out.reshape(*lead, N)
    cfg = config or choose_config(M, N, K, bits, group_size)
    if cfg.path == "gemv" and M != 1:
        raise ValueError("the gemv path takes one token")
    qweight, scales, zeros = qweight.contiguous(), scales.contiguous(), zeros.contiguous()
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
    tiles = triton.cdiv(N, cfg.block_n)
    to = split_targets(out, split, tiles)
    _wna16_gemv_kernel[(tiles, split)](
        x2, qweight, scales, zeros, bias_arg, out, to.ws, to.locks, N, K // split,
        wna16_fused.ONE_BITS, qweight.stride(0), scales.stride(0), BITS=bits, GROUP=group_size,
        BLOCK_N=cfg.block_n, BLOCK_KP=block_kp, SPLIT=split, SERIAL=to.serial, HAS_BIAS=bias is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.options(x.device, 1))
    to.finish(bias, out)
    return out.reshape(*lead, N)
