"""Building blocks of the text decoders: RMSNorm, rotary tables (1-D RoPE and Qwen3-VL's interleaved M-RoPE),
attention over the paged KV cache, and the SwiGLU MLP. Plain torch modules; the hot math goes through
`engine.ops` so Triton kernels replace it on CUDA."""
from __future__ import annotations

import math

import torch
from torch import nn

from engine import ops
from engine.config import ModelConfig
from engine.model.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.ops import AttentionMetadata


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return ops.rms_norm(x, self.weight, self.eps, residual)


def _inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling.get("rope_type") == "llama3":
        # Llama 3.x: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, blended, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin tables indexed by position. For M-RoPE, positions are [3, T] (t, h, w) and each frequency takes
    its angle from one axis, interleaved as transformers' Qwen3-VL does (T, H, W, T, H, W, ..., then T)."""

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        inv_freq = _inv_freq(config)
        angles = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        self.register_buffer("cos_cache", angles.cos(), persistent=False)   # [max_positions, head_dim/2] fp32
        self.register_buffer("sin_cache", angles.sin(), persistent=False)
        self.mrope = config.mrope_section is not None
        if self.mrope:
            axis = torch.zeros(inv_freq.numel(), dtype=torch.int64)
            if config.mrope_interleaved:
                for dim in (1, 2):   # same slicing as transformers, including its clipping at the end
                    axis[dim: config.mrope_section[dim] * 3: 3] = dim
            else:
                bounds = torch.tensor(config.mrope_section).cumsum(0)
                axis = torch.bucketize(torch.arange(inv_freq.numel()), bounds, right=True)
            self.register_buffer("axis", axis, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] or, for M-RoPE, [3, T] -> (cos, sin), each [T, head_dim/2] fp32."""
        if positions.dim() == 1:
            return self.cos_cache[positions], self.sin_cache[positions]
        index = self.axis[None, None, :].expand(1, positions.shape[1], -1)
        cos = self.cos_cache[positions].gather(0, index).squeeze(0)
        sin = self.sin_cache[positions].gather(0, index).squeeze(0)
        return cos, sin


class Attention(nn.Module):
    """GQA self-attention with a fused qkv projection, optional per-head q/k RMSNorm (Qwen3), rotary, and K/V
    written to / read from this layer's slice of the paged cache. `prefix` is the layer's checkpoint name (it
    decides, with the checkpoint's quantization_config, which projections hold quantized weights).
    Under tensor parallelism the heads split over the ranks: num_heads and num_kv_heads are this rank's."""

    def __init__(self, config: ModelConfig, prefix: str):
        super().__init__()
        quant, self.head_dim = config.quantization, config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, config.attention_bias, quant,
                                          [f"{prefix}.{p}_proj" for p in "qkv"])
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        # attention_bias gives o_proj a bias too (transformers' Llama and Qwen3).
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        config.attention_bias, quant, [f"{prefix}.o_proj"])
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], md: AttentionMetadata) -> torch.Tensor:
        t = h.shape[0]
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else ()
        q = ops.rope_and_store_kv(q, k, v, cos, sin, k_cache, v_cache, md.slot_mapping, *qk_norm)
        out = ops.paged_attention(q, k_cache, v_cache, md, self.scale)
        return self.o_proj(out.view(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, prefix: str):
        super().__init__()
        hidden, inter, quant = config.hidden_size, config.intermediate_size, config.quantization
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], False, quant,
                                                       [f"{prefix}.gate_proj", f"{prefix}.up_proj"])
        self.down_proj = RowParallelLinear(inter, hidden, False, quant, [f"{prefix}.down_proj"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm block. The residual stream travels beside the hidden state so that each RMSNorm can fuse the
    residual add before it (stream after the layer = returned hidden + returned residual)."""

    def __init__(self, config: ModelConfig, prefix: str):
        super().__init__()
        self.self_attn = Attention(config, f"{prefix}.self_attn")
        self.mlp = MLP(config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, residual, cos, sin, kv_cache, md):
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, cos, sin, kv_cache, md)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual
