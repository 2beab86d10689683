"""The block map behind the page's KV grid: who holds which GPU block, prefix-cached free blocks, shared
prefix blocks and swapped-out requests, run-length encoded (engine/kv_map.py, KVCacheManager.block_owners)."""
from __future__ import annotations


from engine import SamplingParams
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.inputs.types import ProcessedPrompt
from engine.kv_map import CACHED, FREE, block_map, run_lengths

BLOCK = 4


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, ProcessedPrompt(prompt_token_ids=tokens), SamplingParams(), eos_token_ids=[0], max_tokens=8)


def computed(kv: KVCacheManager, req: Request) -> None:
    """Allocate the whole prompt (after any prefix-cache hits) and mark it computed, as a prefill step does."""
    hits, n = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - n, hits)
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)


def decode(runs):
    return [code for code, count in runs for _ in range(count)]


def test_run_lengths():
    assert run_lengths([]) == []
    assert run_lengths([-1, -1, 0, 0, 0, -2, -1]) == [[-1, 2], [0, 3], [-2, 1], [-1, 1]]


def test_map_shows_holders_shared_prefix_cached_free_and_swapped():
    kv = KVCacheManager(num_gpu_blocks=12, num_cpu_blocks=6, block_size=BLOCK, enable_caching=True)
    prefix = list(range(1, 9))                      # two full blocks every request below starts with
    a = request("a", prefix + [50, 51, 52])
    b = request("b", prefix + [60, 61, 62])
    c = request("c", [70, 71, 72, 73, 74])
    for req in (a, b, c):
        computed(kv, req)

    m = block_map(kv, bytes_per_block=1000)
    codes = decode(m["runs"])
    assert m["num_blocks"] == 12 and len(codes) == 12 and m["bytes_per_block"] == 1000
    assert [r["id"] for r in m["requests"]] == ["a", "b", "c"]
    assert [r["blocks"] for r in m["requests"]] == [3, 3, 2]
    held_by = {k: [i for i, code in enumerate(codes) if code == k] for k in range(3)}
    assert len(held_by[0]) == 3                                   # a: its prefix blocks and its own last block
    assert len(held_by[1]) == 1 and len(held_by[2]) == 2          # b's prefix blocks keep a's colour
    assert sum(n for _, n in m["shared"]) == 2                    # ...and are marked shared
    assert codes.count(FREE) == 12 - 3 - 1 - 2

    # c is swapped out: its GPU blocks are free again (its full block still a prefix-cache entry).
    kv.swap_out(c)
    m = block_map(kv, bytes_per_block=1000)
    codes = decode(m["runs"])
    assert m["requests"][-1] == {"id": "c", "state": "swapped", "blocks": 0, "cpu_blocks": 2}
    assert codes.count(CACHED) == 1 and max(codes) == 1

    # All finished: nothing held; the hashed blocks stay visible as cached.
    for req in (a, b):
        kv.free(req)
    kv.free(c)
    m = block_map(kv, bytes_per_block=1000)
    assert m["requests"] == [] and m["shared"] == []
    assert all(code in (FREE, CACHED) for code in decode(m["runs"]))
    assert len(m["runs"]) <= 5                                    # compact: a few runs, not one entry per block
