"""The GPU block pool as a compact map, for the page's KV panel (GET /stats/blocks).

Each block gets a code: -1 free, -2 free but still holding a prefix-cache hash (a later request with the same
prefix takes it back), k >= 0 held by requests[k]. Codes go out run-length encoded as [code, count] pairs,
so an idle pool of 30,000 blocks is one pair and a busy one a few per request. Blocks held by more than one
request (a shared prefix) are listed as runs of [first block, count] in `shared`.

The counts that go with the map (blocks used, free and free-but-cached; requests running and swapped; CPU
blocks in use) are counted from the same copy of the block tables, so a reader that shows them next to the map
never shows two moments. The pool is walked with numpy: a poll of a million-block pool stays cheap.
"""
from __future__ import annotations

import numpy as np

FREE, CACHED = -1, -2


def run_lengths(codes) -> list[list[int]]:
    codes = np.asarray(codes, dtype=np.int64)
    if codes.size == 0:
        return []
    starts = np.concatenate(([0], np.flatnonzero(np.diff(codes)) + 1))
    counts = np.diff(np.concatenate((starts, [codes.size])))
    return np.stack((codes[starts], counts), axis=1).tolist()


def block_map(kv, bytes_per_block: int) -> dict:
    tables, cached_free, swapped = kv.block_owners()
    codes = np.full(kv.pool.num_blocks, FREE, dtype=np.int64)
    codes[np.asarray(cached_free, dtype=np.int64)] = CACHED
    held = [np.asarray(ids, dtype=np.int64) for ids in tables.values()]
    for k in reversed(range(len(held))):        # later holders first: a shared block keeps its first holder's code
        codes[held[k]] = k
    holders = np.bincount(np.concatenate(held), minlength=codes.size) if held else np.zeros(codes.size, np.int64)
    requests = [{"id": rid, "state": "running", "blocks": len(ids), "cpu_blocks": 0} for rid, ids in tables.items()]
    requests += [{"id": rid, "state": "swapped", "blocks": 0, "cpu_blocks": n} for rid, n in swapped.items()]
    used = int(np.count_nonzero(codes >= 0))
    return {"num_blocks": int(codes.size), "bytes_per_block": bytes_per_block, "runs": run_lengths(codes),
            "requests": requests, "shared": _runs_where(holders > 1),
            "num_used_gpu_blocks": used, "num_free_gpu_blocks": int(codes.size) - used,
            "num_free_cached_blocks": int(np.count_nonzero(codes == CACHED)),
            "num_running": len(tables), "num_swapped": len(swapped),
            "num_used_cpu_blocks": sum(swapped.values())}


def _runs_where(flags: np.ndarray) -> list[list[int]]:
    """[first, count] of each run of True."""
    edges = np.diff(np.concatenate(([0], flags.astype(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return np.stack((starts, ends - starts), axis=1).tolist()
