"""Qwen3-VL: the vision encoder feeding the Qwen3 text decoder (image rows replace <|image_pad|> embeddings,
deepstack taps are added after the first decoder layers)."""
from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.model.decoder import CausalLM
from engine.model.qwen3_vl_vision import Qwen3VLVisionModel


class Qwen3VLForConditionalGeneration(CausalLM):
    """The vision encoder is replicated: under tensor parallelism every rank holds all of it and encodes the
    images of its own step (no broadcast of embeddings); the text decoder is split."""
    decoder_name = "language_model"

    def __init__(self, config: ModelConfig, max_positions: int, host_embeddings: bool = False):
        super().__init__(config, max_positions, host_embeddings, prefix="model.language_model")
        self.visual = Qwen3VLVisionModel(config.vision, dtype=torch.get_default_dtype())  # set by build_model

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        """Returns (embeds [n_tokens, hidden], deepstack [num_taps, n_tokens, hidden]) for the images in order."""
        return self.visual(pixel_values.to(self.decoder.embed_tokens.weight.dtype), grid_thw)
