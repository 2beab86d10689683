"""Tensor parallelism against one GPU on the same host: batch-1 decode, TTFT of an 8192-token prompt, and
throughput of 256 requests x 512 prompt / 256 output tokens, at TP=1 and at TP=N, dummy weights.

Each size runs in its own process (a process holds one tensor-parallel group, and the GPUs are freed between the
two), with the same settings; the parent prints one table. Needs N GPUs.

    python bench/synthetic_model.py /tmp/qwen3-vl-8b-synthetic
    python bench/tp_compare.py --model /tmp/qwen3-vl-8b-synthetic --tp 2 [--out tp.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def measure(model: str, tp: int, quick: bool) -> dict:
    import torch
    from offline import decode_rate, random_prompts, throughput, timed_generate, ttft

    from engine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, load_format="dummy", tensor_parallel_size=tp, max_model_len=10240, max_num_seqs=256,
              gpu_memory_utilization=0.85, **({"num_gpu_blocks_override": 512, "enforce_eager": True} if quick else {}))
    vocab = llm.get_tokenizer().vocab_size
    res = {"tp": tp, "startup_s": time.perf_counter() - t0, "num_gpu_blocks": llm.engine.kv_cache_config.num_gpu_blocks,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    timed_generate(llm, random_prompts(2, 64, vocab, 0), SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    res["ttft_tokens"] = 256 if quick else 8192
    res["ttft_ms"] = ttft(llm, res["ttft_tokens"], vocab, repeats=3) * 1e3
    res["decode_batch1"] = decode_rate(llm, 1, 64 if quick else 512, 16 if quick else 128, vocab)
    res["throughput"] = throughput(llm, 8 if quick else 256, 64 if quick else 512, 16 if quick else 256, vocab)
    llm.shutdown()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a model directory (bench/synthetic_model.py writes one)")
    ap.add_argument("--tp", type=int, default=2, help="the tensor-parallel size compared with 1")
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU smoke test of this script)")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)   # one size, JSON on stdout
    args = ap.parse_args()
    if args.child is not None:
        print("RESULT " + json.dumps(measure(args.model, args.child, args.quick)), flush=True)
        return
    results = []
    for tp in (1, args.tp):
        cmd = [sys.executable, __file__, "--model", args.model, "--child", str(tp)] + (["--quick"] if args.quick else [])
        out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
        results.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
    print(json.dumps(results, indent=1))
    one, many = results
    print(f"\n| metric | TP=1 | TP={args.tp} |\n|---|---|---|")
    print(f"| TTFT {one['ttft_tokens']} | {one['ttft_ms']:.1f} ms | {many['ttft_ms']:.1f} ms |")
    print(f"| decode batch 1 | {one['decode_batch1']['ms_per_step']:.2f} ms/step | "
          f"{many['decode_batch1']['ms_per_step']:.2f} ms/step |")
    t1, tn = one["throughput"], many["throughput"]
    print(f"| {t1['requests']} x {t1['prompt']}/{t1['new']} | {t1['output_tok_s']:.0f} output tok/s | "
          f"{tn['output_tok_s']:.0f} output tok/s |")
    print(f"| KV blocks | {one['num_gpu_blocks']} | {many['num_gpu_blocks']} |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
