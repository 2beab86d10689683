"""Kernels behind the model: each op has a plain-torch reference (`*_ref`, runs everywhere and is the
specification) and, on CUDA, a Triton kernel of the same signature. The public name picks one per call."""
from engine.ops.activation import silu_and_mul, silu_and_mul_ref
from engine.ops.attention import (AttentionMetadata, paged_attention, paged_attention_ref, varlen_attention,
                                  varlen_attention_ref)
from engine.ops.embedding import embedding, embedding_ref
from engine.ops.kv_cache import store_kvcache, store_kvcache_ref
from engine.ops.linear import linear, prepack_linear_weight
from engine.ops.norm import layer_norm, layer_norm_ref, rms_norm, rms_norm_ref
from engine.ops.pixels import patchify, patchify_ref
from engine.ops.quant import fp8_block_linear, fp8_block_linear_ref, wna16_linear, wna16_linear_ref
from engine.ops.rotary import (apply_rotary, apply_rotary_ref, qk_norm_rope, qk_norm_rope_ref, rope_and_store_kv,
                               rope_and_store_kv_ref, vision_qkv_rope, vision_qkv_rope_ref)

__all__ = [
    "AttentionMetadata", "apply_rotary", "apply_rotary_ref", "embedding", "embedding_ref", "fp8_block_linear",
    "fp8_block_linear_ref", "layer_norm", "layer_norm_ref", "linear", "paged_attention",
    "paged_attention_ref", "patchify", "patchify_ref", "qk_norm_rope", "qk_norm_rope_ref", "rms_norm",
    "prepack_linear_weight", "rms_norm_ref", "rope_and_store_kv", "rope_and_store_kv_ref", "silu_and_mul",
    "silu_and_mul_ref",
    "store_kvcache", "store_kvcache_ref", "varlen_attention", "varlen_attention_ref", "vision_qkv_rope",
    "vision_qkv_rope_ref", "wna16_linear", "wna16_linear_ref",
]
