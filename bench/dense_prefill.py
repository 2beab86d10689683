"""A fresh prompt's causal attention: the Triton prefill kernel against torch's fused attention (cuDNN, and
FlashAttention for reference) on K/V copied out of the paged cache (engine/ops/attention.py,
dense_causal_attention), per layer at the 8B's heads; then time to first token with the dense path on and off
(DENSE_PREFILL_MIN_TOKENS), alternating in one process, for each weight format given.

    python bench/dense_prefill.py [--models DIR ...] [--load-format dummy] [--json out.json]

Per layer: median of a replayed CUDA graph (bench_ops.time_us), FLOPs of the causal half (4 * Hq * D * n(n+1)/2).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_ops import D, HQ, paged_batch, time_us  # noqa: E402
from engine.ops.attention import dense_causal_attention  # noqa: E402

LENGTHS = (512, 1024, 1536, 2048, 3072, 4096, 8192, 16384)
OFF = 1 << 30


def graph_time_us(fn) -> float:
    """A replayed CUDA graph's median, or eager calls' where the op cannot be captured."""
    try:
        return time_us(fn, graph=True)
    except RuntimeError:
        torch.cuda.synchronize()
        return time_us(fn)


def kernel_rows(lengths) -> list[dict]:
    from engine.ops.triton import attention as attn
    scale = D ** -0.5
    rows = []
    for n in lengths:
        q, kc, vc, md = paged_batch([], [(n, n)])
        flops = 4 * HQ * D * n * (n + 1) // 2
        table = md.block_tables[0]
        attn.DENSE_PREFILL_MIN_TOKENS = OFF
        triton_out = attn.paged_attention(q, kc, vc, md, scale)
        t_triton = graph_time_us(lambda: attn.paged_attention(q, kc, vc, md, scale))
        row = {"tokens": n, "triton_us": t_triton}
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            def dense():
                with sdpa_kernel(backend):
                    return dense_causal_attention(q, kc, vc, table, n, scale)
            try:
                out = dense()
                row[f"{name}_us"] = graph_time_us(dense)
                row[f"{name}_max_err"] = (out.float() - triton_out.float()).abs().max().item()
            except RuntimeError as e:
                row[f"{name}_error"] = str(e).splitlines()[0][:120]
        attn.DENSE_PREFILL_MIN_TOKENS = 0
        row["engine_path_us"] = graph_time_us(lambda: attn.paged_attention(q, kc, vc, md, scale))
        for key in ("triton", "cudnn", "flash"):
            if f"{key}_us" in row:
                row[f"{key}_tflops"] = flops / row[f"{key}_us"] / 1e6
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def ttft_rows(model: str, load_format: str, lengths, repeats: int) -> list[dict]:
    """TTFT per prompt length, the dense path on and off in turns (one engine, same prompts)."""
    from offline import random_prompts, timed_generate
    from engine import LLM, SamplingParams
    from engine.ops.triton import attention as attn
    default = attn.DENSE_PREFILL_MIN_TOKENS
    llm = LLM(model, load_format=load_format, max_model_len=max(lengths) + 256, gpu_memory_utilization=0.85)
    vocab = llm.get_tokenizer().vocab_size
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    timed_generate(llm, random_prompts(1, 64, vocab, 0), one)
    rows = []
    for n in lengths:
        times = {"on": [], "off": []}
        for r in range(repeats + 1):       # the first round warms both paths up and is dropped
            for mode in ("on", "off"):
                attn.DENSE_PREFILL_MIN_TOKENS = default if mode == "on" else OFF
                t = timed_generate(llm, random_prompts(1, n, vocab, seed=1000 * r + n), one)
                if r:
                    times[mode].append(t * 1e3)
        row = {"model": model, "tokens": n, "on_ms": statistics.median(times["on"]),
               "off_ms": statistics.median(times["off"]), "on_all": times["on"], "off_all": times["off"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    attn.DENSE_PREFILL_MIN_TOKENS = default
    del llm
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=[])
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--ttft-lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "kernel": kernel_rows(LENGTHS), "ttft": []}
    print("\n| tokens | Triton prefill us (TFLOP/s) | cuDNN us (TFLOP/s) | FlashAttention us (TFLOP/s) | engine's path us |")
    print("|---|---|---|---|---|")
    for r in res["kernel"]:
        cells = [f"{r[k + '_us']:.1f} ({r[k + '_tflops']:.0f})" if k + "_us" in r else r.get(k + "_error", "-")
                 for k in ("triton", "cudnn", "flash")]
        print(f"| {r['tokens']} | " + " | ".join(cells) + f" | {r['engine_path_us']:.1f} |")
    for model in args.models:
        res["ttft"] += ttft_rows(model, args.load_format, args.ttft_lengths, args.repeats)
    if res["ttft"]:
        print("\n| weights | prompt tokens | TTFT, dense path on | off |\n|---|---|---|---|")
        for r in res["ttft"]:
            print(f"| {r['model']} | {r['tokens']} | {r['on_ms']:.1f} ms | {r['off_ms']:.1f} ms |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
