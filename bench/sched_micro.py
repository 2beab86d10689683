"""Host cost of one Scheduler.schedule() call against the number of waiting requests (no model, no device).

256 requests decode (the step's running batch) while N more wait. Two cases:
- full: max_num_seqs is reached, so the step admits nobody;
- admit: before each call 8 running requests finish and 8 new ones arrive, so the step admits 8.
Only schedule() is timed; the step's tokens then land at once (update_from_output) outside the timing.

    python bench/sched_micro.py [--waiting 0 1000 4000 16000] [--calls 200] [--policy fcfs priority]
"""
from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.core.kv_cache_manager import KVCacheManager  # noqa: E402
from engine.core.request import Request, RequestStatus  # noqa: E402
from engine.core.scheduler import Scheduler  # noqa: E402
from engine.inputs.types import ProcessedPrompt  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

RUNNING = 256
TURNOVER = 8          # requests that finish and arrive before each call of the `admit` case
PROMPT = 16
BLOCK = 16

_clock = itertools.count()


def request(rng: random.Random, policy: str) -> Request:
    rid = next(_clock)
    priority = rng.randrange(4) if policy == "priority" else 0
    return Request(f"r{rid}", ProcessedPrompt(list(range(100, 100 + PROMPT))), SamplingParams(max_tokens=100_000),
                   [], 100_000, priority, arrival_time=float(rid))


def land(sched: Scheduler, so) -> None:
    sched.update_from_output(so, {s.request_id: 7 for s in so.sampled})


def scheduler_with(num_waiting: int, policy: str, rng: random.Random) -> Scheduler:
    """RUNNING requests decoding (admitted first: the most important), num_waiting behind them."""
    kv = KVCacheManager(200_000, 0, BLOCK, False)
    sched = Scheduler(kv, 8192, RUNNING, policy)
    first = [request(rng, policy) for _ in range(RUNNING)]
    for req in first:
        req.priority = 0                       # under `priority` too, the running ones stay ahead of the queue
        sched.add_request(req)
    land(sched, sched.schedule())
    for _ in range(num_waiting):
        sched.add_request(request(rng, policy))
    assert len(sched.running) == RUNNING, len(sched.running)
    return sched


def time_calls(sched: Scheduler, policy: str, turnover: int, calls: int, rng: random.Random) -> list[float]:
    times = []
    for _ in range(calls):
        if turnover:
            ended = [r for r in list(sched.running) if r.num_output_tokens > 1][-turnover:]
            sched.finish_requests(ended, RequestStatus.FINISHED_STOPPED)
            for _ in range(turnover):
                sched.add_request(request(rng, policy))
        start = time.perf_counter()
        so = sched.schedule()
        times.append(time.perf_counter() - start)
        assert len(so.scheduled) == RUNNING, len(so.scheduled)
        land(sched, so)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--waiting", type=int, nargs="+", default=[0, 1000, 4000, 16000])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--policy", nargs="+", default=["fcfs", "priority"])
    args = ap.parse_args()
    print(f"schedule() per call, {RUNNING} running, median (p90) of {args.calls} calls, microseconds")
    print("| policy | waiting | full: admits 0 | admit: admits 8 |")
    print("|---|---|---|---|")
    for policy in args.policy:
        for n in args.waiting:
            cells = []
            for turnover in (0, TURNOVER):
                rng = random.Random(0)
                sched = scheduler_with(n, policy, rng)
                t = sorted(time_calls(sched, policy, turnover, args.calls, rng))
                cells.append(f"{statistics.median(t) * 1e6:,.0f} ({t[int(len(t) * 0.9)] * 1e6:,.0f})")
            print(f"| {policy} | {n:,} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
