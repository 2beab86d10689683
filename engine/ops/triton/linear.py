"""y = x @ W^T (+ b) for a single row x: the matrix-vector product of a batch-1 decode step (Triton version of
linear_ref for one token).

At one token a decode step is pure weight streaming: 15.1 GB of bf16 weights per step for Qwen3-VL-8B. cuBLAS
reaches ~3.36 TB/s there (MEASURED.md: 4.51 ms per step for the linear layers); a plain streaming kernel keeps
more bytes in flight. Each program owns BLOCK_N output rows and walks K in BLOCK_K slices, multiplying in fp32
and reducing once at the end; the tile shape is autotuned per (N, K) on first use (the engine's warm-up pass,
before CUDA-graph capture).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bn, bk, w, s in [(8, 512, 4, 3), (16, 256, 4, 4), (16, 512, 4, 3), (16, 512, 8, 4),
                                 (32, 256, 4, 3), (32, 256, 8, 4), (64, 128, 4, 4), (8, 1024, 8, 3)]]


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, K, stride_wn,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        col_mask = cols < K
        x = tl.load(x_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        w = tl.load(w_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0,
                    eviction_policy="evict_first")   # each weight byte is read once per step: keep L2 for x
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


_gemv_autotuned = triton.autotune(configs=_CONFIGS, key=["N", "K"])(_gemv_kernel)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [1, K]; weight: [N, K] with unit stride along K -> [1, N] in x's dtype (fp32 accumulation)."""
    assert x.shape[0] == 1 and x.shape[-1] == weight.shape[1] and weight.stride(1) == 1
    n, k = weight.shape
    x = x if x.is_contiguous() else x.contiguous()
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    args = (x, weight, bias if bias is not None else weight, out, n, k, weight.stride(0))
    if x.is_cuda:
        _gemv_autotuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, HAS_BIAS=bias is not None)
    else:   # Triton's CPU interpreter (tests) cannot time configs: one fixed tile
        _gemv_kernel[(triton.cdiv(n, 16),)](*args, HAS_BIAS=bias is not None, BLOCK_N=16, BLOCK_K=256)
    return out
