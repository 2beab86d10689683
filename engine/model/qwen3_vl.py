"""Qwen3-VL: the vision encoder feeding the Qwen3 text decoder (image rows replace <|image_pad|> embeddings,
deepstack taps are added after the first decoder layers)."""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.model.decoder import MultimodalEmbeds, TextDecoder
from engine.model.qwen3_vl_vision import Qwen3VLVisionModel
from engine.model.vocab_parallel_embedding import ParallelLMHead


class Qwen3VLForConditionalGeneration(nn.Module):
    """The vision encoder is replicated: under tensor parallelism every rank holds all of it and encodes the
    images of its own step (no broadcast of embeddings); the text decoder is split."""

    def __init__(self, config: ModelConfig, max_positions: int, host_embeddings: bool = False):
        super().__init__()
        self.config = config
        self.visual = Qwen3VLVisionModel(config.vision, dtype=torch.get_default_dtype())  # set by build_model
        self.language_model = TextDecoder(config, max_positions, prefix="model.language_model",
                                          host_embeddings=host_embeddings)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.language_model.embed_tokens.weight

    @property
    def decoder(self) -> TextDecoder:
        return self.language_model

    def forward(self, input_ids, positions, kv_caches, md, mm: MultimodalEmbeds | None = None) -> torch.Tensor:
        return self.language_model(input_ids, positions, kv_caches, md, mm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 [S, vocab] on every rank (a collective under tensor parallelism)."""
        return self.lm_head.compute_logits(hidden)

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        """Returns (embeds [n_tokens, hidden], deepstack [num_taps, n_tokens, hidden]) for the images in order."""
        return self.visual(pixel_values.to(self.lm_head.weight.dtype), grid_thw)
