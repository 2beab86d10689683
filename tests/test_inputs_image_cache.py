"""Processed uploads are kept by the hash of their bytes, so a chat that re-sends its earlier images each turn
decodes, resizes and hashes each image once; the cache is bounded and never keeps a failure."""
from __future__ import annotations

import pytest
import torch

import engine.inputs.processor as processor_module
from engine.errors import ImageError
from engine.inputs.image_cache import ImageCache
from engine.inputs.types import ProcessedImage
from test_inputs_processor import A, B, image_part, make_processor


def pixels(n: int, value: int = 0) -> ProcessedImage:
    return ProcessedImage(raw=torch.full((n, 1, 3), value, dtype=torch.uint8), grid_thw=(1, n, 1),
                          content_hash=str(value))     # 3n bytes


def test_same_bytes_decode_once_and_give_the_same_image(qwen3_vl_dir, monkeypatch):
    proc = make_processor(qwen3_vl_dir)
    calls = []
    real = processor_module.decode_image
    monkeypatch.setattr(processor_module, "decode_image", lambda *a, **k: calls.append(1) or real(*a, **k))
    turn1 = [{"role": "user", "content": [image_part(A), {"type": "text", "text": "What is it?"}]}]
    turn2 = turn1 + [{"role": "assistant", "content": "Noise."},
                     {"role": "user", "content": [image_part(B), {"type": "text", "text": "And this?"}]}]
    first, second = proc.process_chat(turn1), proc.process_chat(turn2)
    assert len(calls) == 2, "A decoded once for both turns, B once"
    assert (proc.image_cache.hits, proc.image_cache.misses) == (1, 2)
    assert second.images[0].content_hash == first.images[0].content_hash
    assert torch.equal(second.images[0].raw, first.images[0].raw)


def test_least_recently_used_images_leave_first_when_full():
    cache = ImageCache(max_bytes=3 * 30)
    for key in (b"a", b"b", b"c"):
        cache.get_or_process(key, lambda: pixels(10))
    cache.get_or_process(b"a", pytest.fail)                 # a hit: a becomes the most recent
    cache.get_or_process(b"d", lambda: pixels(10))          # evicts b, the least recent
    assert len(cache) == 3
    cache.get_or_process(b"a", pytest.fail)
    seen = []
    cache.get_or_process(b"b", lambda: seen.append(1) or pixels(10))
    assert seen == [1], "b had been evicted and is processed again"


def test_an_image_larger_than_the_cache_is_returned_but_not_kept():
    cache = ImageCache(max_bytes=10)
    assert cache.get_or_process(b"big", lambda: pixels(100)).raw.shape == (100, 1, 3)
    assert len(cache) == 0


def test_a_failed_decode_is_not_kept():
    cache = ImageCache(max_bytes=1000)

    def broken():
        raise ImageError("could not decode image")
    for _ in range(2):
        with pytest.raises(ImageError):
            cache.get_or_process(b"junk", broken)
    assert len(cache) == 0 and cache.misses == 2


def test_bytes_that_differ_anywhere_are_told_apart():
    # same length, same first and last bytes: only the hash of all the bytes tells them apart
    cache = ImageCache(max_bytes=1000)
    one = b"x" * 50_000 + b"1" + b"y" * 50_000
    two = b"x" * 50_000 + b"2" + b"y" * 50_000
    cache.get_or_process(one, lambda: pixels(10, 1))
    assert cache.get_or_process(two, lambda: pixels(10, 2)).content_hash == "2"
    assert cache.get_or_process(one, pytest.fail).content_hash == "1"
    assert (cache.hits, cache.misses) == (1, 2)
