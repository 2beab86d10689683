"""The 4-/8-bit GEMV for one token (wna16_linear's one-token kernel, table.py).

Each program streams a column strip of the packed weight (docs/QUANT_LAYOUTS.md) over one K range, its rows spread
over the warps and summed once at the end; the fields-as-floats arithmetic (wna16_fields.py) spends one LOP3 and one
FMA per weight. The next weight tile's load is issued before this tile's arithmetic, so each program keeps a tile
in flight. Split-K ranges are summed by the tile's last program (splitk.splitk_epilogue), and where the device has
PDL the kernel is a programmatic dependent launch (pdl.py): it loads its first weight tile, then waits for the
kernel before, whose output x is.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.triton import pdl
from engine.ops.triton.quant.splitk import fit_split, split_targets, splitk_epilogue
from engine.ops.triton.quant.table import KernelChoice
from engine.ops.triton.quant.wna16_fields import ONE_BITS, field_scaled, gemv_field, group_params


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
        xc += field_scaled(xj, j, BITS)
    t = -xs[:, None] * z - xc[:, None]
    for j in tl.static_range(PACK):
        cx = field_scaled(tl.load(x_rows + j).to(tl.float32), j, BITS)
        t += gemv_field(q, j, BITS, one) * cx[:, None]
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
        s, z = group_params(s_ptr, z_ptr, kp0, kp, offs_n, n_mask, stride_sg, PACK, GROUP, PER_ROW)
        acc = _fields_step(acc, q, x_ptr + kp * PACK, s, z, one, BITS)
    pdl.launch_dependents(GDC)
    one_row = tl.full([], 1, tl.int32)
    splitk_epilogue(tl.sum(acc, axis=0, keep_dims=True), tl.arange(0, 1), offs_n, one_row, N, N, bias_ptr, out_ptr,
                    ws_ptr, lock_ptr, pid_n, pid_k, SPLIT, SERIAL, HAS_BIAS)


def wna16_gemv(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
               bits: int, bias: torch.Tensor | None, out: torch.Tensor, tiles: KernelChoice) -> torch.Tensor:
    """out [1, N] = x2 [1, K] @ W (+ bias); the weights contiguous."""
    if x2.shape[0] != 1:
        raise ValueError(f"the 4-bit GEMV takes one token, got {x2.shape[0]}")
    K, N, pack = x2.shape[1], qweight.shape[1], 32 // bits
    block_k = tiles.block_k
    while K % block_k:          # whole steps: no K step needs a mask
        block_k //= 2
    split = fit_split(K // block_k, tiles.split_k)
    grid = (triton.cdiv(N, tiles.block_n), split)
    to = split_targets(out, split, grid[0], tiles.serial)
    _wna16_gemv_kernel[grid](
        x2, qweight, scales, zeros, bias if bias is not None else out, out, to.ws, to.locks, N, K // split,
        ONE_BITS, qweight.stride(0), scales.stride(0), BITS=bits, GROUP=group_size, BLOCK_N=tiles.block_n,
        BLOCK_KP=block_k // pack, SPLIT=split, SERIAL=to.serial, HAS_BIAS=bias is not None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl.options(x2.device, 1))
    to.finish(bias, out)
    return out
