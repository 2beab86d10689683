"""Engine flags that fit the GPU, as llama.cpp's `--fit` and LM Studio do: the launcher adds them so that the
chosen checkpoint starts with a KV pool of at least TARGET_CONTEXT tokens on the user's card.

The memory the engine would take on the card is computed by app/memory_estimate.py (the engine's own sum, from
the config and the figures of the README); when the defaults leave too little KV room this module takes the steps
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

from app.checkpoints import GB, GiB, weight_bytes, weight_format
from app.memory_estimate import (CUDA_GRAPH_BYTES, GRAPH_SCRATCH_TOKENS, EngineSettings, MemoryEstimate, ModelShape,
                                 estimate)

TARGET_CONTEXT = 8192                # tokens of KV pool the fit aims at (less when the model's context is less)
# Once the fit is at work, a step that costs neither accuracy nor speed (the embedding table in host memory: a few
# KB over PCIe per step) is also taken for a roomier context, up to this.
ROOMY_CONTEXT = 16384
MIN_CONTEXT = 4096                   # below this the plan says it does not fit
IMAGE_CAP_PIXELS = 1024 * 1024       # the images the launcher lets through whole (a 1024x1024 photo)
CONTEXT_STEP = 1024                  # --max-model-len is set in multiples of this


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
    with a smaller image cache), no CUDA graphs (only when the minimum context needs it: eager decode steps are
    ~10x slower).
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
        target: int = TARGET_CONTEXT, others: int = 0) -> FitPlan:
    """The engine flags (beyond the user's) that give a KV pool of at least `target` tokens on a card of `total`
    bytes holding `weights` bytes of weights, `others` bytes of it taken by other processes; none when the
    defaults do."""
    user, given, _ = user_settings(list(user_args or []))
    target = min(target, user.max_model_len or shape.max_positions, shape.max_positions)
    size = lambda s: estimate(total, weights, shape, s, others)       # noqa: E731
    start = size(user)
    if _score(start, target)[:2] == (True, target):
        return FitPlan((), start, f"the engine's defaults fit: KV pool ~{start.pool_tokens:,} tokens (computed)")
    cur, est = _walk(size, shape, user, given, target, _steps(shape))
    cur, est = _roomier(size, shape, user, given, cur, est)
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
    context grows the pool, which then may hold the CUDA graphs' scratch blocks (engine/worker/cuda_graphs.py)."""
    fitted = _fitted(size, given, shape.max_positions)
    floor = min(MIN_CONTEXT, target)
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
            if "enforce_eager" in change and _score(est, floor)[:2] == (True, floor):
                left.append(step)   # eager steps decode ~10x slower (BENCHMARKS.md): only for the minimum context
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
    # No CUDA graphs only after both turns: the minimum context may fit once the second turn is done.
    last = [step for step in steps if "enforce_eager" in step]
    walk(walk([step for step in steps if step not in last]))
    walk(last)
    return cur, est


def _roomier(size, shape: ModelShape, user: EngineSettings, given: set[str], cur: EngineSettings,
             est: MemoryEstimate) -> tuple[EngineSettings, MemoryEstimate]:
    """--cpu-embeddings, when the walk stopped short of ROOMY_CONTEXT without it and it gives more context."""
    if shape.tied or cur.cpu_embeddings or "cpu_embeddings" in given or est.context >= ROOMY_CONTEXT:
        return cur, est
    cand, after = _fitted(size, given, shape.max_positions)(
        replace(cur, cpu_embeddings=True, max_model_len=user.max_model_len))
    ok = after.headroom_short == 0 and after.context > est.context
    return (cand, after) if ok else (cur, est)


def _fitted(size, given: set[str], max_positions: int):
    """settings -> (settings, estimate) at the context the pool holds: --max-model-len fitted, unless the user
    gave one."""
    if "max_model_len" in given:
        return lambda s: (s, size(s))
    return lambda s: _fit_context(size, s, max_positions)


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
def fit_for_launch(model_path: Path, engine_args: list[str], env, gpu, used) -> FitPlan | None:
    """The plan for the launcher: None where the fit does not apply at all (no NVIDIA GPU, LOCALCHAT_FIT=0, a
    GGUF); a plan without flags, saying why, where it applies but adds nothing. `used`: what other processes
    hold on the card now (nvidia-smi, before the engine starts), which the engine will find taken."""
    if env.get("LOCALCHAT_FIT", "1").strip().lower() in ("0", "false", "no", "off") or model_path.suffix == ".gguf":
        return None
    card = gpu(env)
    if card is None:
        return None
    name, total = card
    others = used(env) or 0
    where = f"{name} ({total / GiB:.0f} GiB" + (f", {others / GB:.2f} GB in use by other processes)"
                                                 if others >= 0.05 * GB else ")")
    _, _, skip = user_settings(engine_args)
    try:
        config = json.loads((model_path / "config.json").read_text())
        fmt = weight_format(config)
        if isinstance(fmt, str):
            return FitPlan((), None, f"engine flags: not fitted ({fmt})", fits=False)
        shape = ModelShape.from_model_dir(model_path, config)
        weights = weight_bytes(config, fmt)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as err:
        return FitPlan((), None, f"engine flags: not fitted (config.json unreadable: {err})", fits=False)
    if skip is not None:
        return FitPlan((), None, f"engine flags: not fitted to {where}: {skip}")
    plan = fit(total, weights, shape, engine_args, others=others)
    off = "; LOCALCHAT_FIT=0 adds none" if plan.flags else ""
    return replace(plan, summary=f"engine flags for {where}: {plan.summary}{off}")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] not in (["--table"], ["--hub-table"]):
        raise SystemExit(__doc__)
    from app.fit_table import hub_table, table
    print(table() if sys.argv[1:] == ["--table"] else hub_table())
