"""Fused residual add + RMSNorm (Triton version of rms_norm_ref), over rows of a 2-D [T, H] or a
per-head 3-D [T, heads, D] tensor (possibly a strided view, e.g. of the fused qkv output); and fused residual
add + LayerNorm (layer_norm_ref) over the rows of a 2-D [T, H] tensor, for the vision encoder."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.triton import pdl


@triton.jit(do_not_specialize=["num_rows"])   # one variant for every token count (see attention.py)
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
                     num_rows, heads, stride_xt, stride_xh, stride_rt, stride_rh, eps,
                     N: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     GDC: tl.constexpr):
    # A program normalises ROWS rows held whole in registers: one row of 4096 for the decoder's hidden
    # state, 16 rows of 128 for a per-head norm (so small rows still give each program ~2K elements).
    pdl.start(GDC)   # between two linears of a decode step
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < num_rows
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    # Row r is (token r // heads, head r % heads) of a possibly strided input.
    t = (rows // heads).to(tl.int64)
    h = rows % heads
    x = tl.load(x_ptr + (t * stride_xt + h * stride_xh)[:, None] + cols[None, :], mask=mask, other=0.0)
    out_off = rows.to(tl.int64)[:, None] * N + cols[None, :]
    if HAS_RESIDUAL:
        # The residual add rounds to the stream's dtype (as transformers' decoder does), then the norm
        # reads the rounded sum.
        r = tl.load(res_ptr + (t * stride_rt + h * stride_rh)[:, None] + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + out_off, x, mask=mask)
    xf = x.to(tl.float32)
    # Padded columns are 0 so they do not change the sum; divide by the true width N.
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=1) / N + eps)
    # Same rounding points as the reference: normalise in fp32, round to x's dtype, then scale by the
    # weight (a bf16*bf16 product is exact in fp32, so rounding it once more matches torch bit for bit).
    h_norm = (xf * inv_rms[:, None]).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_off, (w[None, :] * h_norm).to(out_ptr.dtype.element_ty), mask=mask)


def _rows_view(x: torch.Tensor):
    """(tensor, heads, stride_t, stride_h): x as rows of its last dim; 2-/3-D strided views are used as they are."""
    if x.dim() not in (2, 3):
        x = x.reshape(-1, x.shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 2:
        return x, 1, x.stride(0), 0
    return x, x.shape[1], x.stride(0), x.stride(1)


def _launch_shape(n: int) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS, num_warps) for rows of width n: whole rows in registers, ~2K elements per program."""
    block_n = triton.next_power_of_2(n)
    rows = max(1, min(16, 2048 // block_n))
    return block_n, rows, max(1, min(8, rows * block_n // 512))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Same contract as rms_norm_ref: returns normed, or (normed, x + residual), always new tensors."""
    n = x.shape[-1]
    stream_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, stream_dtype), device=x.device)
    res_out = None if residual is None else torch.empty(x.shape, dtype=stream_dtype, device=x.device)
    num_rows = x.numel() // n if n else 0
    if num_rows == 0:
        return out if residual is None else (out, res_out)

    xv, heads, sxt, sxh = _rows_view(x)
    rv, srt, srh = xv, 0, 0
    if residual is not None:
        assert residual.shape == x.shape, "residual must have x's shape"
        rv, _, srt, srh = _rows_view(residual)

    block_n, rows, num_warps = _launch_shape(n)
    _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
        xv, rv, weight, out, out if res_out is None else res_out,
        num_rows, heads, sxt, sxh, srt, srh, eps,
        N=n, BLOCK_N=block_n, ROWS=rows, HAS_RESIDUAL=residual is not None, num_warps=num_warps,
        **pdl.options(x.device, num_rows // heads),
    )
    return out if residual is None else (out, res_out)


@triton.jit(do_not_specialize=["num_rows"])
def _layer_norm_kernel(x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr, num_rows, stride_x, stride_r, eps,
                       N: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    # As _rms_norm_kernel: ROWS whole rows per program. The vision encoder's 1152-wide rows are read once
    # and written once (twice each with the residual), where torch ran an add and a LayerNorm kernel.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    mask = (rows < num_rows)[:, None] & col_mask[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + r64 * stride_r + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)  # rounded, as torch's add
        tl.store(res_out_ptr + r64 * N + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    mean = tl.sum(xf, axis=1) / N
    diff = tl.where(col_mask[None, :], xf - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(diff * diff, axis=1) / N + eps)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    y = diff * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(out_ptr + r64 * N + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
               residual: torch.Tensor | None = None):
    """Same contract as layer_norm_ref: returns normed, or (normed, x + residual), always new tensors."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = None if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    r2 = x2
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x"
        r2 = residual.reshape(-1, n)
        r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
    num_rows = x2.shape[0]
    if num_rows and n:
        block_n, rows, num_warps = _launch_shape(n)
        _layer_norm_kernel[(triton.cdiv(num_rows, rows),)](
            x2, r2, weight, bias, out, out if res_out is None else res_out, num_rows, x2.stride(0), r2.stride(0),
            eps, N=n, BLOCK_N=block_n, ROWS=rows, HAS_RESIDUAL=residual is not None, num_warps=num_warps)
    return out if residual is None else (out, res_out)
