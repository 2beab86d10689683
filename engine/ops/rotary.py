"""Rotary position embedding (rotate-half / NeoX layout), and Qwen3's q/k RMSNorm fused in front of it.

cos and sin are [T, head_dim // 2]: the per-token angles for each frequency, already chosen per axis for
M-RoPE by the model's rotary module. The op rotates pairs (x[j], x[j + head_dim/2]).
"""
from __future__ import annotations

import torch

from engine.ops.dispatch import use_triton
from engine.ops.kv_cache import store_kvcache_ref
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


def rope_and_store_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                          eps: float = 0.0) -> torch.Tensor:
    """The decoder's attention prologue in one op: rotary for q and k (after Qwen3's q/k RMSNorm when the
    weights are given), then this step's rotated k and v written into the paged cache (store_kvcache_ref).
    Returns the rotated q; attention reads k and v back from the cache."""
    if q_weight is not None:
        q, k = qk_norm_rope_ref(q, k, q_weight, k_weight, eps, cos, sin)
    else:
        q, k = apply_rotary_ref(q, k, cos, sin)
    store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping)
    return q


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


def rope_and_store_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_weight=None, k_weight=None, eps=0.0):
    if use_triton(q):
        from engine.ops.triton import rotary
        return rotary.rope_and_store_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_weight, k_weight, eps)
    return rope_and_store_kv_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_weight, k_weight, eps)


def vision_qkv_rope_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The vision encoder's rotary: qkv [N, 3, H, D] (the fused projection) -> (q, k, v), each an [N, H, D] view
    of qkv, with q and k rotated in place in fp32 (as transformers' apply_rotary_pos_emb_vision does with
    cos = cat(c, c)) and cast back to qkv's dtype. cos/sin: [N, D/2] fp32."""
    half = qkv.shape[-1] // 2
    c, s = cos[:, None, None, :], sin[:, None, None, :]
    x1, x2 = qkv[:, :2, :, :half].float(), qkv[:, :2, :, half:].float()
    qkv[:, :2].copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))
    return qkv.unbind(1)


def vision_qkv_rope(qkv, cos, sin):
    if use_triton(qkv):
        from engine.ops.triton import rotary
        return rotary.vision_qkv_rope(qkv, cos, sin)
    return vision_qkv_rope_ref(qkv, cos, sin)
