"""The GPU block pool as a compact map, for the page's live KV grid (GET /stats/blocks).

Each block gets a code: -1 free, -2 free but still holding a prefix-cache hash (a later request with the same
prefix takes it back), k >= 0 held by requests[k]. Codes go out run-length encoded as [code, count] pairs,
so an idle pool of 30,000 blocks is one pair and a busy one a few per request. Blocks held by more than one
request (a shared prefix) are listed as runs of [first block, count] in `shared`.
"""
from __future__ import annotations

FREE, CACHED = -1, -2


def run_lengths(codes: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for code in codes:
        if runs and runs[-1][0] == code:
            runs[-1][1] += 1
        else:
            runs.append([code, 1])
    return runs


def block_map(kv, bytes_per_block: int) -> dict:
    for _ in range(3):          # the engine thread may resize a dict while it is copied: copy again
        try:
            tables, blocks, swapped = kv.block_owners()
            break
        except RuntimeError:
            continue
    else:
        tables, blocks, swapped = {}, [], {}
    codes = [CACHED if cached and ref == 0 else FREE for ref, cached in blocks]
    requests = []
    for rid, ids in tables.items():
        k = len(requests)
        requests.append({"id": rid, "state": "running", "blocks": len(ids), "cpu_blocks": 0})
        for block_id in ids:
            if block_id < len(codes) and codes[block_id] < 0:   # a shared block keeps its first holder's colour
                codes[block_id] = k
    for rid, n in swapped.items():
        requests.append({"id": rid, "state": "swapped", "blocks": 0, "cpu_blocks": n})
    shared = [[start, n] for start, n in _runs_where([ref > 1 for ref, _ in blocks])]
    return {"num_blocks": len(codes), "bytes_per_block": bytes_per_block, "runs": run_lengths(codes),
            "requests": requests, "shared": shared}


def _runs_where(flags: list[bool]):
    start = None
    for i, flag in enumerate(flags + [False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            yield start, i - start
            start = None
