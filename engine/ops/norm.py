"""RMSNorm, optionally fused with the residual add that precedes it."""
from __future__ import annotations

import torch

from engine.ops.dispatch import use_triton


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    """RMSNorm over the last dim, math in fp32, as transformers does it.

    Without `residual`: returns the normed tensor. With it: first `x = x + residual` (in x's dtype, as the
    transformers decoder does), returns (normed, x) where x is the new residual stream.
    """
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    if use_triton(x):
        from engine.ops.triton import norm
        return norm.rms_norm(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)
