"""Compile every Triton kernel the engine launches at Qwen3-VL-8B's shapes for one CUDA architecture, on a machine
without a GPU, and report each kernel's largest shared-memory use.

Triton compiles to PTX and, with the ptxas it ships, to a cubin for any target; only launching needs a GPU. A
stand-in driver names the target, `JITFunction.run` compiles instead of launching, and the engine's own
dispatch chooses paths and tiles (engine/ops wrappers with `use_triton` forced on, the GPU queries answered as
the target's). cuBLAS's share (torch.mm and friends) is stubbed: it is not Triton, and on CPU it would be hours
of matmul over uninitialized memory. One architecture per process: Triton keys its compiled kernels by device,
and the stand-in is always device 0.

    python tests/portable_compile.py 86      # prints JSON: {"compiles": n, "shared": {kernel: bytes}}
"""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from paged_batches import make_batch  # noqa: E402  (tests/, this script's folder)

from engine.ops.platform import KNOWN_ARCHS  # noqa: E402

# Shared memory one program may opt in to, per architecture (A100, RTX 3090, RTX 4090, H100/H200, ...).
SHARED_LIMIT = {arch: shared for arch, (_, shared) in KNOWN_ARCHS.items()}
BF16 = torch.bfloat16
# The engine.ops modules whose dispatch chooses Triton (the package re-exports a function named `embedding`, so
# `from engine.ops import embedding` would give that function, not the module).
OP_MODULES = ("activation", "attention", "embedding", "kv_cache", "norm", "pixels", "quant", "rotary")


def op(name: str):
    return importlib.import_module(f"engine.ops.{name}")


class TargetDriver:
    """The part of Triton's driver interface that compiling reads: the device, its stream and its target."""

    def __init__(self, capability: int):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", capability, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target


def compile_only(record: list) -> None:
    from triton.runtime.jit import JITFunction
    run = JITFunction.run

    def compile_(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        record.append((self.fn.__name__, kernel.metadata.shared))
        return kernel
    JITFunction.run = compile_


def pose_as(capability: int) -> None:
    """The engine's GPU queries answer as the target would (the dispatch sees its DeviceCaps); cuBLAS-only paths
    are left to cuBLAS."""
    import torch.nn.functional as F

    from engine.ops.platform import DeviceCaps, set_caps_override
    from engine.ops.triton import attention as t_attention
    from engine.ops.triton.quant import table
    from triton.runtime import driver

    driver.set_active(TargetDriver(capability))
    set_caps_override(DeviceCaps.for_arch(capability))
    for name in OP_MODULES:
        op(name).use_triton = lambda t: True
    table.CUBLAS_REFUSED.add(BF16)          # sm90 takes cuBLAS's block-scaled GEMM there: compile Triton's fallback
    t_attention.cudnn_attention_usable = lambda *a: False
    torch.mm = lambda a, b, out=None: out if out is not None else torch.empty(a.shape[0], b.shape[1], dtype=a.dtype)
    torch.addmm = lambda c, a, b, out=None, **kw: out if out is not None else torch.empty(
        a.shape[0], b.shape[1], dtype=a.dtype)
    F.linear = lambda x, w, b=None: torch.empty(*x.shape[:-1], w.shape[0], dtype=x.dtype)


def launch_everything(capability: int) -> None:
    """Each op at the decoder's and the ViT's shapes, for the token counts whose paths and tiles differ."""
    from engine.ops.triton.quant import splitk
    activation, attention, embedding, kv_cache, norm, pixels, quant, rotary = (op(n) for n in OP_MODULES)

    gen = torch.Generator().manual_seed(0)
    batches = {"decode 1": ([4000], []), "decode 8": ([4000] * 8, []), "decode 256": ([64] * 256, []),
               "image prefill": ([], [(1067, 1067)]), "long prefill": ([], [(8192, 8192)]),
               "mixed": ([900] * 4, [(512, 512)])}
    for kv_dtype in (BF16, torch.float8_e4m3fn):
        for decode_ctx, prefills in batches.values():
            q, k_cache, v_cache, md = make_batch(gen, decode_ctx, prefills, 32, 8, 128, 16, BF16, "cpu")
            k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
            k = torch.zeros(q.shape[0], 8, 128, dtype=BF16)
            cos = sin = torch.zeros(q.shape[0], 64)
            q = rotary.rope_and_store_kv(q, k, k, cos, sin, k_cache, v_cache, md.slot_mapping,
                                         torch.ones(128, dtype=BF16), torch.ones(128, dtype=BF16), 1e-6)
            kv_cache.store_kvcache(k, k, k_cache, v_cache, md.slot_mapping)
            attention.paged_attention(q, k_cache, v_cache, md, 0.088)
    for bounds in ([0, 4096], [0, 1024, 2048]):                   # the ViT: 16 heads of 72, one or two images
        qkv = torch.zeros(bounds[-1], 3, 16, 72, dtype=BF16)
        q, k, v = rotary.vision_qkv_rope(qkv, torch.zeros(bounds[-1], 36), torch.zeros(bounds[-1], 36))
        attention.varlen_attention(q, k, v, torch.tensor(bounds, dtype=torch.int32),
                                   max(b - a for a, b in zip(bounds, bounds[1:])), 0.118)
        x = torch.zeros(bounds[-1], 1152, dtype=BF16)
        norm.layer_norm(x, torch.ones(1152, dtype=BF16), torch.zeros(1152, dtype=BF16), 1e-6, residual=x)
    pixels.patchify(torch.zeros(1024, 1024, 3, dtype=torch.uint8), torch.zeros(3, 256), 16, 2, 2, BF16)
    embedding.embedding(torch.zeros(256, dtype=torch.int64), torch.zeros(151936, 4096, dtype=BF16), 0, 151936)
    for tokens in (1, 8, 16, 64, 256, 1024, 8192):
        x = torch.zeros(tokens, 4096, dtype=BF16)
        norm.rms_norm(x, torch.ones(4096, dtype=BF16), 1e-6, residual=x)
        activation.silu_and_mul(torch.zeros(tokens, 24576, dtype=BF16))
        if tokens > 1024:
            continue
        for K, N in ((4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096)):   # qkv, o, gate_up, down
            x = torch.zeros(tokens, K, dtype=BF16)
            qweight = torch.zeros(K // 8, N, dtype=torch.int32)
            scales = zeros = torch.zeros(K // 128, N, dtype=BF16)
            quant.wna16_linear(x, qweight, scales, zeros, 128, 4)
            weight = torch.zeros(N, K, dtype=torch.float8_e4m3fn)
            quant.fp8_block_linear(x, weight, torch.ones(N // 128, K // 128), (128, 128))
        if tokens in (1, 8, 256):   # FP8 with K not a multiple of the scale block: weight-only on every GPU
                                    # (GEMV, GEMM, and above 64 tokens dequantize + cuBLAS)
            weight = torch.zeros(4096, 4000, dtype=torch.float8_e4m3fn)
            quant.fp8_block_linear(torch.zeros(tokens, 4000, dtype=BF16), weight, torch.ones(32, 32), (128, 128))
    # Split-K's second-kernel reduction: what a graph captured before any eager launch runs (splitk.split_locks).
    splitk.reduce_partials(torch.zeros(4, 1, 4096), None, torch.empty(1, 4096, dtype=BF16))


def main(capability: int) -> dict:
    record: list[tuple[str, int]] = []
    pose_as(capability)
    compile_only(record)
    launch_everything(capability)
    shared: dict[str, int] = {}
    for name, nbytes in record:
        shared[name] = max(shared.get(name, 0), nbytes)
    return {"compiles": len(record), "shared": shared}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]))))
