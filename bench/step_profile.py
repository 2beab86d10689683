"""Where one engine step's time goes, at several decode batch sizes and for a 512-token prefill: host phases
(schedule, input preparation, bookkeeping after the step) against device time (the forward alone, timed with
CUDA events, and the sampling that ends in the one host sync).

    python bench/step_profile.py --model DIR --load-format dummy
"""
from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict

import torch

from engine import LLM, SamplingParams


def profile_steps(llm: LLM, batch: int, prompt_len: int, steps: int, vocab: int) -> dict:
    engine = llm.engine
    rng = random.Random(batch)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"p{batch}-{i}", {"prompt_token_ids": [rng.randrange(vocab // 10, vocab)
                                                                  for _ in range(prompt_len)]}, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()                     # prefill everything first
    t = defaultdict(float)
    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    runner = engine.runner
    for _ in range(steps):
        c0 = time.perf_counter()
        so = engine.scheduler.schedule()
        c1 = time.perf_counter()
        inp = runner.prepare_inputs(so)
        c2 = time.perf_counter()
        start_ev.record()
        hidden = runner.graphs.run(inp) if runner.graphs and runner.graphs.can_run(inp) else \
            runner.model(inp.input_ids, inp.positions, runner.kv_caches, inp.md, inp.mm)
        end_ev.record()
        c3 = time.perf_counter()
        from engine.sampler import SamplingMetadata, sample
        logits = runner.model.compute_logits(hidden[inp.logits_indices])
        out = sample(logits, SamplingMetadata.from_requests(inp.sample_requests, logits.shape[-1], runner.device))
        tokens = out.token_ids.tolist()
        c4 = time.perf_counter()
        sampled = {r.request_id: tok for r, tok in zip(inp.sample_requests, tokens)}
        updated = engine.scheduler.update_from_output(so, sampled)
        for req in updated:
            engine.outputs.on_token(req, None)
        c5 = time.perf_counter()
        t["schedule"] += c1 - c0
        t["prepare"] += c2 - c1
        t["launch_forward"] += c3 - c2
        t["logits_sample_sync"] += c4 - c3
        t["update_and_outputs"] += c5 - c4
        t["forward_gpu"] += start_ev.elapsed_time(end_ev) / 1e3
        t["step_total"] += c5 - c0
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)
    return {"batch": batch, **{k: v / steps * 1e3 for k, v in t.items()}}


def kernel_tables(llm: LLM, vocab: int, path: str) -> None:
    """torch.profiler tables (top kernels by device time) for a 512-token prefill and an eager 64-way decode."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    rng = random.Random(0)
    with open(path, "w") as f:
        for name, batch, prompt in (("prefill 512", 1, 512), ("decode x64 (eager)", 64, 512)):
            params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            for i in range(batch):
                engine.add_request(f"k-{name}-{i}", {"prompt_token_ids": [rng.randrange(vocab // 10, vocab)
                                                                          for _ in range(prompt)]}, params)
            if batch > 1:
                engine.step()
                graphs, engine.runner.graphs = engine.runner.graphs, None
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                engine.step()
                torch.cuda.synchronize()
            if batch > 1:
                engine.runner.graphs = graphs
            f.write(f"==== {name}\n")
            f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
            for rid in list(engine.scheduler.requests):
                engine.abort_request(rid)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=None)
    ap.add_argument("--kernel-tables", default=None, help="write torch.profiler tables to this file")
    args = ap.parse_args()
    llm = LLM(args.model, load_format=args.load_format, max_model_len=4096, max_num_seqs=256,
              gpu_memory_utilization=0.85)
    vocab = llm.get_tokenizer().vocab_size
    profile_steps(llm, 4, 64, 5, vocab)   # warm-up
    rows = [profile_steps(llm, b, 512, args.steps, vocab) for b in args.batches]
    keys = list(rows[0])[1:]
    print("| batch | " + " | ".join(keys) + " |  (ms per step)")
    print("|---" * (len(keys) + 1) + "|")
    for r in rows:
        print(f"| {r['batch']} | " + " | ".join(f"{r[k]:.2f}" for k in keys) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    if args.kernel_tables:
        kernel_tables(llm, vocab, args.kernel_tables)


if __name__ == "__main__":
    main()
