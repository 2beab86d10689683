"""Paged attention on an fp8 KV cache against a bf16 one, per call at Qwen3-VL-8B shapes: decode batches (as CUDA
graph replays, as the engine runs them) and a long prefill through the Triton kernel. The fp8 cache runs twice:
e4m3 decoded with the GPU's conversion (FP8_NATIVE, sm89+, the default there) and with the integer decode older
GPUs use; both must give the same bits.

    python bench/kv_fp8_attention.py [--json out.json] [--sweep-decode-tiles]

--sweep-decode-tiles times the fp8 decode (native) at batch 256 over decode tiles (BLOCK_N, warps, stages) and
checks each against the engine's tile's output.

GB/s counts the K/V bytes each call must read (the cache's element size), for the bf16 and fp8 rows alike.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import engine.ops.triton.attention as attn  # noqa: E402
from bench_ops import BS, D, HK, paged_batch, time_us  # noqa: E402
from engine.ops.kv_cache import FP8_KV_DTYPE, to_kv_cache_dtype  # noqa: E402
from engine.ops.platform import override_caps  # noqa: E402

DECODES = [(1, 512), (1, 8192), (64, 608), (256, 608), (256, 2048)]   # (batch, context)
PREFILL = 8192                                                         # one new prompt, Triton's kernel


def kv_bytes(md, element_size: int) -> int:
    return 2 * sum(md.seq_lens_cpu) * HK * D * element_size


def run_case(label: str, q, k_cache, v_cache, md, graph: bool) -> dict:
    scale = D ** -0.5
    bf16_us = time_us(lambda: attn.paged_attention(q, k_cache, v_cache, md, scale), graph=graph)
    k8, v8 = to_kv_cache_dtype(k_cache, FP8_KV_DTYPE), to_kv_cache_dtype(v_cache, FP8_KV_DTYPE)
    native_out = attn.paged_attention(q, k8, v8, md, scale)
    native_us = time_us(lambda: attn.paged_attention(q, k8, v8, md, scale), graph=graph)
    with override_caps(fp8_tensor_cores=False):     # the integer decode of GPUs without FP8 (sm80/86)
        bits_out = attn.paged_attention(q, k8, v8, md, scale)
        bits_us = time_us(lambda: attn.paged_attention(q, k8, v8, md, scale), graph=graph)
    b16, b8 = kv_bytes(md, 2), kv_bytes(md, 1)
    row = {"case": label, "bf16_us": bf16_us, "fp8_native_us": native_us, "fp8_bits_us": bits_us,
           "bf16_GBps": b16 / bf16_us / 1e3, "fp8_native_GBps": b8 / native_us / 1e3,
           "fp8_bits_GBps": b8 / bits_us / 1e3, "native_equals_bits": bool(torch.equal(native_out, bits_out))}
    print(f"| {label} | {bf16_us:.1f} ({row['bf16_GBps']:.0f}) | {native_us:.1f} ({row['fp8_native_GBps']:.0f}) | "
          f"{bits_us:.1f} ({row['fp8_bits_GBps']:.0f}) | {row['native_equals_bits']} |", flush=True)
    return row


SWEEP_TILES = [(64, 4, 3), (128, 4, 3), (128, 4, 2), (128, 8, 3), (64, 8, 3), (32, 4, 4), (64, 4, 4)]


def sweep_decode_tiles() -> list[dict]:
    scale = D ** -0.5
    default = attn._decode_config
    print("| case | tile (BLOCK_N, warps, stages) | bf16 cache µs | fp8 native µs | fp8 max abs diff to the engine's tile |"
          "\n|---|---|---|---|---|")
    rows = []
    for batch, ctx in [(256, 608), (256, 2048), (1, 8192)]:
        q, k, v, md = paged_batch([ctx] * batch, [])
        k8, v8 = to_kv_cache_dtype(k, FP8_KV_DTYPE), to_kv_cache_dtype(v, FP8_KV_DTYPE)
        base = attn.paged_attention(q, k8, v8, md, scale)
        for tile in SWEEP_TILES:
            attn._decode_config = lambda dtype, device, tile=tile: tile
            try:
                out = attn.paged_attention(q, k8, v8, md, scale)
                diff = (out.float() - base.float()).abs().max().item()
                fp8_us = time_us(lambda: attn.paged_attention(q, k8, v8, md, scale), graph=True)
                bf16_us = time_us(lambda: attn.paged_attention(q, k, v, md, scale), graph=True)
            finally:
                attn._decode_config = default
            rows.append({"case": f"decode {batch} x {ctx}", "tile": tile, "bf16_us": bf16_us, "fp8_native_us": fp8_us,
                         "max_abs_diff": diff})
            print(f"| decode {batch} x {ctx} | {tile} | {bf16_us:.1f} | {fp8_us:.1f} | {diff:.2e} |", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep-decode-tiles", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.sweep_decode_tiles:
        rows = sweep_decode_tiles()
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "sweep": rows}, f, indent=1)
        return
    print(f"{torch.cuda.get_device_name()}; fp8 native decode here: {attn.fp8_native(torch.device('cuda'))}")
    print("| case | bf16 cache µs (GB/s) | fp8, native decode | fp8, integer decode | same bits |\n|---|---|---|---|---|")
    rows = []
    for batch, ctx in DECODES:
        q, k, v, md = paged_batch([ctx] * batch, [])
        rows.append(run_case(f"decode {batch} x {ctx}", q, k, v, md, graph=True))
    q, k, v, md = paged_batch([], [(PREFILL, PREFILL)])
    # The dense cuDNN path never takes an fp8 cache; the bf16 row is forced onto the same Triton kernel.
    attn.DENSE_PREFILL_MIN_TOKENS = 1 << 30
    rows.append(run_case(f"prefill {PREFILL} (Triton kernel)", q, k, v, md, graph=False))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "block_size": BS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
