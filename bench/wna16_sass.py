"""Compiles the 4-bit kernels (engine/ops/triton/quant/wna16_gemv.py, wna16_gemm.py) for a GPU target without a GPU (Triton's bundled ptxas and cuobjdump) and prints
each kernel's registers, stack, shared memory and the instructions of its K loop per weight a thread handles.

    python bench/wna16_sass.py [--cap 90] [--dtype bf16]

The K loop is the code between the target of the last backward branch and that branch. Weights per thread per
loop trip: BLOCK_N * BLOCK_K / (32 * num_warps) (one M tile; the gemm's cost per token divides by its rows).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from engine.ops.triton.quant.wna16_gemm import _wna16_gemm_kernel  # noqa: E402
from engine.ops.triton.quant.wna16_gemv import _wna16_gemv_kernel  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
ALIGNED = ("N", "stride_xm", "stride_qk", "stride_sg", "stride_om")   # multiples of 16 at the 8B shapes

# The GEMV (rows over the warps, one reduction at the end; table.py's tiles are the second).
GEMV = [dict(BLOCK_N=32, BLOCK_KP=128, num_warps=8), dict(BLOCK_N=32, BLOCK_KP=64, num_warps=8),
            dict(BLOCK_N=64, BLOCK_KP=64, num_warps=8)]
GEMM = [dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, SWAP_AB=True, num_warps=4, num_stages=4),
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, SWAP_AB=False, num_warps=4, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, SWAP_AB=False, num_warps=4, num_stages=4),
        dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, SWAP_AB=False, num_warps=8, num_stages=3)]


def compile_kernel(kernel, consts: dict, num_warps: int, num_stages: int, cap: int, dtype: str):
    types = {"x_ptr": f"*{dtype}", "qw_ptr": "*i32", "s_ptr": f"*{dtype}", "z_ptr": f"*{dtype}",
             "bias_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "ws_ptr": "*fp32", "lock_ptr": "*i32"}
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in kernel.arg_names}
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in kernel.arg_names
             if n.endswith("_ptr") or n in ALIGNED}
    return triton.compile(ASTSource(kernel, sig, consts, attrs=attrs), target=GPUTarget("cuda", cap, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def loop_histogram(sass: str) -> tuple[int, dict[str, int]]:
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).split(".")[0], m.group(3)))
    loops = [(int(t.group(1), 16), a) for a, op, rest in ins if op == "BRA"
             for t in [re.search(r"0x([0-9a-f]+)", rest)] if t and int(t.group(1), 16) < a]
    if not loops:
        return 0, {}
    lo, hi = max(loops, key=lambda r: r[1] - r[0])
    hist: dict[str, int] = {}
    for a, op, _ in ins:
        if lo <= a <= hi:
            hist[op] = hist.get(op, 0) + 1
    return sum(hist.values()), hist


def report(label: str, kernel, consts: dict, warps: int, stages: int, weights: int, cap: int, dtype: str):
    k = compile_kernel(kernel, consts, warps, stages, cap, dtype)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                             text=True).stdout
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True,
                              text=True).stdout
    usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", res)
    n, hist = loop_histogram(sass)
    top = " ".join(f"{op}:{c}" for op, c in sorted(hist.items(), key=lambda kv: -kv[1])[:10])
    print(f"{label:58s} REG {usage.group(1):>3} STACK {usage.group(2):>3} SHARED {k.metadata.shared:>6}  "
          f"loop {n:5d} instr = {n / weights:5.2f} per weight  {top}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cap", type=int, default=90, help="compute capability, e.g. 80, 86, 89, 90")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    args = ap.parse_args()
    common = dict(BITS=4, GROUP=128, SPLIT=8, SERIAL=True, HAS_BIAS=False, EVEN_N=True)
    for c in GEMV:
        w = c["num_warps"]
        consts = {"BITS": 4, "GROUP": 128, "HAS_BIAS": False, "SPLIT": 4, "SERIAL": True, "GDC": args.cap >= 90} | \
            {k: v for k, v in c.items() if k != "num_warps"}
        report(f"sm{args.cap} gemv BN={c['BLOCK_N']} BKP={c['BLOCK_KP']} warps={w}", _wna16_gemv_kernel,
               consts, w, 1, c["BLOCK_N"] * c["BLOCK_KP"] * 8 // (32 * w), args.cap, args.dtype)
    for c in GEMM:
        w, st = c["num_warps"], c["num_stages"]
        consts = common | {"SPLIT": 1, "SERIAL": False, "GROUP_M": 8} | \
            {k: v for k, v in c.items() if k not in ("num_warps", "num_stages")}
        report(f"sm{args.cap} gemm BM={c['BLOCK_M']} BN={c['BLOCK_N']} BK={c['BLOCK_K']} swap={c['SWAP_AB']} "
               f"warps={w} stages={st}", _wna16_gemm_kernel, consts, w, st,
               c["BLOCK_N"] * c["BLOCK_K"] // (32 * w), args.cap, args.dtype)


if __name__ == "__main__":
    main()
