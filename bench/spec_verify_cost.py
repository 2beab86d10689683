"""The cost of a speculative verify step against a one-token decode step at batch 1, at the model's real shapes
(dummy weights): each step of a request that verifies k draft tokens (forced: every step drafts k tokens, and the
back-off policy is held open) against plain decode steps of the same request. With
the acceptance measured elsewhere, speedup = (1 + mean accepted per step) / (verify step / decode step).

    python bench/spec_verify_cost.py --model DIR --load-format dummy [--k 4] [--steps 40] [--json out.json]
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


def step_ms(llm: LLM, prompt_ids: list[int], steps: int) -> tuple[float, float]:
    """(ms per step over `steps` decode steps, draft tokens verified per step)."""
    engine = llm.engine
    engine.add_request("r", {"prompt_token_ids": prompt_ids},
                       SamplingParams(temperature=0.0, max_tokens=8 * steps + 64, ignore_eos=True))
    for _ in range(6):                                       # the prefill, then a few steps to settle
        engine.step()
    before = (engine.get_stats().get("spec_decode") or {}).get("num_draft_tokens", 0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / steps * 1e3
    drafted = (engine.get_stats().get("spec_decode") or {}).get("num_draft_tokens", 0) - before
    engine.abort_request("r")
    while engine.has_unfinished_requests():
        engine.step()
    return ms, drafted / steps


def run_side(a, side: str) -> dict:
    """One engine, in this process: plain decode steps, or verify steps of k forced drafts."""
    common = dict(load_format=a.load_format, max_model_len=4096, max_num_seqs=8, gpu_memory_utilization=0.85)
    prompt = [100 + (i % 7) for i in range(512)]
    if side == "plain":
        ms, _ = step_ms(LLM(a.model, **common), prompt, a.steps)
        return {"decode_step_ms": ms}
    policy.MISS_STREAK = 10 ** 9                              # dummy weights reject every draft: keep drafting
    # Random weights repeat nothing for a lookup to find: every step drafts k tokens regardless.
    NgramProposer.propose = lambda self, ids, max_tokens=None: [ids[-1]] * min(self.k, max_tokens or self.k)
    spec = LLM(a.model, speculative_config={"method": "ngram", "num_speculative_tokens": a.k,
                                             "prompt_lookup_min": 1, "prompt_lookup_max": 3}, **common)
    ms, drafts = step_ms(spec, prompt, a.steps)
    return {"verify_step_ms": ms, "drafts_per_step": drafts}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", default=None)
    ap.add_argument("--side", choices=["plain", "spec"], help="one engine in this process (internal)")
    a = ap.parse_args()
    if a.side:
        print("RESULT " + json.dumps(run_side(a, a.side)), flush=True)
        return
    # Each engine in its own process: a second engine in the same process would find the first's memory held.
    res = {"device": torch.cuda.get_device_name(), "k": a.k}
    for side in ("plain", "spec"):
        run = subprocess.run([sys.executable, __file__, "--model", a.model, "--load-format", a.load_format,
                              "--k", str(a.k), "--steps", str(a.steps), "--side", side],
                             capture_output=True, text=True)
        lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
        if run.returncode != 0 or not lines:
            sys.exit(f"the {side} engine failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
        res.update(json.loads(lines[-1][len("RESULT "):]))
    res["verify_over_decode"] = res["verify_step_ms"] / res["decode_step_ms"]
    print(json.dumps(res, indent=1), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
