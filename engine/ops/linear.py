"""Unquantized linear layers on the CPU, with the weight kept in oneDNN's blocked layout.

torch's bf16 `F.linear` on the CPU runs oneDNN, which reorders the plain [N, K] weight into its blocked layout on
every call; at one decode token that reorder is most of the gap to the memory bound, a quarter of the decoder's
linear time (BENCHMARKS.md, "CPU"). `prepack_linear_weight` reorders once, at load; `linear` then runs the
same oneDNN product, so the results are the same bits as `F.linear` on the plain weight (its reference; tests).
fp32 weights are packed too: torch's fp32 `F.linear` runs MKL, whose row-major GEMV streams a short-row weight at
well under the memory's rate and whose GEMM at a few rows (a speculative verify step) costs several GEMVs, where
oneDNN's packed product does not (BENCHMARKS.md, "CPU"); its sums differ from MKL's in the last bits. The packed
weight is an opaque oneDNN tensor that only `linear` reads."""
from __future__ import annotations

import torch
import torch.nn.functional as F

PACKED_DTYPES = (torch.bfloat16, torch.float32)


def prepack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [N, K] in oneDNN's blocked layout, or None where that does not apply: not a bf16 or fp32 weight in
    host memory, or a torch built without oneDNN's linear ops."""
    if weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    except (AttributeError, RuntimeError):
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a plain weight or one that prepack_linear_weight made (the same bits)."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
