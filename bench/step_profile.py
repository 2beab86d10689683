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

import torch

from engine import LLM, SamplingParams


def profile_steps(llm: LLM, batch: int, prompt_len: int, steps: int, vocab: int) -> dict:
    """Decode steps as the engine runs them (step N+1 launched before step N's tokens are read), timed whole;
    plus, measured separately on the same batch, the host cost of schedule + prepare and the graph's GPU time."""
    engine = llm.engine
    rng = random.Random(batch)
    params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 16, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"p{batch}-{i}", {"prompt_token_ids": [rng.randrange(vocab // 10, vocab)
                                                                  for _ in range(prompt_len)]}, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) / steps * 1e3
    # The graph alone, replayed on the last batch's inputs.
    runner = engine.model_executor.driver_worker.model_runner
    so = engine.scheduler.schedule()
    c0 = time.perf_counter()
    runner.update_states(so)
    inp = runner.prepare_inputs(so, engine._inflight)
    prepare_ms = (time.perf_counter() - c0) * 1e3
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph_ms = float("nan")
    if runner.graphs is not None and runner.graphs.can_run(inp):
        ev0.record()
        for _ in range(10):
            runner.graphs.run(inp)
        ev1.record()
        torch.cuda.synchronize()
        graph_ms = ev0.elapsed_time(ev1) / 10
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return {"batch": batch, "step_ms": step_ms, "tok_s": batch / step_ms * 1e3, "graph_gpu_ms": graph_ms,
            "schedule+prepare_host_ms": prepare_ms}


def profile_prefill(llm: LLM, length: int, vocab: int, repeats: int = 5) -> dict:
    """One prefill step of `length` tokens: host preparation, CPU time to launch the eager forward, GPU time
    of the forward, and the whole time to first token through generate()."""
    engine, runner = llm.engine, llm.engine.model_executor.driver_worker.model_runner
    rng = random.Random(length)
    rows = []
    for r in range(repeats):
        prompt = {"prompt_token_ids": [rng.randrange(vocab // 10, vocab) for _ in range(length)]}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        torch.cuda.synchronize()
        ttft = (time.perf_counter() - t0) * 1e3
        engine.add_request(f"pf{length}-{r}", prompt, SamplingParams(temperature=0.0, max_tokens=1))
        so = engine.scheduler.schedule()
        c0 = time.perf_counter()
        runner.update_states(so)
        inp = runner.prepare_inputs(so, None)
        c1 = time.perf_counter()
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        ev0.record()
        c2 = time.perf_counter()
        with torch.inference_mode():
            runner.model(inp.input_ids, inp.positions, runner.kv_caches, inp.md, inp.mm)
        c3 = time.perf_counter()
        ev1.record()
        torch.cuda.synchronize()
        rows.append({"ttft_ms": ttft, "prepare_ms": (c1 - c0) * 1e3, "launch_cpu_ms": (c3 - c2) * 1e3,
                     "forward_gpu_ms": ev0.elapsed_time(ev1)})
        engine.abort_request(f"pf{length}-{r}")
    med = {k: sorted(x[k] for x in rows)[len(rows) // 2] for k in rows[0]}
    return {"prompt": length, **med}


def launch_costs(llm: LLM, tokens: int = 512) -> dict:
    """CPU microseconds per call of each op wrapper at `tokens` tokens (no sync inside the loop)."""
    from engine import ops
    cfg, dev, dt = llm.engine.model_config, llm.engine.device, llm.engine.dtype
    hq, hk, d, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    x = torch.randn(tokens, h, device=dev, dtype=dt)
    w = torch.ones(h, device=dev, dtype=dt)
    q = torch.randn(tokens, hq, d, device=dev, dtype=dt)
    k = torch.randn(tokens, hk, d, device=dev, dtype=dt)
    cos = torch.randn(tokens, d // 2, device=dev)
    kc = llm.engine.model_executor.driver_worker.model_runner.kv_caches[0]
    slots = torch.arange(tokens, device=dev)
    gu = torch.randn(tokens, 2 * cfg.intermediate_size, device=dev, dtype=dt)
    lin = torch.nn.Linear(h, h, bias=False, device=dev, dtype=dt)
    cases = {
        "rms_norm+residual": lambda: ops.rms_norm(x, w, 1e-6, x),
        "qk_norm_rope": lambda: ops.qk_norm_rope(q, k, w[:d], w[:d], 1e-6, cos, cos),
        "store_kvcache": lambda: ops.store_kvcache(k, k, kc[0], kc[1], slots),
        "silu_and_mul": lambda: ops.silu_and_mul(gu),
        "linear 4096x4096": lambda: lin(x),
    }
    out = {}
    with torch.inference_mode():
        for name, fn in cases.items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                fn()
            out[name] = (time.perf_counter() - t0) / 200 * 1e6
            torch.cuda.synchronize()
    return out


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
                graphs, engine.model_executor.driver_worker.model_runner.graphs = engine.model_executor.driver_worker.model_runner.graphs, None
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                engine.step()
                torch.cuda.synchronize()
            if batch > 1:
                engine.model_executor.driver_worker.model_runner.graphs = graphs
            f.write(f"==== {name}\n")
            f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
            for rid in list(engine.scheduler.requests):
                engine.abort_request(rid)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--kernel-tables", default=None, help="write torch.profiler tables to this file")
    args = ap.parse_args()
    llm = LLM(args.model, load_format=args.load_format, max_model_len=10240, max_num_seqs=256,
              gpu_memory_utilization=0.85)
    vocab = llm.get_tokenizer().vocab_size
    profile_steps(llm, 4, 64, 5, vocab)   # warm-up
    rows = [profile_steps(llm, b, 512, args.steps, vocab) for b in args.batches]
    print("| batch | step ms | tok/s | graph GPU ms | schedule+prepare host ms |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['step_ms']:.2f} | {r['tok_s']:.0f} | {r['graph_gpu_ms']:.2f} | "
              f"{r['schedule+prepare_host_ms']:.2f} |")
    pre = [profile_prefill(llm, n, vocab, repeats=5 if n <= 512 else 3) for n in (512, 8192)]
    for p in pre:
        print(json.dumps(p))
    costs = launch_costs(llm)
    print("launch CPU us/call:", json.dumps({k: round(v, 1) for k, v in costs.items()}))
    rows = {"decode": rows, "prefill": pre, "launch_us": costs}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    if args.kernel_tables:
        kernel_tables(llm, vocab, args.kernel_tables)


if __name__ == "__main__":
    main()
