"""Split-K, shared by the weight-streaming kernels (wna16.py, fp8_block.py).

With few output tiles (one token, a narrow projection) the grid also splits K into `split` ranges, so that more
programs stream the weight at once. Each program of a split launch stores its float32 sums in a [split, M, N]
buffer and reduce_partials adds the ranges and the bias into the output; with split 1 the kernel writes the
output itself. A kernel ends with store_output either way.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def store_output(out_ptr, bias_ptr, acc, out_off, part_off, offs_n, n_mask, mask, HAS_BIAS: tl.constexpr,
                 PARTIAL: tl.constexpr):
    """A program's float32 sums `acc` ([BLOCK_N] or [BLOCK_M, BLOCK_N]) at out_off: PARTIAL, as they are at
    part_off + out_off of the partial buffer (the reduction adds the bias once); else plus the bias, in the
    output's dtype."""
    if PARTIAL:
        tl.store(out_ptr + part_off + out_off, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _splitk_reduce_kernel(part_ptr, bias_ptr, out_ptr, MN, N, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                          HAS_BIAS: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def fit_split(steps: int, split: int) -> int:
    """The largest split <= `split` (a power of two) that divides the K steps: every range is whole steps."""
    while steps % split:
        split //= 2
    return split


def partial_buffer(out: torch.Tensor, split: int) -> torch.Tensor:
    """Where a kernel of `split` K ranges writes: `out` itself, or a float32 [split, M, N] buffer."""
    return torch.empty((split, *out.shape), dtype=torch.float32, device=out.device) if split > 1 else out


def reduce_partials(dst: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out [M, N] = the sum of dst's K ranges, plus the bias; nothing to do when the kernel wrote `out` itself."""
    if dst is out:
        return
    mn, block = out.numel(), 1024
    _splitk_reduce_kernel[(triton.cdiv(mn, block),)](dst, bias if bias is not None else out, out, mn, out.shape[-1],
                                                     SPLIT=dst.shape[0], BLOCK=block, HAS_BIAS=bias is not None,
                                                     num_warps=4)
