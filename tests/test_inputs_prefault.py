"""PrefaultedArrays hands each decode an output array: one already mapped when an array of that shape was
asked to be refilled since, a fresh one otherwise, and never memory it handed out before (decoded images are
kept by the cache, so a reused array would change a cached image). It holds at most max_sizes shapes and
max_bytes."""
from __future__ import annotations

import resource

import numpy as np

from engine.inputs.prefault import PrefaultedArrays

SHAPE = (512, 1024, 3)     # 1.5 MB: 384 pages


def faults_writing(array: np.ndarray) -> int:
    """Minor page faults taken while writing every byte of `array`."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    array.fill(7)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_without_a_refill_take_gives_a_fresh_array_of_the_shape():
    pool = PrefaultedArrays()
    a, b = pool.take(SHAPE), pool.take(SHAPE)
    assert a.shape == SHAPE and a.dtype == np.uint8
    assert not np.shares_memory(a, b)


def test_after_a_refill_take_gives_an_array_already_mapped():
    pool = PrefaultedArrays()
    pool.refill(SHAPE)
    pool.wait()
    assert pool.ready_shapes() == [SHAPE]
    out = pool.take(SHAPE)
    assert out.shape == SHAPE and pool.ready_shapes() == []
    assert faults_writing(out) < 16       # a fresh array of this shape takes ~384 (one per 4 KB page)


def test_an_array_is_handed_out_once():
    pool = PrefaultedArrays()
    pool.refill(SHAPE)
    pool.wait()
    first = pool.take(SHAPE)
    pool.refill(SHAPE)
    pool.wait()
    second, third = pool.take(SHAPE), pool.take(SHAPE)
    assert not np.shares_memory(first, second) and not np.shares_memory(second, third)


def test_a_shape_asked_for_twice_is_filled_once():
    pool = PrefaultedArrays()
    pool.refill(SHAPE)
    pool.refill(SHAPE)
    pool.wait()
    assert pool.ready_shapes() == [SHAPE]


def test_the_shape_asked_for_longest_ago_is_evicted_first():
    pool = PrefaultedArrays(max_sizes=2)
    a, b, c = (10, 10, 3), (20, 20, 3), (30, 30, 3)
    for shape in (a, b):
        pool.refill(shape)
        pool.wait()
    pool.refill(a)                          # a is asked for again: b is now the oldest
    pool.refill(c)
    pool.wait()
    assert pool.ready_shapes() == [a, c]


def test_the_pool_holds_at_most_max_bytes():
    pool = PrefaultedArrays(max_bytes=SHAPE[0] * SHAPE[1] * 3 + 100)
    pool.refill((4000, 4000, 3))           # alone larger than the bound: not filled at all
    pool.refill(SHAPE)
    pool.wait()
    pool.refill((10, 10, 3))                # SHAPE plus this is over the bound: SHAPE goes
    pool.wait()
    assert pool.ready_shapes() == [(10, 10, 3)]


def test_a_fill_without_memory_leaves_the_shape_to_be_asked_for_again(monkeypatch):
    pool = PrefaultedArrays()
    real_empty = np.empty

    def no_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(np, "empty", no_memory)
    pool.refill(SHAPE)
    pool.wait()
    assert pool.ready_shapes() == []
    monkeypatch.setattr(np, "empty", real_empty)
    pool.refill(SHAPE)                     # not stuck as "being filled"
    pool.wait()
    assert pool.ready_shapes() == [SHAPE]
