"""The text decoder shared by Llama, Qwen3 and Qwen3-VL's language model, and the causal-LM wrapper.

Parameter names follow the Hugging Face checkpoints, except that q/k/v and gate/up are fused into one
projection each (the loader fills the shards), so one GEMM replaces three and two.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.config import ModelConfig
from engine.model.layers import DecoderLayer, RMSNorm, RotaryEmbedding
from engine.ops import AttentionMetadata

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]   # per layer: (k_cache, v_cache)


@dataclass
class MultimodalEmbeds:
    """Vision rows to place into this step's flat token batch."""
    token_indices: torch.Tensor           # [n] positions in the flat batch holding <|image_pad|> tokens
    embeds: torch.Tensor                  # [n, hidden] merger output for those tokens
    deepstack: torch.Tensor | None        # [num_deepstack, n, hidden], added after the first decoder layers


class TextDecoder(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, max_positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
                md: AttentionMetadata, mm: MultimodalEmbeds | None = None) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if mm is not None:
            h = h.index_copy(0, mm.token_indices, mm.embeds.to(h.dtype))
        cos, sin = self.rotary(positions)
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, cos, sin, kv_caches[i], md)
            if mm is not None and mm.deepstack is not None and i < mm.deepstack.shape[0]:
                # Qwen3-VL deepstack: the i-th vision tap is added to the image tokens after layer i.
                h = h.index_add(0, mm.token_indices, mm.deepstack[i].to(h.dtype))
        h, _ = self.norm(h, residual)
        return h


class CausalLM(nn.Module):
    """Llama / Qwen3: decoder + lm_head (tied to the embedding when the config says so)."""

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        self.config = config
        self.model = TextDecoder(config, max_positions)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def decoder(self) -> TextDecoder:
        return self.model

    def forward(self, input_ids, positions, kv_caches, md, mm: MultimodalEmbeds | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, md, mm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
