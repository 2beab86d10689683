"""KVCacheManager: each request's block table on top of the block pool. It allocates room for the tokens a step
computes, finds a prompt's cached prefix (prefix caching), frees, and swaps a preempted request's blocks to the
CPU pool and back. Block size 4 throughout: token i of a request lives in block_ids[i // 4], slot i % 4."""
from core_helpers import image, make_request

from engine.core.kv_cache_manager import KVCacheManager

BS = 4


def prefill(kv: KVCacheManager, req) -> int:
    """Run a whole prompt as one step, reusing its cached prefix; returns the tokens found cached."""
    hits, num_cached = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_cached, hits)
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)
    return num_cached


# ---- allocation ----------------------------------------------------------------------------------------------
def test_a_prompt_gets_just_enough_blocks_and_decodes_fill_the_last_one_first():
    kv = KVCacheManager(8, 0, BS, enable_caching=False)
    req = make_request("a", 6)
    assert kv.allocate_slots(req, 6)
    assert kv.block_ids("a") == [0, 1] and kv.num_free_blocks == 6
    req.num_computed_tokens = 6
    assert kv.allocate_slots(req, 2)              # tokens 6, 7: room left in block 1
    assert kv.num_free_blocks == 6
    req.num_computed_tokens = 8
    assert kv.allocate_slots(req, 1)              # token 8 opens block 2
    assert kv.block_ids("a") == [0, 1, 2]


def test_an_allocation_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(2, 0, BS, enable_caching=False)
    req = make_request("a", 9)                    # needs 3 blocks
    assert not kv.allocate_slots(req, 9)
    assert kv.num_free_blocks == 2 and kv.block_ids("a") == [] and not kv.requests


def test_a_block_table_already_handed_out_does_not_change_when_the_request_grows():
    kv = KVCacheManager(4, 0, BS, enable_caching=False)
    req = make_request("a", 4)
    kv.allocate_slots(req, 4)
    table = kv.block_ids("a")
    req.num_computed_tokens = 4
    kv.allocate_slots(req, 1)
    assert table == [0] and kv.block_ids("a") == [0, 1]


def test_free_returns_every_block_and_forgets_the_request():
    kv = KVCacheManager(4, 0, BS, enable_caching=False)
    req = make_request("a", 10)
    kv.allocate_slots(req, 10)
    kv.free(req)
    assert kv.num_free_blocks == 4 and not kv.requests


# ---- prefix caching ------------------------------------------------------------------------------------------
def test_a_prompt_sharing_full_blocks_with_an_earlier_one_reuses_their_kv():
    kv = KVCacheManager(16, 0, BS, enable_caching=True)
    first = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert prefill(kv, first) == 0
    second = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 50, 51, 52])
    assert prefill(kv, second) == 8               # the two full blocks in common
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert kv.prefix_stats.queries == 10 + 11 and kv.prefix_stats.hits == 8


def test_a_hit_never_covers_the_last_prompt_token_whose_logits_must_be_computed():
    kv = KVCacheManager(16, 0, BS, enable_caching=True)
    prefill(kv, make_request("a", list(range(8))))
    again = make_request("b", list(range(8)))      # exactly two full blocks, all cached
    assert prefill(kv, again) == 4


def test_a_block_differs_when_its_tokens_or_any_earlier_token_differ():
    kv = KVCacheManager(16, 0, BS, enable_caching=True)
    prefill(kv, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert prefill(kv, make_request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])) == 0   # the chain breaks at block 0


def test_the_same_placeholder_tokens_of_two_different_images_never_share_kv():
    kv = KVCacheManager(16, 0, BS, enable_caching=True)
    tokens = [1, 7, 7, 7, 7, 7, 7, 2, 3]              # an image's placeholders at tokens 1..6
    prefill(kv, make_request("a", tokens, images=[image("cat", 1, 6)]))
    assert prefill(kv, make_request("b", tokens, images=[image("dog", 1, 6)])) == 0
    assert prefill(kv, make_request("c", tokens, images=[image("cat", 1, 6)])) == 8


def test_cached_blocks_stay_findable_after_their_request_finishes_until_the_pool_needs_them():
    kv = KVCacheManager(4, 0, BS, enable_caching=True)
    a = make_request("a", list(range(9)))           # 3 blocks, 2 of them full and cached
    prefill(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4 and kv.pool.num_cached_blocks == 2
    assert prefill(kv, make_request("b", list(range(9)))) == 8


def test_eviction_takes_the_longest_free_blocks_and_a_prefix_outlives_its_tails():
    kv = KVCacheManager(4, 0, BS, enable_caching=True)
    a = make_request("a", list(range(13)))          # blocks 0..3, the first three full and cached
    prefill(kv, a)
    kv.free(a)                                      # freed tail first: 3, 2, 1, 0
    b = make_request("b", [90, 91, 92, 93, 94])     # 2 new blocks: evicts blocks 3 and 2, not the prefix
    prefill(kv, b)
    assert set(kv.block_ids("b")) == {2, 3}
    hits, num_cached = kv.get_computed_blocks(make_request("c", list(range(13))))
    assert num_cached == 8 and [h.block_id for h in hits] == [0, 1]   # the shared prefix is still there


def test_a_request_that_takes_over_free_cached_blocks_counts_them_against_the_free_pool():
    kv = KVCacheManager(3, 0, BS, enable_caching=True)
    a = make_request("a", list(range(9)))
    prefill(kv, a)
    kv.free(a)                                      # 3 free blocks, 2 of them cached
    b = make_request("b", list(range(8)) + [50] * 5)  # hits 2 blocks, needs 2 more: only 1 left once it takes them
    hits, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 8
    assert not kv.allocate_slots(b, b.num_tokens - num_cached, hits)
    assert kv.num_free_blocks == 3 and all(block.ref_cnt == 0 for block in hits)


# ---- swap space ----------------------------------------------------------------------------------------------
def test_swap_out_moves_the_blocks_to_cpu_and_swap_in_brings_them_back_to_fresh_gpu_blocks():
    kv = KVCacheManager(4, 4, BS, enable_caching=False)
    req = make_request("a", 6)
    kv.allocate_slots(req, 6)
    req.num_computed_tokens = 6
    assert kv.can_swap_out(req)
    out = kv.swap_out(req)                          # (gpu, cpu) copies, run before the GPU blocks are reused
    assert [g for g, _ in out] == [0, 1]
    assert kv.num_free_blocks == 4 and kv.num_free_cpu_blocks == 2 and kv.block_ids("a") == []
    other = make_request("b", 4)
    kv.allocate_slots(other, 4)                     # takes block 2: the head of the free queue
    assert kv.can_swap_in(req, 1)
    back = kv.swap_in(req)                          # (cpu block, gpu block) copies
    assert [c for c, _ in back] == [c for _, c in out]
    assert kv.block_ids("a") == [g for _, g in back] and kv.num_free_cpu_blocks == 4


def test_a_request_swaps_out_only_when_the_cpu_pool_holds_all_its_blocks():
    kv = KVCacheManager(4, 1, BS, enable_caching=False)
    req = make_request("a", 6)
    kv.allocate_slots(req, 6)
    assert not kv.can_swap_out(req)
    assert not kv.can_swap_out(make_request("nothing-allocated", 3))


def test_freeing_a_swapped_request_returns_its_cpu_blocks():
    kv = KVCacheManager(4, 4, BS, enable_caching=False)
    req = make_request("a", 6)
    kv.allocate_slots(req, 6)
    kv.swap_out(req)
    kv.free(req)
    assert kv.num_free_cpu_blocks == 4 and kv.num_free_blocks == 4 and not kv.requests
