"""Rotary position embedding (rotate-half / NeoX layout), and Qwen3's q/k RMSNorm fused in front of it.

cos and sin are [T, head_dim // 2]: the per-token angles for each frequency, already chosen per axis for
M-RoPE by the model's rotary module. The op rotates pairs (x[j], x[j + head_dim/2]).
"""
from __future__ import annotations

import torch

from engine.ops.dispatch import use_triton
from engine.ops.norm import rms_norm_ref


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos/sin: [T, D/2] -> broadcast over heads. Same math as transformers' rotate_half form.
    half = x.shape[-1] // 2
    c = cos.unsqueeze(1).to(x.dtype)
    s = sin.unsqueeze(1).to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def apply_rotary_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q: [T, Hq, D], k: [T, Hk, D] -> rotated (q, k), new tensors."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def qk_norm_rope_ref(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     eps: float, cos: torch.Tensor, sin: torch.Tensor):
    """Qwen3: RMSNorm over head_dim per head (q_norm / k_norm), then rotary. Returns new (q, k)."""
    return apply_rotary_ref(rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps), cos, sin)


def apply_rotary(q, k, cos, sin):
    if use_triton(q):
        from engine.ops.triton import rotary
        return rotary.apply_rotary(q, k, cos, sin)
    return apply_rotary_ref(q, k, cos, sin)


def qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin):
    if use_triton(q):
        from engine.ops.triton import rotary
        return rotary.qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin)
    return qk_norm_rope_ref(q, k, q_weight, k_weight, eps, cos, sin)
