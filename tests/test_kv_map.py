"""The block map behind the page's KV panel: who holds which GPU block, prefix-cached free blocks, shared
prefix blocks and swapped-out requests, run-length encoded (engine/kv_map.py, KVCacheManager.block_owners), with
the counts beside it taken from the same copy, and the engine's counters of that moment (GET /stats/blocks)."""
from __future__ import annotations

from engine import SamplingParams
from engine_helpers import make_llm
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.inputs.types import ProcessedPrompt
from engine.kv_map import CACHED, FREE, block_map, run_lengths

BLOCK = 4
BLOCK_SIZE = 16         # make_llm's engine


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


def counts_of(runs) -> dict[str, int]:
    codes = decode(runs)
    return {"used": sum(c >= 0 for c in codes), "cached": codes.count(CACHED), "free": codes.count(FREE)}


def test_the_counts_beside_the_map_are_the_maps_own():
    kv = KVCacheManager(num_gpu_blocks=16, num_cpu_blocks=8, block_size=BLOCK, enable_caching=True)
    prefix = list(range(1, 9))
    a, b, c = request("a", prefix + [50]), request("b", prefix + [60]), request("c", [70, 71, 72, 73, 74])
    for req in (a, b, c):
        computed(kv, req)
    kv.swap_out(c)
    done = request("done", [80, 81, 82, 83, 84])         # finished: its full block stays behind as cached
    computed(kv, done)
    kv.free(done)

    m = block_map(kv, bytes_per_block=1000)
    seen = counts_of(m["runs"])
    assert (m["num_used_gpu_blocks"], m["num_free_cached_blocks"]) == (seen["used"], seen["cached"]) == (4, 2)
    assert m["num_free_gpu_blocks"] == seen["cached"] + seen["free"] == 16 - 4
    assert (m["num_running"], m["num_swapped"], m["num_used_cpu_blocks"]) == (2, 1, 2)
    assert [r["state"] for r in m["requests"]].count("running") == m["num_running"]
    assert m["shared"] == [[start, 2] for start, _ in m["shared"]] and len(m["shared"]) == 1


def test_a_large_pool_is_mapped_from_what_requests_and_the_cache_hold():
    n = 1_000_000
    kv = KVCacheManager(num_gpu_blocks=n, num_cpu_blocks=0, block_size=BLOCK, enable_caching=True)
    computed(kv, request("a", list(range(1, 4 * 1000 + 2))))      # 1,001 blocks, 1,000 of them full
    m = block_map(kv, bytes_per_block=1)
    assert m["num_blocks"] == n and sum(count for _, count in m["runs"]) == n
    assert m["num_used_gpu_blocks"] == 1001 and m["num_free_gpu_blocks"] == n - 1001
    assert len(m["runs"]) <= 3 and m["shared"] == []


def test_the_block_snapshot_carries_the_counters_with_the_map(qwen3_vl_dir):
    llm = make_llm(qwen3_vl_dir, enable_prefix_caching=True)
    engine = llm.engine
    engine.add_request("r1", {"prompt_token_ids": list(range(10, 60))},
                       SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    for _ in range(4):
        engine.step()
    first = engine.get_block_map()
    for _ in range(4):
        engine.step()
    second = engine.get_block_map()
    for snap in (first, second):
        seen = counts_of(snap["runs"])
        assert snap["num_used_gpu_blocks"] == seen["used"] > 0
        assert snap["num_free_gpu_blocks"] == seen["cached"] + seen["free"]
        assert snap["num_total_gpu_blocks"] == snap["num_blocks"] == engine.kv_cache_config.num_gpu_blocks
        assert snap["num_running"] == 1 and snap["block_size"] == BLOCK_SIZE
        assert snap["gpu_cache_usage"] == snap["num_used_gpu_blocks"] / snap["num_blocks"]
    # Monotonic counters on the engine's clock: a reader's rate is their difference over uptime_s.
    assert second["uptime_s"] > first["uptime_s"]
    assert second["num_generation_tokens"] > first["num_generation_tokens"] > 0
