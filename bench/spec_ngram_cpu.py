"""N-gram speculative decoding on real weights (the SmolLM2-135M-Instruct GGUF, CPU): decode tokens/s with and
without `{"method": "ngram", "num_speculative_tokens": 4}` on a document-rewrite prompt (the answer repeats the
context), on plain chat prompts, greedy (both runs give the same tokens), and on one sampled at temperature 0.8,
where the answer repeats little.

    python bench/spec_ngram_cpu.py [--new 160] [--repeats 3] [--cases NAME,...] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tiny_models import smollm2_gguf_path  # noqa: E402

DOCUMENT = (
    "The town library opens at nine in the morning and closes at six in the evening. On Saturdays it opens "
    "at ten and closes at four. Members may borrow up to eight books at a time for three weeks. Books can be "
    "renewed twice, online or at the front desk, unless another member has reserved them. The reading room on "
    "the second floor is a quiet space; phone calls are not allowed there. Children under ten must be with an "
    "adult. The library also lends laptops for use inside the building, and printing costs ten cents a page.")
PROMPTS = {
    "document rewrite": [{"role": "user", "content": DOCUMENT + "\n\nRepeat the text above exactly, word for word."}],
    "plain chat": [{"role": "user", "content": "Write a short poem about autumn leaves."}],
    "plain question": [{"role": "user", "content": "Why was Canberra chosen as the capital of Australia?"}],
    # Sampled, the small model stops repeating itself: the case where drafts rarely match.
    "sampled chat": [{"role": "user", "content": "Tell me about your favourite season and why."}],
}
SAMPLED = {"sampled chat": dict(temperature=0.8, top_p=0.95, seed=7)}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def decode_rate(llm, prompt, new: int, sampling: dict) -> tuple[float, list[int], dict | None]:
    """(decode tokens/s after the first token, the tokens, the spec-decode counters of this run)."""
    from engine import SamplingParams
    before = llm.engine.get_stats()["spec_decode"]
    t0 = time.perf_counter()
    llm.generate(prompt, SamplingParams(max_tokens=1, **sampling))
    t1 = time.perf_counter()
    [out] = llm.generate(prompt, SamplingParams(max_tokens=new, **sampling))
    t2 = time.perf_counter()
    tokens = out.outputs[0].token_ids
    after = llm.engine.get_stats()["spec_decode"]
    spec = None
    if after is not None:
        spec = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    return (len(tokens) - 1) / ((t2 - t1) - (t1 - t0)), tokens, spec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--cases", default=",".join(PROMPTS), help="comma-separated, of: " + ", ".join(PROMPTS))
    a = ap.parse_args()
    from engine import LLM
    path = smollm2_gguf_path()
    common = dict(max_model_len=2048, num_gpu_blocks_override=512, swap_space=0)
    llms = {"off": LLM(str(path), **common), "ngram k=4": LLM(str(path), speculative_config=NGRAM, **common)}
    results = {}
    for name in a.cases.split(","):
        messages = PROMPTS[name]
        prompts = {k: llm.engine.input_processor.process_chat(messages) for k, llm in llms.items()}
        rates = {k: [] for k in llms}
        sampling = SAMPLED.get(name, {"temperature": 0.0})
        for k, llm in llms.items():
            decode_rate(llm, prompts[k], 8, sampling)                        # warm-up
        for _ in range(a.repeats):                                          # interleaved: drift hits both
            for k, llm in llms.items():
                rate, tokens, spec = decode_rate(llm, prompts[k], a.new, sampling)
                rates[k].append(rate)
                results.setdefault(name, {}).setdefault(k, {})["tokens"] = len(tokens)
                if spec:
                    results[name][k]["spec_decode"] = spec
                results[name].setdefault("outputs", {})[k] = tokens
        same = results[name].pop("outputs")
        row = results[name]
        row["same_tokens"] = same["off"] == same["ngram k=4"]      # greedy: must be; sampled: need not
        for k in llms:
            row[k]["decode_tok_s"] = statistics.median(rates[k])
            row[k]["all_tok_s"] = [round(r, 1) for r in rates[k]]
        row["speedup"] = row["ngram k=4"]["decode_tok_s"] / row["off"]["decode_tok_s"]
        row["verify_cost_ratio"] = llms["ngram k=4"].engine.get_stats()["spec_decode"].get("verify_cost_ratio")
        print(f"{name}: off {row['off']['decode_tok_s']:.1f} tok/s, ngram {row['ngram k=4']['decode_tok_s']:.1f} "
              f"tok/s, x{row['speedup']:.2f}, same tokens {row['same_tokens']}, {row['ngram k=4'].get('spec_decode')}, "
              f"verify/plain step cost {row['verify_cost_ratio']}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
