"""RMSNorm (the decoder) and LayerNorm (the vision encoder), each optionally fused with the residual add that
precedes it."""
from __future__ import annotations

import torch
import torch.nn.functional as F

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


def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None):
    """LayerNorm over the last dim (torch's: fp32 statistics, one rounding at the end). With `residual`: first
    `x = x + residual` in x's dtype, as the transformers vision block does, and returns (normed, x)."""
    if residual is not None:
        x = x + residual
    out = F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    return out if residual is None else (out, x)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
               residual: torch.Tensor | None = None):
    if use_triton(x):
        from engine.ops.triton import norm
        return norm.layer_norm(x, weight, bias, eps, residual)
    return layer_norm_ref(x, weight, bias, eps, residual)
