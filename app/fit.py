"""Engine flags that fit the GPU, as llama.cpp's `--fit` and LM Studio do: the launcher adds them so that the
chosen checkpoint starts with a KV pool of at least TARGET_CONTEXT tokens on the user's card.

The engine sizes its KV pool (engine/memory.py, engine/kv_sizing.py) as gpu_memory_utilization x total memory
minus the weights (with the rotary tables), the memory held outside torch and the activation peak of a profiled
worst-case step; the CUDA graph pools and the encoder cache then come out of the utilization's headroom (under
--gpu-memory-limit: out of the limit). This module computes the same sum from the config, with the figures of the
README ("Which checkpoint for which GPU"), and when the defaults leave too little KV room it takes the steps
below in order, the ones that cost a user least first, keeping each one only if it helps and stopping once the
target fits. Flags the user passed are never changed: they fix those settings, and they follow ours on the
command line, so theirs win in the engine's parser too. Pure Python: the launcher starts before torch exists.

    python -m app.fit [--table]       # the flags for 8/12/16/24 GiB cards and each checkpoint kind (README)
"""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, replace
from pathlib import Path

from app.checkpoints import weight_bytes, weight_format

GB, GiB = 1e9, 1 << 30
TARGET_CONTEXT = 8192                # tokens of KV pool the fit aims at (less when the model's context is less)
MIN_CONTEXT = 4096                   # below this the plan says it does not fit
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
IMAGE_CAP_PIXELS = 1024 * 1024       # the images the launcher lets through whole (a 1024x1024 photo)
PROCESSOR_MAX_PIXELS = 16_777_216    # engine/inputs/image_processor.py's default (4096x4096)
CONTEXT_STEP = 1024                  # --max-model-len is set in multiples of this


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


def estimate(total: int, weights: int, shape: ModelShape, s: EngineSettings) -> MemoryEstimate:
    """The engine's KV sizing on a card of `total` bytes, with `weights` bytes of checkpoint weights."""
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
        usable, reserve = int(s.gpu_memory_limit * GiB), graph_bytes + encoder
    else:
        usable, reserve = int(s.gpu_memory_utilization * total), 0
    kv = usable - on_gpu - NON_TORCH_BYTES - max(decoder, sampler, vision) - reserve
    per_token = shape.kv_bytes_per_token_as(s.kv_cache_dtype)
    blocks = max(kv, 0) // (per_token * s.block_size)
    scratch = GRAPH_SCRATCH_TOKENS // s.block_size
    graphs = not s.enforce_eager and blocks > 2 * scratch
    pool = (blocks - scratch if graphs else blocks) * s.block_size
    short = 0 if s.gpu_memory_limit is not None else \
        max(0, encoder + (graph_bytes if graphs else 0) - (total - usable))
    return MemoryEstimate(usable, on_gpu, decoder, sampler, vision, encoder, kv, per_token, pool, max_len, graphs,
                          short, None if s.gpu_memory_limit is not None else total - usable)


@dataclass(frozen=True)
class FitFlag:
    args: tuple[str, ...]
    reason: str

    def __str__(self) -> str:
        return f"{shlex.join(self.args)}: {self.reason}"


@dataclass(frozen=True)
class FitPlan:
    flags: tuple[FitFlag, ...]
    estimate: MemoryEstimate | None
    summary: str
    fits: bool = True

    def args(self) -> list[str]:
        return [a for f in self.flags for a in f.args]

    def lines(self) -> list[str]:
        return [self.summary] + [f"  {f}" for f in self.flags]


# ---- the flags the user gave ---------------------------------------------------------------------------------
# flag -> (EngineSettings field, parser)
USER_FLAGS = {
    "--max-num-batched-tokens": ("max_num_batched_tokens", int), "--max-num-seqs": ("max_num_seqs", int),
    "--encoder-cache-size": ("encoder_cache_size", int), "--max-model-len": ("max_model_len", int),
    "--gpu-memory-utilization": ("gpu_memory_utilization", float),
    "--gpu-memory-limit": ("gpu_memory_limit", lambda v: float(v.lower().removesuffix("gib"))),
    "--block-size": ("block_size", int),
    "--mm-processor-kwargs": ("max_pixels", lambda v: json.loads(v).get("max_pixels")),
    "--enforce-eager": ("enforce_eager", None), "--cpu-embeddings": ("cpu_embeddings", None),
    "--kv-cache-dtype": ("kv_cache_dtype", str),
}


def user_settings(args: list[str]) -> tuple[EngineSettings, set[str], str | None]:
    """The settings the user's engine flags fix, the fields they fix, and why the fit does not apply (or None).
    A value the engine would refuse is left to the engine to refuse."""
    values, given, skip = {}, set(), None
    for i, arg in enumerate(args):
        name, eq, inline = arg.partition("=")
        value = inline if eq else (args[i + 1] if i + 1 < len(args) else "")
        if name in USER_FLAGS:
            field_name, parse = USER_FLAGS[name]
            given.add(field_name)
            try:
                values[field_name] = True if parse is None else parse(value)
            except (ValueError, AttributeError, TypeError):
                values.pop(field_name, None)
        elif name == "--num-gpu-blocks-override":
            skip = "the KV pool size is given (--num-gpu-blocks-override)"
        elif name == "--device" and value == "cpu":
            skip = "the engine runs on the CPU (--device cpu)"
        elif name in ("--tensor-parallel-size", "-tp") and value.isdigit() and int(value) > 1:
            skip = "tensor parallelism: each GPU's share is not modelled here"
    values = {k: v for k, v in values.items() if v is not None}
    return EngineSettings(**values), given, skip


# ---- the steps -----------------------------------------------------------------------------------------------
def _steps(shape: ModelShape) -> list[dict]:
    """Setting changes in the order they cost a user least: smaller worst-case images, the embedding table in
    host memory (a little PCIe traffic), an fp8 KV cache, smaller steps (prompt chunks and requests per step, each
    with a smaller image cache), no CUDA graphs.
    The fp8 cache costs some accuracy (K and V rounded to 3 mantissa bits) but doubles the pool at once, which is
    what vLLM users on such cards do; the smaller steps that follow cost speed on every long prompt and batch, and
    each frees far less (a 1024-token step instead of 8192 saves ~0.8 GB, the fp8 cache 72 KiB per token)."""
    steps = []
    if shape.vision and shape.max_pixels > IMAGE_CAP_PIXELS:
        steps.append({"max_pixels": IMAGE_CAP_PIXELS})
    if not shape.tied:
        steps.append({"cpu_embeddings": True})
    steps.append({"kv_cache_dtype": "fp8"})
    for tokens, seqs in ((4096, 64), (2048, 32), (1024, 16)):
        steps.append({"max_num_batched_tokens": tokens, "max_num_seqs": seqs})
        if shape.vision:
            steps.append({"encoder_cache_size": tokens})
    steps.append({"enforce_eager": True})
    return steps


def _score(e: MemoryEstimate, target: int) -> tuple:
    """Better: the graphs and the encoder cache fit their headroom, then more context up to the target."""
    return e.headroom_short == 0, min(e.context, target), -e.headroom_short


def _frees(after: MemoryEstimate, before: MemoryEstimate) -> bool:
    """Whether `after` leaves more room: the graphs and encoder cache within the headroom, then more KV room.
    Both are judged with `before`'s CUDA graphs: a pool that grows enough to hold the graphs' scratch blocks then
    needs their pools in the headroom too, which the smaller encoder caches of later steps provide."""
    def room(e: MemoryEstimate) -> tuple:
        short = 0 if e.headroom is None else \
            max(0, e.encoder_cache + (CUDA_GRAPH_BYTES if before.graphs else 0) - e.headroom)
        # KV room: the tokens the pool's bytes hold (an fp8 cache frees no bytes but halves a token's), or, short
        # of any, the bytes still missing (no fewer in fp8).
        kv = e.kv_bytes / e.kv_bytes_per_token if e.kv_bytes > 0 else e.kv_bytes
        return short == 0, -short, kv
    return room(after) > room(before)


def fit(total: int, weights: int, shape: ModelShape, user_args: list[str] | None = None,
        target: int = TARGET_CONTEXT) -> FitPlan:
    """The engine flags (beyond the user's) that give a KV pool of at least `target` tokens on a card of `total`
    bytes holding `weights` bytes of weights; none when the defaults do."""
    user, given, _ = user_settings(list(user_args or []))
    target = min(target, user.max_model_len or shape.max_positions, shape.max_positions)
    size = lambda s: estimate(total, weights, shape, s)       # noqa: E731
    start = size(user)
    if _score(start, target)[:2] == (True, target):
        return FitPlan((), start, f"the engine's defaults fit: KV pool ~{start.pool_tokens:,} tokens (computed)")
    cur, est = _walk(size, shape, user, given, target, _steps(shape))
    fits = est.headroom_short == 0 and est.context >= min(MIN_CONTEXT, target)
    flags = tuple(FitFlag(_flag_args(k, getattr(cur, k)), _reason(k, getattr(cur, k), start, est, shape))
                  for k in FLAG_ORDER if getattr(cur, k) != getattr(user, k))
    kv = f"KV pool ~{est.pool_tokens:,} tokens ({est.pool_tokens * est.kv_bytes_per_token / GB:.2f} GB, computed)"
    if fits:
        return FitPlan(flags, est, f"fitted, {kv}")
    return FitPlan(flags, est, f"does not fit even with these flags: {kv}, weights {est.weights / GB:.2f} GB on "
                               f"the GPU; use a smaller checkpoint (README: 'Which checkpoint for which GPU')", False)


def _walk(size, shape: ModelShape, user: EngineSettings, given: set[str], target: int, steps: list[dict]):
    """Take the steps in order, each one that helps, until the target fits: (settings, their estimate).
    Each candidate is judged at the context its pool holds (--max-model-len, unless the user gave one): a shorter
    context grows the pool, which then may hold the CUDA graphs' scratch blocks (engine/cuda_graphs.py)."""
    fitted = (lambda s: (s, size(s))) if "max_model_len" in given else \
        (lambda s: _fit_context(size, s, shape.max_positions))
    base = user
    if steps and "max_pixels" in steps[0] and "max_pixels" not in given:
        base = replace(base, **steps.pop(0))       # whenever the defaults do not fit: the cheapest step
    cur, est = fitted(base)

    def walk(todo: list[dict]) -> list[dict]:
        """Take the steps of `todo` that help, until the target fits; the ones not taken."""
        nonlocal base, cur, est
        left = []
        for step in todo:
            if _score(est, target)[:2] == (True, target):
                break
            change = {k: v for k, v in step.items() if k not in given and getattr(base, k) != v}
            if not change:
                continue
            cand, after = fitted(replace(base, **change))
            # A step is kept when it frees memory (monotone, unlike the pool, which loses the graphs' scratch
            # blocks once it is large enough to hold them); no CUDA graphs, when it gives more context.
            if _score(after, target) > _score(est, target) if "enforce_eager" in change else \
                    _frees(size(replace(base, **change)), size(base)):
                base, cur, est = replace(base, **change), cand, after
            else:
                left.append(step)
        return left

    # A step that frees nothing at its turn may free room once later steps have made some (an fp8 cache doubles
    # the tokens of a pool that is empty until smaller steps shrink the activation peak): a second turn, in order.
    walk(walk(steps))
    return cur, est


def _fit_context(size, cur: EngineSettings, max_positions: int):
    """--max-model-len: the longest context (a multiple of CONTEXT_STEP) the pool holds at that length: a shorter
    context needs smaller rotary tables and lets the engine profile smaller images, so the pool grows as the
    length shrinks (found by bisection; at least CONTEXT_STEP, at most the model's positions)."""
    at = lambda n: replace(cur, max_model_len=min(n * CONTEXT_STEP, max_positions))   # noqa: E731
    lo, hi = 1, min(max(size(at(1)).pool_tokens // CONTEXT_STEP, 1), max(max_positions // CONTEXT_STEP, 1))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if size(at(mid)).pool_tokens >= mid * CONTEXT_STEP:
            lo = mid
        else:
            hi = mid - 1
    return at(lo), size(at(lo))


FLAG_ORDER = ("max_model_len", "max_pixels", "cpu_embeddings", "kv_cache_dtype", "max_num_batched_tokens",
              "max_num_seqs", "encoder_cache_size", "enforce_eager")


def _flag_args(key: str, value) -> tuple[str, ...]:
    if key == "max_pixels":
        return "--mm-processor-kwargs", json.dumps({"max_pixels": value})
    if isinstance(value, bool):
        return ("--" + key.replace("_", "-"),)
    return "--" + key.replace("_", "-"), str(value)


def _reason(key: str, value, before: MemoryEstimate, after: MemoryEstimate, shape: ModelShape) -> str:
    """Why flag `key` is set to `value`: the figure it changes, under the engine's defaults and under the plan."""
    gb = lambda b: f"{b / GB:.2f} GB"   # noqa: E731
    side = int(value ** 0.5) if key == "max_pixels" else 0
    return {
        "max_model_len": f"the context the KV pool holds (computed); the engine would cap it there too, but only "
                         f"after sizing its rotary tables and largest image for {before.max_len:,} tokens",
        "max_pixels": f"larger images are scaled down to {side}x{side}: the engine profiles the largest image at "
                      f"{gb(after.vision_peak)} instead of {gb(before.vision_peak)}",
        "cpu_embeddings": f"the token-embedding table ({gb(shape.embedding_bytes)}) stays in host memory",
        "kv_cache_dtype": f"K and V stored in fp8 (e4m3): {after.kv_bytes_per_token / 1024:.0f} KiB per token "
                          f"instead of {before.kv_bytes_per_token / 1024:.0f}, twice the tokens in the same KV "
                          f"memory, at a small accuracy cost (each value rounded to 3 mantissa bits)",
        "max_num_batched_tokens": f"prompts run {value} tokens per step: activation peak {gb(after.decoder_peak)} "
                                  f"instead of {gb(before.decoder_peak)}",
        "max_num_seqs": f"{value} requests per step: sampling peak {gb(after.sampler_peak)} instead of "
                        f"{gb(before.sampler_peak)}",
        "encoder_cache_size": f"image features of {value} tokens kept for reuse: {gb(after.encoder_cache)} instead "
                              f"of {gb(before.encoder_cache)}, within the headroom beside the KV pool",
        "enforce_eager": f"no CUDA graphs ({gb(CUDA_GRAPH_BYTES)} of pools and {GRAPH_SCRATCH_TOKENS} tokens of "
                         f"scratch KV): steps launch op by op, decode is slower",
    }[key]


# ---- the launcher's side ------------------------------------------------------------------------------------
def fit_for_launch(model_path: Path, engine_args: list[str], env, gpu) -> FitPlan | None:
    """The plan for the launcher: None where the fit does not apply at all (no NVIDIA GPU, LOCALCHAT_FIT=0, a
    GGUF); a plan without flags, saying why, where it applies but adds nothing."""
    if env.get("LOCALCHAT_FIT", "1").strip().lower() in ("0", "false", "no", "off") or model_path.suffix == ".gguf":
        return None
    card = gpu(env)
    if card is None:
        return None
    name, total = card
    where = f"{name} ({total / GiB:.0f} GiB)"
    _, _, skip = user_settings(engine_args)
    try:
        config = json.loads((model_path / "config.json").read_text())
        fmt = weight_format(config)
        if isinstance(fmt, str):
            return FitPlan((), None, f"engine flags: not fitted ({fmt})", fits=False)
        pre = model_path / "preprocessor_config.json"
        shape = ModelShape.from_config(config, json.loads(pre.read_text()) if pre.is_file() else None)
        weights = weight_bytes(config, fmt)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as err:
        return FitPlan((), None, f"engine flags: not fitted (config.json unreadable: {err})", fits=False)
    if skip is not None:
        return FitPlan((), None, f"engine flags: not fitted to {where}: {skip}")
    plan = fit(total, weights, shape, engine_args)
    off = "; LOCALCHAT_FIT=0 adds none" if plan.flags else ""
    return replace(plan, summary=f"engine flags for {where}: {plan.summary}{off}")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--table"]:
        raise SystemExit(__doc__)
    from app.fit_table import table
    print(table())
