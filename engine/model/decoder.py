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
from engine.model.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from engine.ops import AttentionMetadata

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]   # per layer: (k_cache, v_cache)


@dataclass
class MultimodalEmbeds:
    """Vision rows to place into this step's flat token batch."""
    token_indices: torch.Tensor           # [n] positions in the flat batch holding <|image_pad|> tokens
    embeds: torch.Tensor                  # [n, hidden] merger output for those tokens
    deepstack: torch.Tensor | None        # [num_deepstack, n, hidden], added after the first decoder layers

    def place(self, h: torch.Tensor) -> torch.Tensor:
        return h.index_copy(0, self.token_indices, self.embeds.to(h.dtype))

    def add_deepstack(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        if self.deepstack is None or layer >= self.deepstack.shape[0]:
            return h
        return h.index_add(0, self.token_indices, self.deepstack[layer].to(h.dtype))


@dataclass
class DenseMultimodalEmbeds:
    """The same rows spread over the whole batch, for CUDA graphs (whose shapes cannot depend on how many image
    tokens a chunk holds): a mask of image rows, and embeds/deepstack with a row per token (deepstack zero on
    text rows, so adding it leaves them exactly as they were)."""
    mask: torch.Tensor                    # [T] bool
    embeds: torch.Tensor                  # [T, hidden]
    deepstack: torch.Tensor               # [num_deepstack, T, hidden]

    @classmethod
    def zeros(cls, model: nn.Module, rows: int, device) -> "DenseMultimodalEmbeds":
        """All-text buffers of `rows` rows for a multimodal model (its hidden size, deepstack taps and dtype)."""
        cfg = model.config
        hidden, taps = cfg.hidden_size, len(cfg.vision.deepstack_visual_indexes)
        dtype = model.decoder.embed_tokens.weight.dtype
        return cls(mask=torch.zeros(rows, dtype=torch.bool, device=device),
                   embeds=torch.zeros(rows, hidden, dtype=dtype, device=device),
                   deepstack=torch.zeros(taps, rows, hidden, dtype=dtype, device=device))

    def scatter_(self, mm: MultimodalEmbeds) -> None:
        """Write mm's rows in (the buffers must be in the all-text state: mask false, deepstack zero)."""
        idx = mm.token_indices
        self.embeds.index_copy_(0, idx, mm.embeds.to(self.embeds.dtype))
        self.mask.index_fill_(0, idx, True)
        if mm.deepstack is not None:
            self.deepstack[:mm.deepstack.shape[0]].index_copy_(1, idx, mm.deepstack.to(self.deepstack.dtype))

    def clear_(self, mm: MultimodalEmbeds) -> None:
        """Back to the all-text state after a step that used mm's rows."""
        self.mask.index_fill_(0, mm.token_indices, False)
        self.deepstack.index_fill_(1, mm.token_indices, 0)

    def place(self, h: torch.Tensor) -> torch.Tensor:
        return torch.where(self.mask[:, None], self.embeds, h)

    def add_deepstack(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        return h + self.deepstack[layer] if layer < self.deepstack.shape[0] else h


class TextDecoder(nn.Module):
    """`prefix`: the decoder's name in the checkpoint (`model`, or `model.language_model` in Qwen3-VL);
    `host_embeddings`: the token-embedding table in host memory (--cpu-embeddings).

    `aux_hidden_state_layers` (EAGLE-3; empty by default): for each listed layer i, forward records the residual
    stream entering layer i, concatenated in layer order as `aux_hidden_states` [T, n * hidden]. It is an
    attribute, not a second return value, so the forward signature and the CUDA graphs' outputs stay as they are.
    `aux_buffer` (set by the CUDA-graph runner): a static [rows, n * hidden] tensor that forward writes the states
    into when the step fits, so that a graph replay leaves them there; otherwise each forward allocates them."""

    def __init__(self, config: ModelConfig, max_positions: int, prefix: str = "model", host_embeddings: bool = False):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, host_embeddings)
        self.layers = nn.ModuleList(DecoderLayer(config, f"{prefix}.layers.{i}")
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, max_positions)
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.aux_hidden_states: torch.Tensor | None = None
        self.aux_buffer: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
                md: AttentionMetadata, mm: MultimodalEmbeds | DenseMultimodalEmbeds | None = None) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if mm is not None:
            h = mm.place(h)
        cos, sin = self.rotary(positions)
        residual = None
        taps = sorted(set(self.aux_hidden_state_layers))
        aux = self._aux_output(h, len(taps)) if taps else None
        for i, layer in enumerate(self.layers):
            if i in taps:
                j, width = taps.index(i), h.shape[-1]
                aux[:, j * width:(j + 1) * width] = h if residual is None else h + residual
            h, residual = layer(h, residual, cos, sin, kv_caches[i], md)
            if mm is not None:
                # Qwen3-VL deepstack: the i-th vision tap is added to the image tokens after layer i.
                h = mm.add_deepstack(h, i)
        h, _ = self.norm(h, residual)
        return h

    def _aux_output(self, h: torch.Tensor, n: int) -> torch.Tensor:
        """Where this forward's captured states go: the static buffer's first rows when they fit, else new."""
        rows, width, buf = h.shape[0], n * h.shape[-1], self.aux_buffer
        fits = buf is not None and buf.shape[0] >= rows and buf.shape[1] == width
        out = buf[:rows] if fits else h.new_empty(rows, width)
        self.aux_hidden_states = out
        return out


class CausalLM(nn.Module):
    """Llama / Qwen3: decoder + lm_head (tied to the embedding when the config says so). `decoder_name` is the
    decoder's attribute, as the checkpoint names it (`model.*`; Qwen3-VL: `language_model.*`)."""
    decoder_name = "model"

    def __init__(self, config: ModelConfig, max_positions: int, host_embeddings: bool = False,
                 prefix: str = "model"):
        super().__init__()
        self.config = config
        setattr(self, self.decoder_name, TextDecoder(config, max_positions, prefix=prefix,
                                                     host_embeddings=host_embeddings))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.decoder.embed_tokens.weight

    @property
    def decoder(self) -> TextDecoder:
        return getattr(self, self.decoder_name)

    def forward(self, input_ids, positions, kv_caches, md, mm: MultimodalEmbeds | None = None) -> torch.Tensor:
        return self.decoder(input_ids, positions, kv_caches, md, mm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 [S, vocab] on every rank (a collective under tensor parallelism)."""
        return self.lm_head.compute_logits(hidden)
