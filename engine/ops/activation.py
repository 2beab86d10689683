"""SwiGLU activation: silu(gate) * up over a fused [.., 2*d] gate_up projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.ops.dispatch import use_triton


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*d] laid out as [gate | up] -> [..., d]."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        from engine.ops.triton import activation
        return activation.silu_and_mul(x)
    return silu_and_mul_ref(x)
