"""BlockPool: the physical KV blocks. Reference counts say who uses a block; a block nobody uses sits in the free
queue, oldest-freed first; with prefix caching a full block keeps its content hash while free, so it can be
found again until allocation reaches it."""
import pytest

from engine.core.block_pool import BlockPool


def ids(blocks):
    return [b.block_id for b in blocks]


def test_a_new_pool_hands_out_blocks_in_id_order_each_with_one_reference():
    pool = BlockPool(4, enable_caching=True)
    assert pool.num_free_blocks == 4
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 1


def test_asking_for_more_blocks_than_are_free_is_an_error_and_takes_none():
    pool = BlockPool(2, enable_caching=False)
    with pytest.raises(RuntimeError, match="asked for 3 blocks with 2 free"):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2


def test_freed_blocks_join_the_tail_of_the_free_queue_in_the_order_given():
    pool = BlockPool(4, enable_caching=False)
    a = pool.get_new_blocks(2)            # 0, 1
    pool.free_blocks(reversed(a))         # tail first: 1 then 0
    assert ids(pool.get_new_blocks(4)) == [2, 3, 1, 0]


def test_a_shared_block_is_free_only_when_its_last_user_lets_go():
    pool = BlockPool(2, enable_caching=True)
    [block] = pool.get_new_blocks(1)
    pool.touch([block])                   # a second request shares it
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.num_free_blocks == 2


def test_freeing_a_block_twice_is_caught():
    pool = BlockPool(1, enable_caching=False)
    [block] = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free_blocks([block])


def test_a_cached_block_stays_findable_while_free_until_it_is_reused():
    pool = BlockPool(2, enable_caching=True)
    [block] = pool.get_new_blocks(1)
    pool.cache_block(block, b"h0")
    pool.free_blocks([block])
    assert pool.get_cached_block(b"h0") is block and pool.num_cached_blocks == 1
    pool.touch([block])                   # a hit: taken back out of the free queue
    assert block.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([block])
    pool.get_new_blocks(2)                # allocation reaches it: its old content is gone
    assert pool.get_cached_block(b"h0") is None and block.block_hash is None


def test_the_first_block_with_some_content_stays_the_cached_copy():
    pool = BlockPool(2, enable_caching=True)
    first, second = pool.get_new_blocks(2)
    pool.cache_block(first, b"same")
    pool.cache_block(second, b"same")     # computed the same tokens independently: stays private
    assert pool.get_cached_block(b"same") is first and second.block_hash is None
    pool.free_blocks([first, second])
    pool.get_new_blocks(1)                # reuses `first` (freed first): the content is gone, not moved
    assert pool.get_cached_block(b"same") is None


def test_without_prefix_caching_nothing_is_cached():
    pool = BlockPool(1, enable_caching=False)
    [block] = pool.get_new_blocks(1)
    pool.cache_block(block, b"h")
    assert pool.get_cached_block(b"h") is None and pool.num_cached_blocks == 0
