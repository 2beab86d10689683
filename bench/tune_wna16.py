"""Sweeps the 4-bit kernels' tiles (engine/ops/triton/quant/: the one-token GEMV, the GEMM) at Qwen3-VL-8B's decoder
shapes on one GPU, prints the fastest GEMM tiles per (N, K, token bucket) that the table's rule does not already give
as the TUNED_W4G128 table, then times the dispatch (the tuned table applied in this process) against dequantize +
cuBLAS and bf16 cuBLAS per shape and token count, and the whole decoder's linears per step.

    python bench/tune_wna16.py [--jobs 12] [--quick] [--json out.json]

4-bit weights, group 128, bf16 activations, random data. Every time is the median replay of a CUDA graph that
cycles through >= 150 MB of weight copies (no weight served from the 60 MB L2); bench/bench_quant.py's method.
Floors: the bytes the op must move (weights, scales and zeros, activations in and out) at 4.8 TB/s (HBM3e,
datasheet) and 2*M*N*K at 785 TFLOP/s (bf16 GEMM measured on this H200, BENCHMARKS.md).
Compilation dominates a cold run: --jobs processes compile every config first (Triton's disk cache), then the
main process times them one after the other.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_quant import (LAYER, ROTATE_BYTES, decoder_linears_ms, make_bf16, make_w4, time_graph,  # noqa: E402
                         weight_bytes)
from engine.ops.platform import device_caps  # noqa: E402
from engine.ops.triton.quant import linear, table  # noqa: E402
from engine.ops.triton.quant.table import KernelChoice, Problem  # noqa: E402

DT = torch.bfloat16
FLOOR_BW, FLOOR_FLOPS = 4.8e12, 785e12
GEMV_BUCKETS = (1,)
GEMM_BUCKETS = (2, 4, 8, 16, 32, 64, 128, 256, 512)
AB_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOP = 5


def candidates(bucket: int) -> list[KernelChoice]:
    """The tiles tried for an M bucket (block_k counts weights, 8 per 4-bit packed row)."""
    out = []
    if bucket == 1:
        # The GEMV (rows over the warps, one reduction at the end), the default for one token.
        for bn, bkp in ((32, 64), (32, 128), (64, 64)):
            for split in (1, 2, 4):
                for warps in (4, 8):
                    out.append(KernelChoice("wna16_gemv", block_n=bn, block_k=bkp * 8, split_k=split,
                                            num_warps=warps))
        # The swap-AB GEMM with the token padded to 16 rows: its packed weights feed tl.dot, so Triton pipelines
        # their loads through shared memory (cp.async, num_stages deep), where the GEMV keeps one tile in flight.
        # On an H100 it lost to the GEMV at every 8B shape (o 10.6 against 8.2 us, down 22.9 against 16.0;
        # docs/perf-log.md, sixteenth session).
        for bn in (64, 128):
            for bk in (64, 128):
                for split in (2, 4, 8, 16):
                    for stages in (3, 4, 6):
                        out.append(KernelChoice("wna16_gemm", block_n=bn, block_k=bk, split_k=split, block_m=16,
                                                num_warps=4, num_stages=stages, swap_ab=True))
        return out
    if bucket <= 32:
        for bm in sorted({16, max(16, bucket)}):
            for bn in (64, 128):
                for bk in (64, 128):
                    for split in (1, 2, 4, 8):
                        out.append(KernelChoice("wna16_gemm", block_n=bn, block_k=bk, split_k=split, block_m=bm,
                                                num_warps=4, num_stages=4, swap_ab=True))
        return out
    # 64 tokens and more: the weight tile on either side of the dot. With swap-AB the dequantized weights are the
    # wgmma's A operand, read from registers; without it they pass through shared memory (bench/wna16_sass.py).
    bms = (64,) if bucket == 64 else (64, 128) if bucket == 128 else (128, 256)
    for swap in (False, True):
        for bm in bms:
            for bn in ((64, 128) if swap else (128, 256)):
                for bk in (64, 128):
                    for warps in (4, 8):
                        for stages in ((3,) if bucket == 64 else (3, 4)):
                            for split in ((1, 2, 4) if bucket == 64 else (1,)):
                                out.append(KernelChoice("wna16_gemm", block_n=bn, block_k=bk, split_k=split,
                                                        block_m=bm, num_warps=warps, num_stages=stages,
                                                        swap_ab=swap))
    return out


def rule(M: int, N: int, K: int) -> KernelChoice:
    """What the dispatch table gives this GPU for M tokens (the tuned table as it stands in this process)."""
    return table.choose_wna16(Problem(M, N, K, DT), device_caps(torch.device("cuda")))


def _compile_worker(jobs):
    """Runs each (K, N, M, config) once on small random inputs of the real shape: fills Triton's disk cache."""
    failed = []
    for K, N, M, cfg in jobs:
        qweight, scales, zeros, group, bits = make_w4(K, N)
        x = torch.randn(M, K, device="cuda", dtype=DT)
        try:
            linear.wna16_linear(x, qweight, scales, zeros, group, bits, tiles=cfg)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 (a config that does not compile or fit: reported, then skipped)
            failed.append((K, N, M, cfg, str(e).splitlines()[0][:160]))
    return failed


def precompile(work, jobs: int) -> set:
    chunks = [work[i::jobs] for i in range(jobs)]
    with mp.get_context("spawn").Pool(jobs) as pool:
        failed = [f for part in pool.map(_compile_worker, chunks) for f in part]
    for K, N, M, cfg, err in failed:
        print(f"  skip {K}->{N} M={M} {cfg}: {err}", flush=True)
    return {(K, N, M, cfg) for K, N, M, cfg, _ in failed}


def weight_copies(K, N, make=make_w4, kind="w4g128"):
    """Enough copies of one weight that a graph cycling through them reads none from L2 (made once per shape)."""
    return [make(K, N) for _ in range(max(2, min(8, int(ROTATE_BYTES // weight_bytes(kind, K, N)) + 1)))]


def time_op(K, M, op, weights):
    x = torch.randn(M, K, device="cuda", dtype=DT)
    return time_graph([lambda w=w: op(x, *w) for w in weights], reps=15) / len(weights)


def row(K, N, M, ms, kind="w4g128"):
    nbytes = weight_bytes(kind, K, N) + 2 * M * (K + N)
    floor = max(nbytes / FLOOR_BW, 2 * M * N * K / FLOOR_FLOPS) * 1e3
    return {"us": ms * 1e3, "TB/s": nbytes / ms / 1e9, "TFLOP/s": 2 * M * N * K / ms / 1e9, "floor_us": floor * 1e3}


PATHS = None    # --paths: the kernel families swept (None: all)


def family(cfg) -> str:
    return cfg.kernel.removeprefix("wna16_")


def configs_for(K, N, M):
    """The candidates (of the --paths families), the rule's tiles and (to compare the two split-K reductions) the
    GEMV's serial=False twins."""
    out = list(dict.fromkeys([c for c in candidates(M) if PATHS is None or family(c) in PATHS] + [rule(M, N, K)]))
    return out + [replace(c, serial=False) for c in out if c.kernel == "wna16_gemv" and c.serial and c.split_k > 1]


def sweep(shapes, buckets, jobs):
    work = [(K, N, M, cfg) for _, K, N in shapes for M in buckets for cfg in configs_for(K, N, M)]
    t0 = time.time()
    bad = precompile(work, jobs) if jobs > 1 else set()
    print(f"compiled {len(work)} configs in {time.time() - t0:.0f} s ({len(bad)} failed)", flush=True)
    best = {}
    for name, K, N in shapes:
        weights = weight_copies(K, N)
        for M in buckets:
            res = []
            for cfg in configs_for(K, N, M):
                if (K, N, M, cfg) in bad:
                    continue
                try:
                    ms = time_op(K, M, lambda x, *w, c=cfg: linear.wna16_linear(x, *w, tiles=c), weights)
                except Exception as e:  # noqa: BLE001
                    print(f"  skip {cfg}: {str(e).splitlines()[0][:120]}", flush=True)
                    continue
                res.append((ms, cfg))
            if not res:
                continue
            times = {c: ms for ms, c in res}
            default = times.get(rule(M, N, K), float("nan"))
            # The two split-K reductions on the same config (serial: one launch; pass: a second kernel), median
            # of the time ratios over the split-4 GEMV configs.
            pairs = [(times[c], times[replace(c, serial=False)]) for c in times
                     if c.kernel == "wna16_gemv" and c.serial and c.split_k == 4 and replace(c, serial=False) in times]
            pass_over_serial = statistics.median([p / s for s, p in pairs]) if pairs else float("nan")
            res.sort(key=lambda r: r[0])
            gemms = [r for r in res if r[1].kernel == "wna16_gemm"]
            if gemms:
                best[(N, K, M)] = gemms[0]
            for ms, cfg in res[:TOP]:
                print(f"  top {name:8s} M={M:4d} {ms * 1e3:7.1f} us {row(K, N, M, ms)['TB/s']:.2f} TB/s  {cfg}")
            second = res[1][0] if len(res) > 1 else float("nan")
            print(f"sweep {name:8s} M={M:4d} best {res[0][0] * 1e3:7.1f} us  2nd {second * 1e3:7.1f}  "
                  f"rule {default * 1e3:7.1f}  pass/serial {pass_over_serial:5.2f}  {res[0][1]}", flush=True)
        del weights
        torch.cuda.empty_cache()
    return best


def print_table(best):
    """The fastest GEMM tiles per (N, K, bucket), leaving out those the rule already gives (the table holds only
    what the rule does not)."""
    same = [key for key, (_, cfg) in best.items() if cfg == rule(key[2], key[0], key[1])]
    print(f"\n{len(same)} of {len(best)} fastest GEMM tiles are the rule's: {sorted(same)}")
    print("TUNED_W4G128: dict[tuple[int, int, int], KernelChoice] = {")
    for (N, K, M), (ms, cfg) in sorted(best.items()):
        if (N, K, M) in same:
            continue
        fields = ", ".join(f"{k}={v!r}" for k, v in cfg.__dict__.items()
                           if k != "kernel" and v != KernelChoice.__dataclass_fields__[k].default)
        print(f"    ({N}, {K}, {M}): KernelChoice({cfg.kernel!r}, {fields}),  # {ms * 1e3:.1f} us")
    print("}", flush=True)


def table_op(x, *w):
    """wna16_linear with the dispatch table's choice."""
    return linear.wna16_linear(x, *w)


def dequant_op(x, *w):
    """Dequantize + cuBLAS at every token count (the GEMV at one)."""
    tiles = KernelChoice("wna16_dequant", block_n=128, block_k=64) if x.shape[0] > 1 else None
    return linear.wna16_linear(x, *w, tiles=tiles)


def bf16_op(x, w):
    return F.linear(x, w)


def ab_table(shapes, tokens):
    rows = []
    print("\nper shape: us (TB/s, TFLOP/s); floor = max(bytes / 4.8 TB/s, FLOPs / 785 TFLOP/s)")
    print("| M | layer | floor us | bf16 cuBLAS | 4-bit dequant + cuBLAS | 4-bit table | table / dequant | "
          "table / bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    weights = {(K, N): (weight_copies(K, N, make_bf16, "bf16"), weight_copies(K, N)) for _, K, N in shapes}
    for M in tokens:
        for name, K, N in shapes:
            r = {"M": M, "layer": name, "K": K, "N": N}
            w16, w4 = weights[(K, N)]
            r["bf16"] = row(K, N, M, time_op(K, M, bf16_op, w16), "bf16")
            r["dequant"] = row(K, N, M, time_op(K, M, dequant_op, w4))
            r["table"] = row(K, N, M, time_op(K, M, table_op, w4))
            rows.append(r)
            cell = lambda c: f"{c['us']:.1f} ({c['TB/s']:.2f}, {c['TFLOP/s']:.0f})"  # noqa: E731
            print(f"| {M} | {name} | {r['table']['floor_us']:.1f} | {cell(r['bf16'])} | {cell(r['dequant'])} | "
                  f"{cell(r['table'])} | {r['table']['us'] / r['dequant']['us']:.2f} | "
                  f"{r['table']['us'] / r['bf16']['us']:.2f} |", flush=True)
    del weights
    torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=12, help="compile processes (1: compile while timing)")
    ap.add_argument("--quick", action="store_true", help="buckets 1, 8, 64, 256 only")
    ap.add_argument("--buckets", type=int, nargs="+", help="M buckets to sweep (default: all, or --quick's)")
    ap.add_argument("--top", type=int, default=5, help="configs printed per shape and bucket, fastest first")
    ap.add_argument("--no-sweep", action="store_true", help="only the A/B tables (the committed table)")
    ap.add_argument("--paths", nargs="+", choices=["gemv", "gemm"],
                    help="kernel families to sweep (default: both): the one-token GEMV, the GEMM")
    ap.add_argument("--ab-tokens", type=int, nargs="+", help="M of the per-shape A/B (default: all, or --quick's)")
    ap.add_argument("--decoder-tokens", type=int, nargs="+", default=[1, 64, 256],
                    help="M of the whole-decoder A/B")
    ap.add_argument("--json")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    shapes = LAYER
    result = {}
    if not args.no_sweep:
        global TOP, PATHS
        TOP, PATHS = args.top, args.paths
        buckets = args.buckets or ((1, 8, 64, 256) if args.quick else GEMV_BUCKETS + GEMM_BUCKETS)
        best = sweep(shapes, buckets, args.jobs)
        print_table(best)
        table.TUNED_W4G128.update({k: cfg for k, (_, cfg) in best.items()})   # the A/B below runs the tuned table
        result["best"] = {f"{k}": (ms * 1e3, repr(cfg)) for k, (ms, cfg) in best.items()}
    result["shapes"] = ab_table(shapes, args.ab_tokens or ((1, 8, 64, 256) if args.quick else AB_TOKENS))
    dec = {}
    print("\nwhole decoder's linears per step (36 layers x qkv, o, gate_up, down; one graph), ms:")
    for M in args.decoder_tokens:
        dec[f"bf16 M={M}"] = decoder_linears_ms(bf16_op, make_bf16, M)
        dec[f"dequant M={M}"] = decoder_linears_ms(dequant_op, make_w4, M)
        dec[f"table M={M}"] = decoder_linears_ms(table_op, make_w4, M)
        print(f"M={M:4d}: bf16 {dec[f'bf16 M={M}']:.3f}  4-bit dequant {dec[f'dequant M={M}']:.3f}  "
              f"4-bit table {dec[f'table M={M}']:.3f}", flush=True)
    result["decoder"] = dec
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
