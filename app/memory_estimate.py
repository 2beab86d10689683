"""GPU memory of the engine on a card, computed from the model's config.json and the engine flags the memory
depends on, without torch: what app/fit.py weighs its steps with.

The engine sizes its KV pool (engine/worker/memory.py, engine/worker/kv_sizing.py) as gpu_memory_utilization x total memory
minus the weights (with the rotary tables), the memory held outside torch and the activation peak of a profiled
worst-case step; the CUDA graph pools and the encoder cache then come out of the utilization's headroom (under
--gpu-memory-limit: out of the limit). estimate() makes the same sum with the figures of the README ("Which
checkpoint for which GPU").

The worst-case step has three phases: the decoder on max_num_batched_tokens tokens, the sampling of max_num_seqs
rows, the largest image through the vision encoder. Without a limit the engine profiles torch's allocated peak,
the largest phase. Under a limit it profiles the allocator's reserved peak, and each phase's freed blocks stay
reserved while the next allocates its own: the phases add up. Both logged H200 profiles under a limit match the
sum (FP8 at 16 GiB: 2.37 GB logged, 2.38 computed; 4-bit at 8 GiB with 1024-token steps: 0.56 logged, 0.55
computed with the dequantized weight below; the largest phase alone would be 1.17 and 0.31)."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from app.checkpoints import GB, GiB, WeightFormat, weight_format
from engine.args import EngineArgs
from engine.errors import ModelLoadError
from engine.inputs.processor_config import DEFAULT_MAX_PIXELS, image_processor_config, pixel_bounds
from engine.sizing import (LIMIT_SLACK_BYTES, MAX_GRAPH_PATCHES, PREFILL_BUCKETS, batch_size_ladder,
                           scratch_blocks_needed)

# Figures of the README (measured on the H200, or derived from its logged memory profile):
NON_TORCH_BYTES = int(0.73 * GB)     # CUDA context and libraries
DECODER_PEAK_PER_TOKEN = 0.9 * GB / 8192   # activation peak of a prefill step, per batched token
CUDA_GRAPH_BYTES = int(0.55 * GiB)   # the graph pools ("Captured CUDA graphs ... using")
# Computed from engine/sampler.py: per row and vocabulary entry, the worst-case step's top-p sampling holds fp32
# logits, their temperature-scaled copy, the sorted values, the int64 order, the cumulative softmax, a mask and the
# masked and scattered copies at once: ~30 bytes (half of the FP8 profile's sum below, which it matches).
SAMPLER_BYTES_PER_LOGIT = 30
GRAPH_PREFILL_TOKENS = PREFILL_BUCKETS[-1]         # the largest prefill bucket
GRAPH_SCRATCH_TOKENS = scratch_blocks_needed(1)    # the prefill graphs' scratch KV, kept out of the pool
# Under a limit the engine sets its own measure of the graph pools aside (engine/worker/kv_sizing.py: the reserved peak
# of each pool's largest step, plus every graph's output and the vision graph's inputs). For the 2048-token prefill
# step this figure makes the sum match the one logged profile: 0.82 GB for FP8 at 16 GiB (graphs + encoder cache
# 1.36 GB, less the 0.54 GB encoder cache) = 0.35 + 0.30 of outputs + 0.18 for the vision graph.
GRAPH_PREFILL_STEP_BYTES = int(0.35 * GB)
# engine/ops/triton/quant/table.py's WNA16_DEQUANT_ABOVE (engine/ops imports triton, so the launcher keeps this
# copy; tests/test_app_fit.py fails if the two differ): integer-format linears on more tokens than this are
# dequantized to bf16 whole, then multiplied by cuBLAS; the step's largest dequantized weight (gate_up: 192 MiB at
# the 8B) is live beside the activations, in the profiled step and in the 2048-token graph the engine measures
# under a limit.
DEQUANT_ABOVE_TOKENS = 64


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
    vit_input_bytes_per_patch: int = 0  # a vision graph's static inputs: a patch's pixels and position row, bf16
    max_pixels: int = DEFAULT_MAX_PIXELS
    largest_linear: int = 0          # weights of the decoder's largest fused linear layer (gate_up)
    integer_weights: bool = False    # AWQ / GPTQ / compressed-tensors int: dequantized for prefill-sized steps

    @classmethod
    def from_config(cls, config: dict, preprocessor: dict | None = None) -> "ModelShape":
        t = config.get("text_config", config)
        heads = t["num_attention_heads"]
        kv_heads, hidden, inter = t.get("num_key_value_heads", heads), t["hidden_size"], t["intermediate_size"]
        head_dim = t.get("head_dim") or hidden // heads
        fmt = weight_format(config)
        shape = cls(layers=t["num_hidden_layers"], kv_heads=kv_heads, head_dim=head_dim, hidden=hidden,
                    vocab=t["vocab_size"], max_positions=int(t.get("max_position_embeddings", 4096)),
                    tied=bool(config.get("tie_word_embeddings", t.get("tie_word_embeddings", False))),
                    largest_linear=hidden * max((heads + 2 * kv_heads) * head_dim, 2 * inter),
                    integer_weights=isinstance(fmt, WeightFormat) and fmt.integer)
        v = config.get("vision_config")
        if not v:
            return shape
        taps, merge = len(v.get("deepstack_visual_indexes", [])), v["spatial_merge_size"]
        patch_dim = v.get("in_channels", 3) * v["temporal_patch_size"] * v["patch_size"] ** 2
        return replace(shape, vit_bytes_per_patch=vit_bytes_per_patch(v), patch_pixels=v["patch_size"] ** 2,
                       vit_input_bytes_per_patch=(patch_dim + v["hidden_size"]) * 2,
                       token_pixels=(v["patch_size"] * merge) ** 2,
                       encoder_bytes_per_token=(1 + taps) * v["out_hidden_size"] * 2,
                       max_pixels=pixel_bounds(preprocessor or {})[1])

    @classmethod
    def from_model_dir(cls, path: Path, config: dict | None = None) -> "ModelShape":
        """From the directory's config.json (or `config`, as read and perhaps amended) and its image-processor
        settings where there are some (as the engine finds them)."""
        config = config if config is not None else json.loads((path / "config.json").read_text())
        try:
            processor = image_processor_config(path) if config.get("vision_config") else None
        except ModelLoadError:      # the engine refuses to load it; the sum takes the processor's defaults
            processor = None
        return cls.from_config(config, processor)

    def with_format(self, fmt: WeightFormat) -> "ModelShape":
        """The same model with its decoder's linear layers stored as `fmt`."""
        return replace(self, integer_weights=fmt.integer)

    def dequant_bytes(self, tokens: int) -> int:
        """The bf16 weight a step of `tokens` tokens dequantizes whole (0 where the kernels read packed weights)."""
        return 2 * self.largest_linear if self.integer_weights and tokens > DEQUANT_ABOVE_TOKENS else 0

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


@dataclass(frozen=True)
class EngineSettings:
    """The engine flags the memory depends on, at the engine's defaults (engine/args.py)."""
    max_num_batched_tokens: int = max(8192, EngineArgs.max_num_seqs)   # EngineArgs.batched_tokens_budget's default
    max_num_seqs: int = EngineArgs.max_num_seqs
    encoder_cache_size: int = EngineArgs.encoder_cache_size
    max_pixels: int | None = None            # --mm-processor-kwargs '{"max_pixels": N}'; None: the processor's
    cpu_embeddings: bool = EngineArgs.cpu_embeddings
    kv_cache_dtype: str = EngineArgs.kv_cache_dtype
    enforce_eager: bool = EngineArgs.enforce_eager
    max_model_len: int | None = EngineArgs.max_model_len       # None: the model's context
    gpu_memory_utilization: float = EngineArgs.gpu_memory_utilization
    gpu_memory_limit: float | None = EngineArgs.gpu_memory_limit     # GiB
    block_size: int = EngineArgs.block_size


@dataclass(frozen=True)
class MemoryEstimate:
    """Where a card's memory goes under some settings (bytes), and the KV pool that leaves (tokens)."""
    usable: int
    weights: int                 # on the GPU, rotary tables included
    decoder_peak: int            # the three phases of the profiled worst-case step
    sampler_peak: int
    vision_peak: int
    activation_peak: int         # the largest phase; under --gpu-memory-limit their sum
    encoder_cache: int
    kv_bytes: int
    kv_bytes_per_token: int      # in the KV cache dtype
    pool_tokens: int             # after the CUDA graphs' scratch blocks
    max_len: int
    graphs: bool                 # the engine captures CUDA graphs (the decode graphs at least)
    prefill_graphs: bool         # ... and the prefill graphs, whose scratch blocks the pool spares
    headroom_short: int          # what the graphs and the encoder cache lack in the utilization's headroom
    headroom: int | None = None  # the utilization's headroom (None under --gpu-memory-limit: all reserved)

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
        vision = _image_patches(shape, s, max_len) * shape.vit_bytes_per_patch + rows * shape.vocab * 4
    decoder = int(tokens * DECODER_PEAK_PER_TOKEN) + shape.dequant_bytes(tokens)
    sampler = rows * shape.vocab * SAMPLER_BYTES_PER_LOGIT
    encoder = s.encoder_cache_size * shape.encoder_bytes_per_token
    per_token = shape.kv_bytes_per_token_as(s.kv_cache_dtype)
    scratch = scratch_blocks_needed(s.block_size)
    graphs = prefill_graphs = not s.enforce_eager
    if s.gpu_memory_limit is not None:       # the engine sets the graphs and the encoder cache aside itself
        usable, activation = int(s.gpu_memory_limit * GiB), decoder + sampler + vision
        kv = usable - on_gpu - NON_TORCH_BYTES - others - activation - encoder - LIMIT_SLACK_BYTES
        pools = graph_pools(shape, s, max_len, prefill=True) if graphs else 0
        if graphs and (kv - pools) // (per_token * s.block_size) <= 2 * scratch:
            # Too small for the prefill graphs: the engine sets aside the decode graphs' pool alone and then
            # leaves the prefill graphs out, however large the pool that gives.
            pools, prefill_graphs = graph_pools(shape, s, max_len, prefill=False), False
        kv -= pools
    else:
        usable, activation = int(s.gpu_memory_utilization * total), max(decoder, sampler, vision)
        kv = usable - on_gpu - NON_TORCH_BYTES - others - activation
    blocks = max(kv, 0) // (per_token * s.block_size)
    prefill_graphs = prefill_graphs and blocks > 2 * scratch
    pool = (blocks - scratch if prefill_graphs else blocks) * s.block_size
    short = 0 if s.gpu_memory_limit is not None else \
        max(0, encoder + (CUDA_GRAPH_BYTES if graphs else 0) - (total - usable))
    return MemoryEstimate(usable, on_gpu, decoder, sampler, vision, activation, encoder, kv, per_token, pool,
                          max_len, graphs, prefill_graphs, short,
                          None if s.gpu_memory_limit is not None else total - usable)


def _image_patches(shape: ModelShape, s: EngineSettings, max_len: int, max_patches: int | None = None) -> int:
    """Vision patches of the largest image a request may carry (within max_patches)."""
    patches = min(s.max_pixels or shape.max_pixels, max_len * shape.token_pixels) // shape.patch_pixels
    return patches if max_patches is None else min(patches, max_patches)


def graph_pools(shape: ModelShape, s: EngineSettings, max_len: int, prefill: bool) -> int:
    """What the engine sets aside for the CUDA graph pools under a limit (engine/worker/kv_sizing.py): the largest
    decoder graph's step (the 2048-token prefill bucket, or without prefill graphs the largest decode batch, at
    the prefill step's bytes per token), every graph's output row, and the vision graph's largest image."""
    rows = sum(batch_size_ladder(s.max_num_seqs))
    if prefill:
        step = GRAPH_PREFILL_STEP_BYTES + shape.dequant_bytes(GRAPH_PREFILL_TOKENS)
        rows += sum(PREFILL_BUCKETS)
    else:
        step = s.max_num_seqs * GRAPH_PREFILL_STEP_BYTES // GRAPH_PREFILL_TOKENS + shape.dequant_bytes(s.max_num_seqs)
    vision = 0
    if shape.vision:
        patches = _image_patches(shape, s, max_len, MAX_GRAPH_PATCHES)
        vision = patches * (shape.vit_bytes_per_patch + shape.vit_input_bytes_per_patch)
    return step + rows * shape.hidden * 2 + vision

