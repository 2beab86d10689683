"""Qwen3-VL-8B-Instruct checkpoints in the Hugging Face cache, bf16 and quantized, and which one fits this GPU.

A checkpoint's format comes from its config.json (`quantization_config`, read by the engine's own parser); its
weight size is computed from the config's shapes as the engine holds them on the GPU: the decoder's linear layers
in the checkpoint's format (integer formats repacked with a bf16 scale and zero point per group), and the embeddings,
lm_head, norms and the whole vision tower in bf16 (a checkpoint that ships its vision blocks quantized, which its
exclusion list `modules_to_not_convert` / `ignore` shows, has them dequantized at load). Without torch: the
launcher must start without it, so it imports only the engine's torch-free modules.

    python -m app.checkpoints [CONFIG.json]     # the weight sizes of each format for that config
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from engine.errors import ModelLoadError
from engine.model.quantization.config import Fp8BlockScheme, Scheme
from engine.model.quantization.parse import parse_quantization_config

GB = 1e9
GiB = 1 << 30
TARGET_MARK = "qwen3-vl-8b-instruct"
# What a repo name carries when it holds a quantized checkpoint.
QUANT_MARKER = re.compile(r"awq|gptq|fp8|w4a16|w8a8|w8a16|w4a8|int4|int8|4bit|8bit|4-bit|8-bit|nvfp4|mxfp4|"
                          r"quantized|compressed", re.IGNORECASE)
# The 8B's shapes, for a cached config.json that lacks them (sizes are then those of the published model).
REFERENCE_CONFIG = Path(__file__).resolve().parent.parent / "bench" / "model_configs" / "qwen3-vl-8b-instruct" / \
    "config.json"
# Beyond the weights, with default flags: CUDA context (~0.7 GB), the activation peak of an 8192-token step,
# CUDA graph pools (~0.6 GB), a full encoder cache (0.5 GB) and a KV pool of some thousands of tokens.
RUNTIME_BYTES = int(3.5 * GB)


@dataclass(frozen=True)
class WeightFormat:
    """How the decoder's linear layers are stored."""
    name: str                     # "bf16", "fp8", "awq 4-bit g128", ...
    bits: int                     # 16, 8 or 4
    group_size: int | None = None  # integer formats: values per scale (None: one per output channel)
    zero_points: bool = False
    block: tuple[int, int] | None = None   # fp8: a float32 scale per (out, in) block
    vision_quantized: bool = False         # the checkpoint ships the vision blocks quantized (dequantized at load)

    @property
    def precision_rank(self) -> int:
        """Higher is closer to the original weights: the order of preference when several fit."""
        return self.bits

    @property
    def integer(self) -> bool:
        """Integer weight groups (AWQ, GPTQ, compressed-tensors int4/int8): the engine's 4/8-bit kernels."""
        return self.bits < 16 and self.block is None


BF16 = WeightFormat("bf16", 16)


def weight_format(config: dict) -> WeightFormat | str:
    """The format of a checkpoint from its config.json as the engine reads it (the engine's own parser,
    engine/model/quantization/parse.py), or why the engine refuses it (a string)."""
    try:
        qc = parse_quantization_config(config.get("quantization_config"))
    except ModelLoadError as e:
        return e.message
    if qc is None:
        return BF16
    decoder = "model.language_model.layers.0.mlp.gate_proj" if config.get("vision_config") else \
        "model.layers.0.mlp.gate_proj"
    fmt = _format_of(qc.method, qc.scheme_for(decoder))
    return replace(fmt, vision_quantized=qc.scheme_for(VISION_PROBE) is not None)


# A vision block's linear layer as the checkpoints name it: whether the exclusion list covers the vision blocks.
VISION_PROBE = "model.visual.blocks.0.attn.qkv"


def _format_of(method: str, scheme: Scheme | None) -> WeightFormat:
    if scheme is None:
        return BF16
    if isinstance(scheme, Fp8BlockScheme):
        return WeightFormat("fp8", 8, block=scheme.block_size)
    group = scheme.group_size if scheme.group_size > 0 else None
    return WeightFormat(f"{method} {scheme.bits}-bit" + (f" g{group}" if group else ""), scheme.bits, group,
                        zero_points=not scheme.symmetric)


# ---- sizes from the config -----------------------------------------------------------------------------------
def decoder_linear_shapes(config: dict) -> list[tuple[int, int]]:
    """(out, in) of every linear layer of the decoder (the layers a quantized checkpoint stores quantized)."""
    t = config.get("text_config", config)
    h, inter, layers = t["hidden_size"], t["intermediate_size"], t["num_hidden_layers"]
    heads, kv = t["num_attention_heads"], t.get("num_key_value_heads", t["num_attention_heads"])
    hd = t.get("head_dim") or h // heads
    per_layer = [(heads * hd, h), (kv * hd, h), (kv * hd, h), (h, heads * hd), (inter, h), (inter, h), (h, inter)]
    return per_layer * layers


def vision_linear_shapes(config: dict) -> list[tuple[int, int]]:
    """(out, in) of the vision blocks' linear layers (qkv, proj, fc1, fc2); none for a text-only model."""
    v = config.get("vision_config")
    if not v:
        return []
    vh, vi = v["hidden_size"], v["intermediate_size"]
    return [(3 * vh, vh), (vh, vh), (vi, vh), (vh, vi)] * v["depth"]


def other_params(config: dict) -> int:
    """Parameters outside the decoder's and the vision blocks' linear weights: embeddings, lm_head, norms, biases,
    the patch and position embeddings and the mergers (Qwen3-VL layout)."""
    t = config.get("text_config", config)
    h, heads = t["hidden_size"], t["num_attention_heads"]
    hd = t.get("head_dim") or h // heads
    vocab, layers = t["vocab_size"], t["num_hidden_layers"]
    tied = config.get("tie_word_embeddings", t.get("tie_word_embeddings", False))
    n = vocab * h * (1 if tied else 2) + layers * (2 * h + 2 * hd) + h     # + q/k norms, layer norms, final norm
    return n + _vision_other_params(config)


def _vision_other_params(config: dict) -> int:
    """The vision tower's parameters outside its blocks' linear weights."""
    v = config.get("vision_config")
    if not v:
        return 0
    vh, vi, out = v["hidden_size"], v["intermediate_size"], v["out_hidden_size"]
    block_rest = 3 * vh + vh + vi + vh + 4 * vh                    # linear biases, two LayerNorms
    patch = v.get("in_channels", 3) * v["temporal_patch_size"] * v["patch_size"] ** 2 * vh + vh
    merged = vh * v["spatial_merge_size"] ** 2
    merger = merged * merged + merged + merged * out + out        # fc1, fc2 (the norm is counted below)
    deepstack = len(v.get("deepstack_visual_indexes", []))
    return (v["depth"] * block_rest + patch + v["num_position_embeddings"] * vh + (merger + 2 * vh)
            + deepstack * (merger + 2 * merged))


def vision_bytes(config: dict) -> int:
    """Device bytes of the vision tower: bf16 (a tower shipped quantized is dequantized at load), and whole on
    every rank under tensor parallelism."""
    return 2 * (sum(o * i for o, i in vision_linear_shapes(config)) + _vision_other_params(config))


def weight_bytes(config: dict, fmt: WeightFormat) -> int:
    """Device bytes of the weights as the engine holds them: the decoder's linear layers in `fmt` (quantized
    values and their scales and zero points), the rest in bf16 -- the vision tower too when the checkpoint ships
    its blocks quantized, since the engine dequantizes it once at load (engine/model/loader.py)."""
    quantized = sum(_linear_bytes(out, inp, fmt) for out, inp in decoder_linear_shapes(config))
    return quantized + 2 * (sum(o * i for o, i in vision_linear_shapes(config)) + other_params(config))


def _linear_bytes(out: int, inp: int, fmt: WeightFormat) -> int:
    n = out * inp
    if fmt.bits == 16:
        return 2 * n
    if fmt.block is not None:                                         # fp8 with a float32 scale per block
        bo, bi = fmt.block
        return n + 4 * (-(-out // bo)) * (-(-inp // bi))
    # Integer weights are repacked at load (engine/model/quantization/layers.py): int32 words of packed values,
    # and a scale and a zero point per group in the model dtype (symmetric formats get their implied zero).
    groups = out * (-(-inp // fmt.group_size)) if fmt.group_size else out
    return -(-n * fmt.bits // 8) + 2 * groups + 2 * groups


# ---- the cache -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CachedCheckpoint:
    repo: str                     # "Qwen/Qwen3-VL-8B-Instruct-FP8"
    path: Path                    # its newest complete snapshot
    fmt: WeightFormat | None      # None when the engine cannot load it
    weights: int = 0              # bytes, computed
    skipped: str | None = None    # why it is not a candidate
    replicated: int = 0           # of which every rank holds all (the vision tower) under tensor parallelism

    @property
    def needs(self) -> int:
        return self.weights + RUNTIME_BYTES

    def needs_per_gpu(self, tensor_parallel_size: int = 1) -> int:
        """What each of N GPUs needs: its share of the split weights, the replicated ones, the run time."""
        if tensor_parallel_size == 1:
            return self.needs
        return (self.weights - self.replicated) // tensor_parallel_size + self.replicated + RUNTIME_BYTES

    def describe(self) -> str:
        if self.fmt is None:
            return f"{self.repo} (not used: {self.skipped})"
        return f"{self.repo} ({self.fmt.name}, weights ~{self.weights / GB:.1f} GB, needs ~{self.needs / GB:.0f} GB)"


def is_target_repo(repo: str) -> bool:
    """The official bf16 repo, or a repo named after it with a quantization marker."""
    name = repo.split("/")[-1].lower()
    return repo.lower() == "qwen/" + TARGET_MARK or (TARGET_MARK in name and bool(QUANT_MARKER.search(name)))


def cached_checkpoints(hub: Path, latest_snapshot) -> list[CachedCheckpoint]:
    """Every Qwen3-VL-8B-Instruct repo (bf16 or quantized) with a complete snapshot under `hub`."""
    found = []
    for repo_dir in sorted(hub.glob("models--*")) if hub.is_dir() else []:
        repo = repo_dir.name.removeprefix("models--").replace("--", "/", 1)
        if not is_target_repo(repo):
            continue
        snap = latest_snapshot(repo_dir)
        if snap is None:
            continue
        try:
            config = json.loads((snap / "config.json").read_text())
        except (OSError, ValueError) as err:
            found.append(CachedCheckpoint(repo, snap, None, skipped=f"unreadable config.json: {err}"))
            continue
        fmt = weight_format(config)
        if isinstance(fmt, str):
            found.append(CachedCheckpoint(repo, snap, None, skipped=fmt))
            continue
        try:
            size, vision = weight_bytes(config, fmt), vision_bytes(config)
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            reference = json.loads(REFERENCE_CONFIG.read_text())
            size, vision = weight_bytes(reference, fmt), vision_bytes(reference)
        found.append(CachedCheckpoint(repo, snap, fmt, size, replicated=min(vision, size)))
    return found


@dataclass(frozen=True)
class Choice:
    checkpoint: CachedCheckpoint
    reason: str
    others: list[CachedCheckpoint]


def choose(found: list[CachedCheckpoint], gpu: tuple[str, int] | None,
           tensor_parallel_size: int = 1) -> Choice | None:
    """The most precise checkpoint whose weights plus run-time memory fit the GPU's total memory (with
    tensor parallelism: each of N such GPUs holding its share); with none fitting, the smallest; without a GPU
    to read, bf16 if present, else the most precise. Official Qwen repos first among equals."""
    n = tensor_parallel_size
    usable = [c for c in found if c.fmt is not None]
    if not usable:
        return None
    by_quality = sorted(usable, key=lambda c: (-c.fmt.precision_rank, not c.repo.startswith("Qwen/"), c.weights))
    if gpu is None:
        pick, reason = by_quality[0], "no NVIDIA GPU found (nvidia-smi): the most precise checkpoint"
    else:
        name, total = gpu
        if n > 1:
            name = f"{n} x {name}"
        fits = [c for c in by_quality if c.needs_per_gpu(n) <= total]
        share = "its weights" if n == 1 else f"1/{n} of its weights (the vision tower whole)"
        if fits:
            pick = fits[0]
            reason = (f"the most precise one that fits {name} ({total / GiB:.0f} GiB; a checkpoint needs {share} "
                      f"+ ~{RUNTIME_BYTES / GB:.1f} GB at run time{' per GPU' if n > 1 else ''})")
        else:
            pick = min(usable, key=lambda c: c.weights)
            reason = (f"none fits {name} ({total / GiB:.0f} GiB) with default flags; the smallest needs "
                      f"~{pick.needs_per_gpu(n) / GB:.0f} GB{' per GPU' if n > 1 else ''} with them: the "
                      f"launcher fits the engine's flags to the card where it can (README: 'Which checkpoint "
                      f"for which GPU')")
    return Choice(pick, reason, [c for c in found if c is not pick])


# The checkpoints `./run_app.sh --model REPO` fetches from the Hub, most precise first (README: "Which checkpoint
# for which GPU").
HUB_CHECKPOINTS = (("Qwen/Qwen3-VL-8B-Instruct", BF16),
                   ("Qwen/Qwen3-VL-8B-Instruct-FP8", WeightFormat("fp8", 8, block=(128, 128))),
                   ("Qwen/Qwen3-VL-8B-Instruct-AWQ", WeightFormat("awq 4-bit g128", 4, 128, zero_points=True)))


def hub_suggestion(gpu: tuple[str, int]) -> Choice:
    """The Hub checkpoint the launcher would pick for this GPU if it were in the cache (choose()'s rule)."""
    reference = json.loads(REFERENCE_CONFIG.read_text())
    listed = [CachedCheckpoint(repo, Path(repo), fmt, weight_bytes(reference, fmt)) for repo, fmt in HUB_CHECKPOINTS]
    return choose(listed, gpu)


def gpu_memory(env=os.environ, count: int = 1) -> tuple[str, int] | None:
    """(name, total bytes) of the GPU the engine will use (CUDA_VISIBLE_DEVICES' first, else GPU 0), or the
    smallest of the first `count` (tensor parallelism), from nvidia-smi; None without one.
    LOCALCHAT_GPU_MEMORY_GIB overrides it (choose as for cards of that size)."""
    if env.get("LOCALCHAT_GPU_MEMORY_GIB"):
        return "LOCALCHAT_GPU_MEMORY_GIB", int(float(env["LOCALCHAT_GPU_MEMORY_GIB"]) * GiB)
    return _query_gpus("memory.total", env, count)


def gpu_memory_used(env=os.environ) -> int | None:
    """Bytes already in use on the GPU the engine will use (by a desktop, another engine, ...), from nvidia-smi;
    None without one, and under LOCALCHAT_GPU_MEMORY_GIB (a card of that size, as if empty)."""
    if env.get("LOCALCHAT_GPU_MEMORY_GIB"):
        return None
    gpu = _query_gpus("memory.used", env)
    return None if gpu is None else gpu[1]


def _query_gpus(field: str, env, count: int = 1) -> tuple[str, int] | None:
    """(name, `field` in bytes) of the GPU(s) the engine will use, as parse_nvidia_smi picks them; None without
    nvidia-smi or when it fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, f"--query-gpu=name,{field}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_nvidia_smi(out, env.get("CUDA_VISIBLE_DEVICES"), count)


def parse_nvidia_smi(out: str, visible: str | None, count: int = 1) -> tuple[str, int] | None:
    """The first `count` GPUs the engine sees (CUDA_VISIBLE_DEVICES' indices, else in order; a UUID list counts
    from GPU 0), the smallest of them; None when fewer are there."""
    rows = [line.rsplit(",", 1) for line in out.strip().splitlines() if "," in line]
    listed = [part.strip() for part in (visible or "").split(",")]
    indices = [int(i) for i in listed if i.isdigit()] if listed and listed[0].isdigit() else list(range(len(rows)))
    indices = indices[:count]
    if not rows or len(indices) < count or any(i >= len(rows) for i in indices):
        return None
    try:
        gpus = [(rows[i][0].strip(), int(float(rows[i][1])) * 2**20) for i in indices]
    except ValueError:
        return None
    return min(gpus, key=lambda g: g[1])


def main(argv: list[str]) -> None:
    path = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent / "bench" / "model_configs" / \
        "qwen3-vl-8b-instruct" / "config.json"
    config = json.loads(path.read_text())
    decoder, vision = (sum(o * i for o, i in shapes(config)) for shapes in (decoder_linear_shapes,
                                                                            vision_linear_shapes))
    print(f"{path}: decoder linear layers {decoder / 1e9:.3f} G params (in the checkpoint's format); vision "
          f"blocks' linear layers {vision / 1e9:.3f} G and the rest {other_params(config) / 1e9:.3f} G (bf16 on "
          f"the GPU)")
    for fmt in (BF16, WeightFormat("fp8 block 128x128", 8, block=(128, 128)),
                WeightFormat("int8 g128", 8, 128), WeightFormat("int4 g128", 4, 128)):
        size = weight_bytes(config, fmt)
        print(f"{fmt.name:>18}: weights on the GPU {size / GB:6.2f} GB ({size / GiB:5.2f} GiB)")
    print("(integer formats: symmetric or with zero points alike, the engine holds a bf16 zero point per group; "
          "a vision tower shipped quantized is dequantized to bf16 at load)")

if __name__ == "__main__":
    main(sys.argv[1:])
