"""Summarize a py-spy raw profile (`py-spy record --format raw --threads`): samples per thread, then the
functions with the most samples, inclusive and self, per thread.

    python bench/spy_summary.py PROFILE.txt [--top 25]
"""
from __future__ import annotations

import argparse
import signal
from collections import Counter, defaultdict


def main() -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)     # `| head` ends the output quietly
    ap = argparse.ArgumentParser()
    ap.add_argument("profile")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    threads: Counter = Counter()
    inclusive: dict[str, Counter] = defaultdict(Counter)
    own: dict[str, Counter] = defaultdict(Counter)
    for line in open(args.profile):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = stack.split(";")
        thread = frames[0].split(": ", 1)[-1]
        threads[thread] += n
        for f in set(frames[1:]):
            inclusive[thread][f] += n
        own[thread][frames[-1]] += n
    total = sum(threads.values())
    print(f"{total} samples: " + ", ".join(f"{t} {n}" for t, n in threads.most_common()))
    for thread, n in threads.most_common(3):
        print(f"\n== {thread} ({n} samples): inclusive")
        for f, c in [fc for fc in inclusive[thread].most_common() if fc[1] < 0.98 * n][:args.top]:   # not the wrappers
            print(f"{c:6d} {100 * c / n:5.1f}%  {f[:140]}")
        print(f"== {thread}: self")
        for f, c in own[thread].most_common(args.top // 2):
            print(f"{c:6d} {100 * c / n:5.1f}%  {f[:140]}")


if __name__ == "__main__":
    main()
