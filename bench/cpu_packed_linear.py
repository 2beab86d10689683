"""The CPU's linear layers with and without oneDNN prepacking (ops.prepack_linear_weight), in one process, in the
engine's default dtype on this CPU (bf16 where it has AVX512-BF16, else fp32): the embedded default model
(SmolLM2-135M-Instruct GGUF) loaded twice, 64 greedy tokens from each in turns.

    python bench/cpu_packed_linear.py [--rounds 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tiny_models import smollm2_gguf_path  # noqa: E402

import engine.model.vocab_parallel_embedding as vpe  # noqa: E402
from engine import LLM, SamplingParams, ops  # noqa: E402

MESSAGES = [{"role": "user", "content": "Write a long story about a cat who learns to sail."}]


def load(pack: bool) -> LLM:
    real = ops.prepack_linear_weight
    if not pack:   # the loader then keeps every weight plain, as before prepacking existed
        ops.prepack_linear_weight = vpe.prepack_linear_weight = lambda weight: None
    try:
        return LLM(str(smollm2_gguf_path()), max_model_len=2048, num_gpu_blocks_override=512, swap_space=0)
    finally:
        ops.prepack_linear_weight = vpe.prepack_linear_weight = real


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    llms = {"plain": load(False), "packed": load(True)}
    prompt = llms["plain"].engine.input_processor.process_chat(MESSAGES)
    params = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
    times: dict[str, list[float]] = {name: [] for name in llms}
    tokens = {}
    for name, llm in llms.items():     # warm-up
        llm.generate(prompt, params)
    for _ in range(args.rounds):
        for name, llm in llms.items():
            start = time.perf_counter()
            tokens[name] = llm.generate(prompt, params)[0].outputs[0].token_ids
            times[name].append(time.perf_counter() - start)
    res = {"threads": torch.get_num_threads(), "new_tokens": args.new, "dtype": str(llms["plain"].engine.dtype),
           "same_tokens": tokens["plain"] == tokens["packed"]}
    for name, t in times.items():
        res[name] = {"seconds": t, "median_tok_s": args.new / statistics.median(t)}
        print(f"{name}: {res[name]['median_tok_s']:.1f} tok/s (median of {args.rounds}; "
              f"{', '.join(f'{x:.2f}' for x in t)} s)")
    print(f"dtype {res['dtype']}; same tokens: {res['same_tokens']}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
