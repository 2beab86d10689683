"""The model's linear layers: torch's (cuBLAS) everywhere, except one-token inputs on CUDA in half precision,
where a Triton matrix-vector kernel streams the weights faster (engine/ops/triton/linear.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.ops.dispatch import use_triton

_GEMV_DTYPES = (torch.bfloat16, torch.float16)   # fp32 stays on cuBLAS: the GPU-vs-CPU token-identity tests run it


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, K]; weight: [N, K] -> [T, N]."""
    return F.linear(x, weight, bias)


def linear(x, weight, bias=None):
    if x.dim() == 2 and x.shape[0] == 1 and x.dtype in _GEMV_DTYPES and weight.dtype == x.dtype and use_triton(x):
        from engine.ops.triton import linear as triton_linear
        return triton_linear.gemv(x, weight, bias)
    return linear_ref(x, weight, bias)
