"""GPU memory of the engine on a card, computed from the model's config.json and the engine flags the memory
depends on, without torch: what app/fit.py weighs its steps with.

The engine sizes its KV pool (engine/memory.py, engine/kv_sizing.py) as gpu_memory_utilization x total memory
minus the weights (with the rotary tables), the memory held outside torch and the activation peak of a profiled
worst-case step; the CUDA graph pools and the encoder cache then come out of the utilization's headroom (under
--gpu-memory-limit: out of the limit). estimate() makes the same sum with the figures of the README ("Which
checkpoint for which GPU")."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from app.checkpoints import GB, GiB

# Figures of the README (measured on the H200, or derived from its logged memory profile):
NON_TORCH_BYTES = int(0.73 * GB)     # CUDA context and libraries
DECODER_PEAK_PER_TOKEN = 0.9 * GB / 8192   # activation peak of a prefill step, per batched token
CUDA_GRAPH_BYTES = int(0.55 * GiB)   # the graph pools ("Captured CUDA graphs ... using")
# Computed from engine/sampler.py (not measured): per row and vocabulary entry, the worst-case step's top-p
# sampling holds fp32 logits, their temperature-scaled copy, the sorted values, the int64 order, the cumulative
# softmax, a mask and the masked and scattered copies at once: ~30 bytes.
SAMPLER_BYTES_PER_LOGIT = 30
# engine/cuda_graphs.py: prefill graphs keep 2 x 2048 tokens of scratch KV blocks out of the pool, and are not
# captured when the pool holds fewer than twice that.
GRAPH_SCRATCH_TOKENS = 4096
LIMIT_SLACK_BYTES = 256 << 20        # engine/memory.py: set aside under --gpu-memory-limit for the allocator
PROCESSOR_MAX_PIXELS = 16_777_216    # engine/inputs/image_processor.py's default (4096x4096)


@dataclass(frozen=True)
class ModelShape:
    """What the memory sum needs from config.json (and preprocessor_config.json)."""
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    tied: bool
    max_positions: int
    vit_bytes_per_patch: int = 0     # 0: a text-only model
    patch_pixels: int = 256          # pixels per vision patch
    token_pixels: int = 1024         # pixels per LLM token (a 2x2 block of patches)
    encoder_bytes_per_token: int = 0  # a cached image token: the merger's row and the deepstack rows, bf16
    max_pixels: int = PROCESSOR_MAX_PIXELS

    @classmethod
    def from_config(cls, config: dict, preprocessor: dict | None = None) -> "ModelShape":
        t = config.get("text_config", config)
        heads = t["num_attention_heads"]
        shape = cls(layers=t["num_hidden_layers"], kv_heads=t.get("num_key_value_heads", heads),
                    head_dim=t.get("head_dim") or t["hidden_size"] // heads, hidden=t["hidden_size"],
                    vocab=t["vocab_size"], max_positions=int(t.get("max_position_embeddings", 4096)),
                    tied=bool(config.get("tie_word_embeddings", t.get("tie_word_embeddings", False))))
        v = config.get("vision_config")
        if not v:
            return shape
        taps, merge = len(v.get("deepstack_visual_indexes", [])), v["spatial_merge_size"]
        return replace(shape, vit_bytes_per_patch=vit_bytes_per_patch(v), patch_pixels=v["patch_size"] ** 2,
                       token_pixels=(v["patch_size"] * merge) ** 2,
                       encoder_bytes_per_token=(1 + taps) * v["out_hidden_size"] * 2,
                       max_pixels=processor_max_pixels(preprocessor or {}))

    @classmethod
    def from_model_dir(cls, path: Path, config: dict | None = None) -> "ModelShape":
        """From the directory's config.json (or `config`, as read and perhaps amended) and its
        preprocessor_config.json where there is one."""
        pre = path / "preprocessor_config.json"
        return cls.from_config(config if config is not None else json.loads((path / "config.json").read_text()),
                               json.loads(pre.read_text()) if pre.is_file() else None)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * 2      # K and V, bf16

    def kv_bytes_per_token_as(self, kv_cache_dtype: str) -> int:
        """--kv-cache-dtype: auto keeps bf16; fp8 / fp8_e4m3 store one byte per element."""
        return self.kv_bytes_per_token // (1 if kv_cache_dtype == "auto" else 2)

    @property
    def embedding_bytes(self) -> int:
        return self.vocab * self.hidden * 2

    @property
    def vision(self) -> bool:
        return self.vit_bytes_per_patch > 0


def vit_bytes_per_patch(v: dict) -> int:
    """The vision encoder's peak per patch on the CUDA path (engine/model/qwen3_vl_vision.py), computed from its
    live tensors, not measured: the profiled image's fp32 pixels and their bf16 copy, the position rows and rotary
    tables, the residual stream with its norm (4 rows of hidden), the MLP's fused fc1+GELU output and fc2 output,
    and the deepstack features gathered so far."""
    patch_dim = v.get("in_channels", 3) * v["temporal_patch_size"] * v["patch_size"] ** 2
    h, head_dim = v["hidden_size"], v["hidden_size"] // v["num_heads"]
    rows = len(v.get("deepstack_visual_indexes", [])) * v["out_hidden_size"] // v["spatial_merge_size"] ** 2
    return patch_dim * (4 + 2) + 2 * h + 4 * head_dim + 4 * 2 * h + 2 * v["intermediate_size"] + 2 * h + 2 * rows


def processor_max_pixels(cfg: dict) -> int:
    """The image pixel cap as engine/inputs/image_processor.py reads it from preprocessor_config.json."""
    size = cfg.get("size") or {}
    return int(cfg.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or PROCESSOR_MAX_PIXELS)


@dataclass(frozen=True)
class EngineSettings:
    """The engine flags the memory depends on, at the engine's defaults (engine/args.py)."""
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    encoder_cache_size: int = 16384
    max_pixels: int | None = None            # --mm-processor-kwargs '{"max_pixels": N}'; None: the processor's
    cpu_embeddings: bool = False
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False
    max_model_len: int | None = None         # None: the model's context
    gpu_memory_utilization: float = 0.9
    gpu_memory_limit: float | None = None    # GiB
    block_size: int = 16


@dataclass(frozen=True)
class MemoryEstimate:
    """Where a card's memory goes under some settings (bytes), and the KV pool that leaves (tokens)."""
    usable: int
    weights: int                 # on the GPU, rotary tables included
    decoder_peak: int
    sampler_peak: int
    vision_peak: int
    encoder_cache: int
    kv_bytes: int
    kv_bytes_per_token: int      # in the KV cache dtype
    pool_tokens: int             # after the CUDA graphs' scratch blocks
    max_len: int
    graphs: bool                 # the engine captures CUDA graphs
    headroom_short: int          # what the graphs and the encoder cache lack in the utilization's headroom
    headroom: int | None = None  # the utilization's headroom (None under --gpu-memory-limit: all reserved)

    @property
    def activation_peak(self) -> int:
        return max(self.decoder_peak, self.sampler_peak, self.vision_peak)

    @property
    def context(self) -> int:
        return min(self.max_len, self.pool_tokens)


def estimate(total: int, weights: int, shape: ModelShape, s: EngineSettings, others: int = 0) -> MemoryEstimate:
    """The engine's KV sizing on a card of `total` bytes, with `weights` bytes of checkpoint weights, while other
    processes (a desktop, another engine) hold `others` bytes of it: the engine counts those as memory outside
    torch, as it counts its own CUDA context."""
    max_len = s.max_model_len or shape.max_positions
    on_gpu = weights - (shape.embedding_bytes if s.cpu_embeddings and not shape.tied else 0)
    on_gpu += max_len * shape.head_dim * 4                    # rotary cos and sin tables, fp32
    tokens = min(s.max_num_batched_tokens, max_len)
    rows = min(s.max_num_seqs, tokens)
    vision = 0
    if shape.vision:          # the largest image a request may carry, through the ViT beside the step's logits
        pixels = min(s.max_pixels or shape.max_pixels, max_len * shape.token_pixels)
        vision = pixels // shape.patch_pixels * shape.vit_bytes_per_patch + rows * shape.vocab * 4
    decoder, sampler = int(tokens * DECODER_PEAK_PER_TOKEN), rows * shape.vocab * SAMPLER_BYTES_PER_LOGIT
    encoder = s.encoder_cache_size * shape.encoder_bytes_per_token
    graph_bytes = 0 if s.enforce_eager else CUDA_GRAPH_BYTES
    if s.gpu_memory_limit is not None:       # the engine sets the graphs and the encoder cache aside itself
        usable, reserve = int(s.gpu_memory_limit * GiB), graph_bytes + encoder + LIMIT_SLACK_BYTES
    else:
        usable, reserve = int(s.gpu_memory_utilization * total), 0
    kv = usable - on_gpu - NON_TORCH_BYTES - others - max(decoder, sampler, vision) - reserve
    per_token = shape.kv_bytes_per_token_as(s.kv_cache_dtype)
    blocks = max(kv, 0) // (per_token * s.block_size)
    scratch = GRAPH_SCRATCH_TOKENS // s.block_size
    graphs = not s.enforce_eager and blocks > 2 * scratch
    pool = (blocks - scratch if graphs else blocks) * s.block_size
    short = 0 if s.gpu_memory_limit is not None else \
        max(0, encoder + (graph_bytes if graphs else 0) - (total - usable))
    return MemoryEstimate(usable, on_gpu, decoder, sampler, vision, encoder, kv, per_token, pool, max_len, graphs,
                          short, None if s.gpu_memory_limit is not None else total - usable)
