"""Micro-benchmarks of the KV pool as managed memory (runs on CPU or GPU):
- time to first token of a long chat prompt, uncached vs served from the prefix cache (same history, new
  question), on the SmolLM2 GGUF (real weights) or --model;
- cost of swapping N blocks out to the CPU pool and back in (CacheEngine.swap_out / swap_in).

    python bench/kv_micro.py [--model PATH] [--prompt-tokens 1500]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tiny_models import smollm2_gguf_path  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def ttft(llm: LLM, messages) -> tuple[float, int]:
    sync()
    t = time.perf_counter()
    [out] = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=1))
    sync()
    return (time.perf_counter() - t) * 1e3, out.metrics.num_cached_tokens


def prefix_cache_ttft(llm: LLM, prompt_tokens: int) -> dict:
    history = ("Here is a long document about paged attention, block tables and swap space. " * 400)
    words = history.split()
    tok = llm.get_tokenizer()
    while len(tok.encode(" ".join(words))) > prompt_tokens:
        words = words[: int(len(words) * 0.9)]
    doc = " ".join(words)
    first = [{"role": "user", "content": doc + "\nQuestion 1: what is a block table?"}]
    second = [{"role": "user", "content": doc + "\nQuestion 2: what is swap space?"}]
    uncached, hit0 = ttft(llm, first)
    cached, hit1 = ttft(llm, second)
    return {"prompt_tokens": len(llm.engine.input_processor.process_chat(second).prompt_token_ids),
            "uncached_ttft_ms": uncached, "cached_ttft_ms": cached, "cached_tokens": hit1, "first_hit": hit0}


def swap_cost(llm: LLM, counts=(16, 64, 256)) -> list[dict]:
    cache = llm.engine.model_executor.driver_worker.cache
    per_block = llm.engine.model_executor.driver_worker.cache.bytes_per_block(llm.engine.model_config, llm.engine.args.block_size,
                                                llm.engine.kv_cache_config.cache_dtype)
    rows = []
    for n in counts:
        n = min(n, llm.engine.kv_cache_config.num_gpu_blocks, llm.engine.kv_cache_config.num_cpu_blocks)
        pairs = [(i, i) for i in range(n)]
        cache.swap_out(pairs)      # warm-up
        sync()
        t0 = time.perf_counter()
        cache.swap_out(pairs)
        sync()
        t1 = time.perf_counter()
        cache.swap_in(pairs)
        sync()
        t2 = time.perf_counter()
        rows.append({"blocks": n, "mb": n * per_block / 2**20, "swap_out_ms": (t1 - t0) * 1e3,
                     "swap_in_ms": (t2 - t1) * 1e3, "out_gb_s": n * per_block / (t1 - t0) / 1e9,
                     "in_gb_s": n * per_block / (t2 - t1) / 1e9})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    args = ap.parse_args()
    model = args.model or str(smollm2_gguf_path())
    llm = LLM(model, enable_prefix_caching=True, max_model_len=4096, num_gpu_blocks_override=1024, swap_space=1)
    ttft(llm, [{"role": "user", "content": "warm-up"}])
    res = {"device": str(llm.engine.device), "dtype": str(llm.engine.dtype),
           "prefix_cache": prefix_cache_ttft(llm, args.prompt_tokens), "swap": swap_cost(llm)}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
