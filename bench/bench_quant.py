"""Quantized linear layers at Qwen3-VL-8B's decoder shapes on CUDA: bf16 cuBLAS vs wna16 (4-bit, group 128) vs
fp8_block (128x128 blocks: the automatic path, and weight-only), each timed as replays of one CUDA graph.

    python bench/bench_quant.py [--quick] [--sweep [gemv] [fused]] [--json out.json]

Per shape and token count M: ms per call, effective GB/s (the bytes the op must move: weights, scales,
activations in and out) and TFLOP/s (2*M*N*K), next to the floor predicted from bytes at 3.36 TB/s (cuBLAS's
measured batch-1 weight read) and FLOPs at 785 (bf16) / 1205 (FP8) TFLOP/s. Each graph calls the op on several
copies of the weights (>= 150 MB in all) so that small weights are not served from the 60 MB L2.
Then the whole decoder per step (36 layers x qkv, o, gate_up, down in one graph, distinct weights per layer).
--sweep also times one-token FP8 tiles per shape (the weight-only GEMV's, the one-launch W8A8 kernel's) and prints
the fastest (the 4-bit kernels' sweep is bench/tune_wna16.py); the decoder then also runs with the fastest per shape
(kinds fp8-gemv-best, fp8-fused-best). Kinds that emulate another GPU class (fp8-wo: sm86's weight-only path) set
the DeviceCaps the dispatch sees (engine/ops/platform.py), as ENGINE_EMULATE_ARCH does for a whole process.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from engine.ops.dispatch import triton_available  # noqa: E402
from engine.ops.platform import DeviceCaps, set_caps_override  # noqa: E402
from engine.ops.quant import fp8_block_linear_w8a8_ref, pack_int32  # noqa: E402
from engine.ops.triton.quant import linear, table  # noqa: E402
from engine.ops.triton.quant.fp8_w8a8 import per_token_group_quant  # noqa: E402
from engine.ops.triton.quant.table import KernelChoice as KC  # noqa: E402

# With ENGINE_EMULATE_ARCH set, Triton compiles for that card from here on (as the engine's first kernel launch would
# arrange), here and in bench/tune_wna16.py and its compile workers, which import this module.
triton_available()

# (name, K, N) of one decoder layer's projections; fused qkv is 4096 + 2*1024 wide, gate_up 2*12288.
LAYER = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 24576), ("down", 12288, 4096)]
LAYERS = 36
DT = torch.bfloat16
BW, BF16_RATE, FP8_RATE = 3.36e12, 785e12, 1205e12
ROTATE_BYTES = 150e6


def time_graph(calls, reps: int = 30) -> float:
    """Median ms of one replay of a graph that runs every call in `calls` once."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    del g
    return statistics.median(times)


def make_bf16(K, N):
    return (torch.randn(N, K, device="cuda", dtype=DT) * 0.02,)


def make_w4(K, N, group=128):
    q = torch.randint(0, 16, (K, N), dtype=torch.int32, device="cuda")
    return (pack_int32(q, 4), torch.rand(K // group, N, device="cuda", dtype=DT) * 0.01,
            torch.full((K // group, N), 8.0, device="cuda", dtype=DT), group, 4)


def make_fp8(K, N):
    w = (torch.randn(N, K, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    return w, torch.rand(N // 128, K // 128, device="cuda") * 1e-3 + 1e-4, (128, 128)


def weight_bytes(kind, K, N):
    return {"bf16": 2 * K * N, "w4g128": K * N // 2 + 2 * 2 * (K // 128) * N,
            "fp8": K * N + 4 * (K // 128) * (N // 128)}[kind]


def _w4(cfg=None):
    return lambda x, *a: linear.wna16_linear(x, *a, tiles=cfg(x) if cfg else None)


def _fp8(cfg=None):
    return lambda x, *a: linear.fp8_block_linear(x, *a, tiles=cfg(x) if cfg else None)


def _w4_dequant(x):
    return KC("wna16_dequant", block_n=128, block_k=64) if x.shape[0] > 1 else None


# The H100 sweep's fastest 4-bit GEMM tiles at 128 and 256 tokens (bench/results/h100_tune_wna16_b8-256_d028c73.txt),
# per (N, K, bucket), to time against dequantize + cuBLAS and the automatic choice (table.TUNED_W4G128).
W4_SWEPT = {
    (6144, 4096, 128): KC("wna16_gemm", block_n=128, num_warps=8, num_stages=4, block_m=64, swap_ab=True),
    (4096, 4096, 128): KC("wna16_gemm", block_n=64, num_stages=4, block_m=64, swap_ab=True),
    (24576, 4096, 128): KC("wna16_gemm", block_n=64, block_k=64, num_stages=3, block_m=128, swap_ab=True),
    (4096, 12288, 128): KC("wna16_gemm", block_n=64, num_stages=4, block_m=64, swap_ab=True),
    (6144, 4096, 256): KC("wna16_gemm", block_n=128, num_warps=8, num_stages=4, block_m=128, swap_ab=True),
    (4096, 4096, 256): KC("wna16_gemm", block_n=64, num_warps=8, num_stages=3, block_m=128, swap_ab=True),
    (24576, 4096, 256): KC("wna16_gemm", block_n=128, num_warps=8, num_stages=3, block_m=256, swap_ab=True),
    (4096, 12288, 256): KC("wna16_gemm", block_n=64, num_warps=8, num_stages=4, block_m=128, swap_ab=True),
}


def _w4_swept(x, qweight, *rest):
    """The 4-bit GEMM with W4_SWEPT's tiles past 64 tokens; up to 64 tokens the automatic choice."""
    K, N, M = x.shape[1], qweight.shape[1], x.shape[0]
    cfg = W4_SWEPT.get((N, K, table.token_bucket(M))) if M > table.WNA16_DEQUANT_ABOVE else None
    return linear.wna16_linear(x, qweight, *rest, tiles=cfg)


def _fp8_triton(x):
    M = x.shape[0]
    if M <= 16:
        return KC("w8a8", block_m=16, block_n=64, num_warps=4, num_stages=4)
    if M <= 64:
        return KC("w8a8", block_m=64, block_n=64, num_warps=4, num_stages=4)
    return KC("w8a8", block_m=128, block_n=128, num_warps=8, num_stages=4)


def _fp8_weight_only_gemm(x, w, *rest):
    """2-64 tokens through the weight-only GEMM with the table's tiles (whatever the device class chooses)."""
    M, K = x.shape
    cfg = table.fp8_gemm_tiles(table.Problem(M, w.shape[0], K, x.dtype)) if 1 < M <= table.FP8_DEQUANT_ABOVE \
        else None
    return linear.fp8_block_linear(x, w, *rest, tiles=cfg)


KINDS = {  # name -> (weight maker, op, architecture emulated (None: this GPU), byte kind, FLOP rate of the floor)
    "bf16": (make_bf16, lambda x, w: F.linear(x, w), None, "bf16", BF16_RATE),
    "w4g128": (make_w4, _w4(), None, "w4g128", BF16_RATE),                 # automatic path
    "w4-dq": (make_w4, _w4(_w4_dequant), None, "w4g128", BF16_RATE),       # dequantize + cuBLAS forced (M > 1)
    "w4-swept": (make_w4, _w4_swept, None, "w4g128", BF16_RATE),           # W4_SWEPT's GEMM tiles past 64 tokens
    "fp8": (make_fp8, _fp8(), None, "fp8", FP8_RATE),                      # automatic (Hopper: one launch to 16)
    "fp8-wo": (make_fp8, _fp8(), 86, "fp8", BF16_RATE),                    # sm86's weight-only path
    "fp8-triton": (make_fp8, _fp8(_fp8_triton), None, "fp8", FP8_RATE),    # the sm89 W8A8 kernel, forced
    "fp8-sm89": (make_fp8, _fp8(), 89, "fp8", FP8_RATE),                   # sm89's automatic path
    "fp8-wo-sm89": (make_fp8, _fp8_weight_only_gemm, 89, "fp8", BF16_RATE),  # the weight-only GEMM on sm89
}


def _fp8_gemv_best(x, w, *rest):
    cfg = BEST_FP8_GEMV.get((x.shape[1], w.shape[0])) if x.shape[0] == 1 else None
    return linear.fp8_block_linear(x, w, *rest, tiles=cfg)


def _fp8_fused_best(x, w, *rest):
    cfg = BEST_FP8_FUSED.get((x.shape[1], w.shape[0])) if x.shape[0] == 1 else None
    return linear.fp8_block_linear(x, w, *rest, tiles=cfg)


def _fp8_mixed(x):
    # Hopper's one-token path before the one-launch kernel (its numbers: docs/perf-log.md): activation
    # quantization, then the Triton W8A8 kernel where K is small (its grid has no split-K), cuBLAS for down.
    return _fp8_triton(x) if x.shape[0] == 1 and x.shape[1] <= 4096 else None


DECODER_ONLY = {  # one-token variants timed on the whole decoder only
    "fp8-gemv-best": (make_fp8, _fp8_gemv_best, 86, "fp8", BF16_RATE),    # the sweep's fastest GEMV tiles per shape
    "fp8-fused-best": (make_fp8, _fp8_fused_best, None, "fp8", FP8_RATE),  # the sweep's fastest one-launch tiles
    "fp8-mixed": (make_fp8, _fp8(_fp8_mixed), None, "fp8", FP8_RATE),
}
DECODER_KINDS = ["bf16", "w4g128", "w4-dq", "w4-swept", "fp8", "fp8-mixed", "fp8-wo", "fp8-gemv-best",
                 "fp8-fused-best", "fp8-sm89", "fp8-wo-sm89"]


def set_arch(arch):
    """The dispatch sees this GPU (None) or a card of architecture `arch` with this GPU's SMs."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    set_caps_override(None if arch is None else DeviceCaps.for_arch(arch, sm_count=sms))


def bench_shape(kind, K, N, M):
    make, op, arch, bkind, rate = KINDS[kind]
    set_arch(arch)
    wb = weight_bytes(bkind, K, N)
    copies = max(1, min(8, int(ROTATE_BYTES // wb) + 1))
    weights = [make(K, N) for _ in range(copies)]
    x = torch.randn(M, K, device="cuda", dtype=DT)
    ms = time_graph([lambda w=w: op(x, *w) for w in weights]) / copies
    nbytes = wb + 2 * M * (K + N)
    floor = max(nbytes / BW, 2 * M * N * K / rate) * 1e3
    del weights
    return {"kind": kind, "K": K, "N": N, "M": M, "ms": ms, "GB/s": nbytes / ms / 1e6,
            "TFLOP/s": 2 * M * N * K / ms / 1e9, "floor_ms": floor}


def bench_decoder(kind, M):
    make, op, arch, _, _ = (KINDS | DECODER_ONLY)[kind]
    set_arch(arch)
    return decoder_linears_ms(op, make, M)


def decoder_linears_ms(op, make, M):
    """ms per step of the 36 layers' linears in one graph (distinct weights per layer)."""
    layers = [[make(K, N) for _, K, N in LAYER] for _ in range(LAYERS)]
    xs = {K: torch.randn(M, K, device="cuda", dtype=DT) for _, K, _ in LAYER}
    calls = [lambda w=w, x=xs[K]: op(x, *w) for layer in layers for (_, K, _), w in zip(LAYER, layer)]
    ms = time_graph(calls, reps=10)
    del layers
    torch.cuda.empty_cache()
    return ms


def probe_cublas_blockwise():
    """Which calls torch._scaled_mm takes with 1x128 activation / 128x128 weight block scales, and how close
    the result is to the W8A8 reference."""
    rows = []
    w, s, bs = make_fp8(4096, 1024)
    for dtype in (torch.bfloat16, torch.float16):
        for M in (1, 2, 7, 16, 64, 1000):
            x = torch.randn(M, 4096, device="cuda", dtype=dtype)
            xq, xs = per_token_group_quant(x, 128)
            try:
                y = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=s.t(), out_dtype=dtype)
                ref = fp8_block_linear_w8a8_ref(x.float(), w, s, bs)
                err = ((y.float() - ref).norm() / ref.norm()).item()
                rows.append(f"{str(dtype)[6:]} M={M}: ok, rel err {err:.2e}")
            except Exception as e:  # noqa: BLE001 (a probe: report whatever it says)
                rows.append(f"{str(dtype)[6:]} M={M}: refused: {str(e).splitlines()[0][:150]}")
    return rows


BEST_FP8_GEMV: dict[tuple[int, int], KC] = {}    # (K, N) -> fastest one-token GEMV tiles (sweep())
BEST_FP8_FUSED: dict[tuple[int, int], KC] = {}   # (K, N) -> fastest one-token one-launch W8A8 tiles
SWEPT = {"fp8-gemv-best": BEST_FP8_GEMV, "fp8-fused-best": BEST_FP8_FUSED}   # decoder kinds that need a sweep


def fp8_gemv_configs():
    """Rows per program, K per step, warps and split-K of the weight-only GEMV (at most 8 KB of weights per step:
    larger tiles spill registers)."""
    return [KC("fp8_gemv", block_n=bn, block_k=bk, split_k=split, num_warps=warps, num_stages=1)
            for bn in (16, 32, 64) for bk in (128, 256, 512) for warps in (4, 8) for split in (1, 2, 4, 8)
            if bn * bk <= 8192]


def fp8_fused_configs():
    """The one-launch W8A8 kernel's tiles (the weight tile on the dot's M side: an fp8 wgmma on Hopper): columns per
    program, split-K, pipeline depth."""
    return [KC("w8a8_one_launch", block_m=16, block_n=bn, split_k=split, num_warps=8 if bn == 256 else 4,
               num_stages=stages, swap_ab=True)
            for bn in (64, 128, 256) for split in (1, 2, 4, 8, 16) for stages in (3, 4)]


SWEEPS = {  # name -> (configs, architecture emulated, table the fastest go to)
    "gemv": (fp8_gemv_configs, 86, BEST_FP8_GEMV),
    "fused": (fp8_fused_configs, None, BEST_FP8_FUSED),
}


def sweep(which: str):
    """FP8 one-token tiles of one kernel per decoder shape -> the fastest three; fills its BEST_ table."""
    configs, arch, best_table = SWEEPS[which]
    out = {}
    set_arch(arch)
    for name, K, N in LAYER:
        fp8 = [make_fp8(K, N) for _ in range(max(2, int(ROTATE_BYTES // weight_bytes("fp8", K, N)) + 1))]
        x = torch.randn(1, K, device="cuda", dtype=DT)
        res = []
        for cfg in configs():
            try:
                ms = time_graph([lambda w=w: linear.fp8_block_linear(x, *w, tiles=cfg) for w in fp8],
                                reps=10) / len(fp8)
            except Exception as e:  # noqa: BLE001 (a config that does not compile or fit: skip it)
                print(f"  skip {cfg}: {str(e).splitlines()[0][:100]}", flush=True)
                continue
            res.append((ms, cfg))
        best = sorted(res, key=lambda r: r[0])[:3]
        best_table[(K, N)] = best[0][1]
        for ms, cfg in best:
            nbytes = weight_bytes("fp8", K, N) + 2 * (K + N)
            print(f"sweep {which} {name:8s} M=1 {ms * 1e3:8.1f} us {nbytes / ms / 1e9:5.2f} TB/s  {cfg}", flush=True)
        out[f"{which} {name} M=1"] = [(ms, repr(cfg)) for ms, cfg in best]
        del fp8
        torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="M=1 and 8192 only")
    ap.add_argument("--sweep", nargs="*", choices=list(SWEEPS),
                    help="also time one-token FP8 tiles: of the weight-only GEMV and/or the one-launch W8A8 kernel "
                         "(bare --sweep: both)")
    ap.add_argument("--tokens", type=int, nargs="+", help="M of the per-shape runs (default 1 16 64 256 8192)")
    ap.add_argument("--kinds", nargs="+", help="kinds to run (default: all)")
    ap.add_argument("--decoder-tokens", type=int, nargs="+", default=[1, 64, 256], help="M of the whole-decoder runs")
    ap.add_argument("--json")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    result = {"probe": probe_cublas_blockwise()}
    print("\n".join(result["probe"]), flush=True)
    if args.sweep is not None:
        result["sweep"] = {}
        for which in args.sweep or list(SWEEPS):
            result["sweep"] |= sweep(which)
    rows = []
    kinds = args.kinds or list(KINDS) + list(DECODER_ONLY)
    for M in args.tokens or ((1, 8192) if args.quick else (1, 16, 64, 256, 8192)):
        for name, K, N in LAYER:
            for kind in (k for k in KINDS if k in kinds):
                if kind == "w4-dq" and M == 1:
                    continue
                r = bench_shape(kind, K, N, M) | {"layer": name}
                rows.append(r)
                print(f"{name:8s} {K:5d}->{N:5d} M={M:5d} {kind:7s} {r['ms'] * 1e3:9.1f} us  "
                      f"(floor {r['floor_ms'] * 1e3:8.1f})  {r['GB/s']:7.0f} GB/s  {r['TFLOP/s']:6.1f} TFLOP/s",
                      flush=True)
    result["shapes"] = rows
    dec = {}
    for M in args.decoder_tokens:
        for kind in (k for k in DECODER_KINDS if k in kinds):
            if (kind == "w4-dq" and M == 1) or (kind in DECODER_ONLY and M > 1) or \
                    (kind in SWEPT and not SWEPT[kind]):
                continue
            dec[f"{kind} M={M}"] = bench_decoder(kind, M)
            print(f"decoder linears, 36 layers, {kind:7s} M={M:4d}: {dec[f'{kind} M={M}']:.3f} ms/step", flush=True)
    result["decoder"] = dec
    print("\nsummary: per-call us (M rows x kind), whole decoder per step at M=1")
    for M in sorted({r["M"] for r in rows}):
        for name, _, _ in LAYER:
            cells = [f"{kind}={r['ms'] * 1e3:.1f}" for kind in KINDS for r in rows
                     if r["M"] == M and r["layer"] == name and r["kind"] == kind]
            print(f"M={M:5d} {name:8s} " + "  ".join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
