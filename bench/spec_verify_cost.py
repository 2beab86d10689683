"""The cost of a speculative verify step against a one-token decode step, at the model's real shapes (dummy
weights): each step of `--batches` requests that each verify k draft tokens (forced: every step drafts k tokens, and
the back-off policy is held open) against plain decode steps of the same requests. With the acceptance measured
elsewhere, speedup = (1 + mean accepted per step) / (verify step / decode step).

    python bench/spec_verify_cost.py --model DIR --load-format dummy [--k 4] [--batches 1 4] [--steps 40]
        [--sides plain spec] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from engine import LLM, SamplingParams
from engine.spec_decode import policy
from engine.spec_decode.ngram import NgramProposer


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_ms(llm: LLM, prompt_ids: list[int], steps: int, batch: int) -> tuple[float, float]:
    """(ms per step over `steps` decode steps of `batch` requests, draft tokens verified per step)."""
    engine = llm.engine
    for i in range(batch):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt_ids[i:] + prompt_ids[:i]},
                           SamplingParams(temperature=0.0, max_tokens=8 * steps + 64, ignore_eos=True))
    for _ in range(6 + batch):                               # the prefills, then a few steps to settle
        engine.step()
    before = (engine.get_stats().get("spec_decode") or {}).get("num_draft_tokens", 0)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    ms = (time.perf_counter() - t0) / steps * 1e3
    drafted = (engine.get_stats().get("spec_decode") or {}).get("num_draft_tokens", 0) - before
    for i in range(batch):
        engine.abort_request(f"r{i}")
    while engine.has_unfinished_requests():
        engine.step()
    return ms, drafted / steps


def run_side(a, side: str) -> dict:
    """One engine, in this process: plain decode steps, or verify steps of k forced drafts, at each batch size."""
    common = dict(load_format=a.load_format, max_model_len=4096, max_num_seqs=8, gpu_memory_utilization=0.85)
    prompt = [100 + (i % 7) for i in range(512)]
    if side == "plain":
        llm = LLM(a.model, **common)
        return {f"decode_step_ms_b{b}": step_ms(llm, prompt, a.steps, b)[0] for b in a.batches}
    # Dummy weights reject every draft: every request keeps drafting, and no step leaves the drafts out.
    policy.SpeculationPolicy.record = lambda self, *args, **kwargs: None
    policy.StepCosts.wants_plain_step = lambda self, num_seqs: False
    # Random weights repeat nothing for a lookup to find: every step drafts k tokens regardless.
    NgramProposer.propose = lambda self, ids, max_tokens=None: [ids[-1]] * min(self.k, max_tokens or self.k)
    spec = LLM(a.model, speculative_config={"method": "ngram", "num_speculative_tokens": a.k,
                                             "prompt_lookup_min": 1, "prompt_lookup_max": 3}, **common)
    res = {}
    for b in a.batches:
        res[f"verify_step_ms_b{b}"], res[f"drafts_per_step_b{b}"] = step_ms(spec, prompt, a.steps, b)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[1],
                    help="requests decoding together, in turn (below 8, speculation's default limit: all draft)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--sides", nargs="+", choices=["plain", "spec"], default=["plain", "spec"])
    ap.add_argument("--json", default=None)
    ap.add_argument("--side", choices=["plain", "spec"], help="one engine in this process (internal)")
    a = ap.parse_args()
    if a.side:
        print("RESULT " + json.dumps(run_side(a, a.side)), flush=True)
        return
    # Each engine in its own process: a second engine in the same process would find the first's memory held.
    res = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "k": a.k}
    for side in a.sides:
        run = subprocess.run([sys.executable, __file__, "--model", a.model, "--load-format", a.load_format,
                              "--k", str(a.k), "--steps", str(a.steps), "--side", side, "--batches",
                              *map(str, a.batches)], capture_output=True, text=True)
        lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
        if run.returncode != 0 or not lines:
            sys.exit(f"the {side} engine failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
        res.update(json.loads(lines[-1][len("RESULT "):]))
    for b in a.batches:
        if f"verify_step_ms_b{b}" in res and f"decode_step_ms_b{b}" in res:
            res[f"verify_over_decode_b{b}"] = res[f"verify_step_ms_b{b}"] / res[f"decode_step_ms_b{b}"]
    print(json.dumps(res, indent=1), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
