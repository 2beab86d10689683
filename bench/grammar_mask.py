"""Per-token cost of a structured-output token mask on the host: llguidance against xgrammar.

Walks one valid output of a JSON schema token by token (the tokens of a fixed JSON text): at each step computes
the next-token bitmask, then consumes the token, as the engine does per generated token. Prints the compile
time and the mean / p50 / max mask time per token for each engine that imports.

  PYTHONPATH=. python bench/grammar_mask.py [--tokenizer GGUF_OR_DIR]   (default: the SmolLM2 GGUF, 49k vocab)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "tags", "address"]}
TEXT = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry", "notes"],
                   "address": {"city": "London", "zip": "W1"}})


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    p = Path(path)
    if p.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return AutoTokenizer.from_pretrained(str(p))


def bench_llguidance(tok, ids, vocab):
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt
    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    m = llguidance.LLMatcher(lltok, grammar)
    t2 = time.perf_counter()
    mask = llt.allocate_token_bitmask(1, vocab)
    times = []
    for t in ids:
        s = time.perf_counter()
        llt.fill_next_token_bitmask(m, mask)
        times.append(time.perf_counter() - s)
        assert m.consume_token(t), m.get_error()
    return t1 - t0, t2 - t1, times


def bench_xgrammar(tok, ids, vocab):
    import xgrammar as xgr
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    m = xgr.GrammarMatcher(compiled)
    t2 = time.perf_counter()
    mask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for t in ids:
        s = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - s)
        assert m.accept_token(t)
    return t1 - t0, t2 - t1, times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=None)
    args = ap.parse_args()
    path = args.tokenizer
    if path is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from tiny_models import smollm2_gguf_path
        path = str(smollm2_gguf_path())
    tok = load_tokenizer(path)
    vocab = len(tok)
    ids = tok.encode(TEXT, add_special_tokens=False)
    print(f"tokenizer {Path(path).name}: vocab {vocab}, {len(ids)} tokens walked, torch threads "
          f"{torch.get_num_threads()}")
    for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        try:
            tok_s, compile_s, times = fn(tok, ids, vocab)
        except ImportError as e:
            print(f"{name}: not importable ({e})")
            continue
        ms = [t * 1e3 for t in times]
        print(f"{name}: tokenizer setup {tok_s * 1e3:.0f} ms, schema compile {compile_s * 1e3:.1f} ms, mask per "
              f"token mean {statistics.mean(ms):.3f} ms, p50 {statistics.median(ms):.3f} ms, max {max(ms):.3f} ms")


if __name__ == "__main__":
    main()
