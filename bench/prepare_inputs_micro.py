"""Host cost of building one step's batch (ModelRunner.prepare_inputs) for N running decodes, no GPU needed:
a tiny random model on the CPU, N requests brought to steady decoding, then the runner's batch construction
timed alone on the next step's SchedulerOutput (median of --repeats calls).

    python bench/prepare_inputs_micro.py --batch 256 --context 600 --json out.json

Works on trees before the persistent batch too (the runner was engine.runner, prepare_inputs took `prev`),
so one script times both sides of an A/B: `git worktree add /tmp/old <commit>`, then run it from each tree."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import tiny_models  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402


def runner_of(engine):
    executor = getattr(engine, "model_executor", None)
    return executor.driver_worker.model_runner if executor is not None else engine.runner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=600, help="prompt tokens per request")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args()
    model = tiny_models.build_qwen3_vl(Path(tempfile.mkdtemp()) / "vl")
    llm = LLM(str(model), max_num_seqs=args.batch, max_model_len=args.context + 64, enforce_eager=True,
              num_gpu_blocks_override=args.batch * (args.context + 64) // 16 + 64)
    engine = llm.engine
    for i in range(args.batch):
        engine.add_request(f"r{i}", {"prompt_token_ids": [(7 * i + j) % 300 + 10 for j in range(args.context)]},
                           SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()
    for _ in range(4):
        engine.step()
    runner = runner_of(engine)
    so = engine.scheduler.schedule()
    assert len(so.scheduled) == args.batch and all(s.num_scheduled_tokens == 1 for s in so.scheduled), \
        "not a steady decode step"
    runner.update_states(so)
    prev = engine._inflight
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        runner.prepare_inputs(so, prev)
        times.append((time.perf_counter() - t0) * 1e6)
    row = {"batch": args.batch, "context": args.context, "prepare_inputs_us_median": statistics.median(times),
           "prepare_inputs_us_p10": sorted(times)[len(times) // 10]}
    print(json.dumps(row))
    if args.json:
        Path(args.json).write_text(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
