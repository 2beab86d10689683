"""The few-token GEMVs (a token axis in registers, no tensor cores) against what the dispatch runs today, at
Qwen3-VL-8B's decoder shapes, 1-8 tokens, on this GPU as itself or as the card ENGINE_EMULATE_ARCH names.

    [ENGINE_EMULATE_ARCH=86] python bench/few_token_sweep.py [--formats w4 fp8] [--tokens 1 2 4 8] [--json out]

Per format, shape and M: the dispatch's choice (the table as committed) and each candidate tile of the GEMV, as
median replays of a CUDA graph cycling through >= 150 MB of weight copies (bench/bench_quant.py's method); bf16
cuBLAS beside them. Then per M the 36 layers' linears summed from the per-shape times: the dispatch against the
fastest GEMV per shape. FP8 runs weight-only where the card has no FP8 tensor cores (sm80/86), the case the GEMV
is for; on other cards its rows time the GEMV against the W8A8 kernels the table picks there.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_quant import LAYER, LAYERS, ROTATE_BYTES, make_bf16, make_fp8, make_w4, time_graph, weight_bytes  # noqa
from engine.ops.dispatch import triton_available  # noqa: E402
from engine.ops.platform import device_caps  # noqa: E402
from engine.ops.triton.quant import linear, table  # noqa: E402
from engine.ops.triton.quant.table import KernelChoice as KC  # noqa: E402
from engine.ops.triton.quant.table import Problem  # noqa: E402

DT = torch.bfloat16


def w4_candidates(M: int) -> list[KC]:
    # (columns, packed rows per step, warps): the token axis multiplies the registers each weight row needs.
    tiles = ((32, 64, 8), (32, 32, 8), (64, 16, 8)) if M == 1 else ((32, 32, 8), (32, 16, 4), (64, 16, 8))
    return [KC("wna16_gemv", block_n=bn, block_k=bkp * 8, split_k=s, num_warps=w)
            for bn, bkp, w in tiles for s in (1, 2, 4)]


def fp8_candidates(M: int) -> list[KC]:
    tiles = ((32, 128, 4), (16, 128, 4), (32, 256, 8)) if M == 1 else ((16, 128, 4), (32, 64, 4), (16, 64, 4))
    return [KC("fp8_gemv", block_n=bn, block_k=bk, split_k=s, num_warps=w, num_stages=1)
            for bn, bk, w in tiles for s in (2, 4, 8)]


FORMATS = {  # name -> (weight maker, op taking tiles, byte kind, problem, candidates)
    "w4": (make_w4, lambda x, w, t: linear.wna16_linear(x, *w, tiles=t), "w4g128",
           lambda M, K, N: table.choose_wna16(Problem(M, N, K, DT), device_caps(torch.device("cuda"))),
           w4_candidates),
    "fp8": (make_fp8, lambda x, w, t: linear.fp8_block_linear(x, *w, tiles=t), "fp8",
            lambda M, K, N: table.choose_fp8(Problem(M, N, K, DT), device_caps(torch.device("cuda"))),
            fp8_candidates),
}


def time_op(K: int, M: int, op, weights) -> float:
    """Median µs of one call (the graph cycles through the copies)."""
    x = torch.randn(M, K, device="cuda", dtype=DT)
    return time_graph([lambda w=w: op(x, w) for w in weights], reps=15) / len(weights) * 1e3


def copies(make, kind: str, K: int, N: int) -> list:
    return [make(K, N) for _ in range(max(2, min(8, int(ROTATE_BYTES // weight_bytes(kind, K, N)) + 1)))]


def sweep_format(fmt: str, tokens: list[int]) -> list[dict]:
    make, op, kind, rule, candidates = FORMATS[fmt]
    rows = []
    for name, K, N in LAYER:
        weights, dense = copies(make, kind, K, N), copies(make_bf16, "bf16", K, N)
        for M in tokens:
            chosen = rule(M, K, N)
            t_rule = time_op(K, M, lambda x, w: op(x, w, None), weights)
            t_bf16 = time_op(K, M, lambda x, w: F.linear(x, *w), dense)
            res = []
            for cfg in candidates(M):
                try:
                    res.append((time_op(K, M, lambda x, w, c=cfg: op(x, w, c), weights), cfg))
                except Exception as e:  # noqa: BLE001 (a tile that does not compile or fit this card: skipped)
                    print(f"  skip {name} M={M} {cfg}: {str(e).splitlines()[0][:120]}", flush=True)
            best_us, best = min(res, key=lambda r: r[0]) if res else (float("nan"), None)
            gbs = weight_bytes(kind, K, N) / (best_us * 1e3)
            print(f"{fmt} {name:8s} M={M}: table {chosen.kernel} {t_rule:7.1f} us | best GEMV {best_us:7.1f} us "
                  f"({gbs:.0f} GB/s) {best} | bf16 {t_bf16:7.1f} us", flush=True)
            rows.append({"format": fmt, "layer": name, "K": K, "N": N, "M": M, "table_kernel": chosen.kernel,
                         "table_us": t_rule, "bf16_us": t_bf16, "best_us": best_us, "best": repr(best),
                         "all": [(us, repr(c)) for us, c in sorted(res, key=lambda r: r[0])[:5]]})
        del weights, dense
        torch.cuda.empty_cache()
    for M in tokens:
        sel = [r for r in rows if r["M"] == M]
        total = {k: LAYERS * sum(r[k] for r in sel) / 1e3 for k in ("table_us", "best_us", "bf16_us")}
        print(f"{fmt} decoder linears M={M}: table {total['table_us']:.2f} ms, best GEMV {total['best_us']:.2f} ms, "
              f"bf16 {total['bf16_us']:.2f} ms", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--json")
    a = ap.parse_args()
    assert triton_available()            # sets up ENGINE_EMULATE_ARCH's compile target before the first kernel
    caps = device_caps(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()} as {caps.name}", flush=True)
    t0 = time.time()
    rows = [r for fmt in a.formats for r in sweep_format(fmt, a.tokens)]
    print(f"done in {time.time() - t0:.0f} s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "caps": caps.name, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
