"""GPU pieces of one image request, each timed alone on CUDA (medians, triton.testing.do_bench): the vision
encoder's attention (4096 patches x 16 heads x 72) in this engine's Triton kernel, in what the engine runs for
one segment, and in torch's SDPA backends; the prefill attention at short prompt sizes (512 to 4096 tokens,
the image prompt's 1067 among them) under several tile configs, and that prompt's causal attention in torch's
back ends; the pixel normalization; every linear of the request under cuBLAS and cuBLASLt.

    python bench/image_gpu_parts.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_ops import paged_batch, time_us  # noqa: E402


def vision_attention_cases(results: list) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from engine.ops.triton.varlen_attention import varlen_attention
    n, heads, d = 4096, 16, 72
    qkv = torch.randn(n, 3, heads, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(1)
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    flops = 4 * heads * d * n * n
    two = torch.tensor([0, n, n], dtype=torch.int32, device="cuda")   # + an empty segment: the Triton kernel
    ours = varlen_attention(q, k, v, two, n, d ** -0.5)
    cands = {"engine triton": lambda: varlen_attention(q, k, v, two, n, d ** -0.5),
             "engine one segment": lambda: varlen_attention(q, k, v, cu, n, d ** -0.5)}
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))           # [1, H, N, D] views
    qc, kc, vc = (x.contiguous() for x in (qs, ks, vs))
    for name, backend in (("sdpa flash", SDPBackend.FLASH_ATTENTION), ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa efficient", SDPBackend.EFFICIENT_ATTENTION)):
        for layout, args in (("views", (qs, ks, vs)), ("contiguous", (qc, kc, vc))):
            def run(backend=backend, args=args):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(*args)
            cands[f"{name} {layout}"] = run
    try:
        from torch.nn.attention.varlen import varlen_attn
        cands["varlen_attn (FA2)"] = lambda: varlen_attn(q, k, v, cu, cu, n, n)
    except ImportError:
        pass
    for name, fn in cands.items():
        try:
            out = fn()
            out = out[0].transpose(0, 1) if out.dim() == 4 else out
            err = (out.float() - ours.float()).abs().max().item()
            us = time_us(fn)
            row = {"case": "vision attention 4096x16x72", "impl": name, "us": us, "tflops": flops / us / 1e6,
                   "max_abs_diff_vs_engine": err}
        except Exception as e:  # noqa: BLE001 - a backend may not take this shape
            row = {"case": "vision attention 4096x16x72", "impl": name, "error": f"{type(e).__name__}: {e}"[:200]}
        results.append(row)
        print(json.dumps(row), flush=True)


def prefill_tile_cases(results: list) -> None:
    from engine.ops.triton import attention as paged
    base = paged.tile_config
    for n in (512, 1067, 2048, 4096):
        q, kc, vc, md = paged_batch([], [(n, n)])
        flops = 4 * 32 * 128 * n * (n + 1) // 2
        for cfg in (None, (128, 128, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 3)):
            paged.tile_config = base if cfg is None else (lambda *a, cfg=cfg: cfg)
            us = time_us(lambda: paged.paged_attention(q, kc, vc, md, 128 ** -0.5))
            row = {"case": f"prefill attention {n} tok", "tiles": cfg or "default", "us": us,
                   "tflops": flops / us / 1e6}
            results.append(row)
            print(json.dumps(row), flush=True)
        paged.tile_config = base


# (name, M, N, K, bias): every linear of one 1024x1024 image request (Qwen3-VL-8B: 1067 prompt tokens, which
# the prefill CUDA graph runs in its 1088 bucket; the vision encoder's 4096 patches; the mergers' 1024 rows)
LINEAR_SHAPES = [
    ("llm qkv", 1088, 6144, 4096, False), ("llm o_proj", 1088, 4096, 4096, False),
    ("llm gate_up", 1088, 24576, 4096, False), ("llm down", 1088, 4096, 12288, False),
    ("llm o_proj M=1067", 1067, 4096, 4096, False), ("llm qkv M=1067", 1067, 6144, 4096, False),
    ("vision qkv", 4096, 3456, 1152, True), ("vision proj", 4096, 1152, 1152, True),
    ("vision fc1", 4096, 4304, 1152, True), ("vision fc2", 4096, 1152, 4304, True),
    ("merger fc1", 1024, 4608, 4608, True), ("merger fc2", 1024, 4096, 4608, True),
]


def linear_cases(results: list) -> None:
    """Each linear as F.linear in a CUDA graph, under cuBLAS and under cuBLASLt (torch's two BLAS back ends
    choose different kernels), against 2*M*N*K FLOPs."""
    for name, m, n, k, bias in LINEAR_SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            us = time_us(lambda: F.linear(x, w, b), graph=True)
            row = {"case": f"linear {name} {m}x{n}x{k}", "blas": lib, "us": us, "tflops": 2 * m * n * k / us / 1e6}
            results.append(row)
            print(json.dumps(row), flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")


def causal_prefill_cases(results: list) -> None:
    """The image prompt's causal self-attention (1067 tokens, 32 query / 8 KV heads, head dim 128, no cached
    prefix) in torch's attention back ends, beside the engine's paged kernel (prefill_tile_cases)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    n, hq, hk, d = 1067, 32, 8, 128
    q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(n, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(n, hk, d, device="cuda", dtype=torch.bfloat16)
    flops = 4 * hq * d * n * (n + 1) // 2
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    cands = {}
    for name, backend in (("sdpa flash", SDPBackend.FLASH_ATTENTION), ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def run(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        cands[name] = run
    for name, fn in cands.items():     # (torch 2.11's varlen_attn has no causal mode)
        try:
            us = time_us(fn)
            row = {"case": f"causal prefill attention {n} tok (GQA 32/8)", "impl": name, "us": us,
                   "tflops": flops / us / 1e6}
        except Exception as e:  # noqa: BLE001 - a back end may not take this shape
            row = {"case": f"causal prefill attention {n} tok", "impl": name, "error": f"{type(e).__name__}: {e}"[:200]}
        results.append(row)
        print(json.dumps(row), flush=True)


def normalize_cases(results: list) -> None:
    from engine.inputs.image_processor import ImageProcessor
    ip = ImageProcessor()
    raw = torch.randint(0, 256, (1024, 1024, 3), dtype=torch.uint8, device="cuda")
    row = {"case": "to_pixel_values 1024x1024 (eager torch)", "us": time_us(lambda: ip.to_pixel_values(raw))}
    results.append(row)
    print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--parts", default="vision,prefill,causal,normalize,linear")
    args = ap.parse_args()
    results: list = []
    parts = {"vision": vision_attention_cases, "prefill": prefill_tile_cases, "causal": causal_prefill_cases, "normalize": normalize_cases,
             "linear": linear_cases}
    for name in args.parts.split(","):
        parts[name](results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
