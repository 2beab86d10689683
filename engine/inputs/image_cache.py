"""Decoded uploads, kept by the hash of their bytes.

An OpenAI-style chat is stateless: each turn re-sends every earlier image, and decoding one 1024x1024 PNG takes
~20 ms on the H200's host. The prefix cache already spares the model from re-reading those images; this spares
the decoder. Entries are least-recently-used first out, bounded by their decoded size.
"""
from __future__ import annotations

import hashlib
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image

try:   # cryptographic (a collision would hand one upload another's pixels, or another's cached KV), and
    # 3.5x faster than SHA-NI sha256 on one core: 0.5 ms for a 1024x1024 image; more cores, less.
    from blake3 import blake3

    def new_hash(data: bytes = b"", threaded: bool = True):
        return blake3(data, max_threads=blake3.AUTO if threaded else 1)
except ImportError:  # pragma: no cover
    def new_hash(data: bytes = b"", threaded: bool = True):
        return hashlib.sha256(data)

DecodedImage = Image.Image | np.ndarray


class PixelDigest:
    """The hash of an image's uint8 pixels, fed their rows top to bottom by the PNG decoder while it decodes
    (png.decode_rgb8's on_rows, on its worker threads), so that no separate pass over the pixels follows the
    decode. digest(pixels) is that hash if exactly those pixels were fed; otherwise it hashes them now."""

    def __init__(self):
        # One thread: it runs beside the inflate anyway, and waking blake3's thread pool for every band slowed
        # the decode it hides behind (+0.3 ms here)
        self._hash = new_hash(threaded=False)
        self._fed = 0

    def update(self, rows: np.ndarray) -> None:
        self._hash.update(rows)
        self._fed += rows.nbytes

    def digest(self, pixels: np.ndarray) -> bytes:
        if self._fed == pixels.nbytes:
            return self._hash.digest()
        return new_hash(pixels.data).digest()


def decoded_size(image: DecodedImage) -> int:
    return image.nbytes if isinstance(image, np.ndarray) else image.width * image.height * len(image.getbands())


class DecodedImageCache:
    """Entries are found by the hash of all their bytes; a sample of them (length, first and last SAMPLE_BYTES)
    says at once when bytes cannot be in the cache, so a new upload's full hash is computed beside its decode
    instead of before it (~0.3 ms on the H200's host for a 1.7 MB photo)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, tuple[DecodedImage, bytes]] = OrderedDict()   # key -> (image, sample)
        self._samples: Counter[bytes] = Counter()     # samples of the entries
        self._size = 0
        self._lock = threading.Lock()     # requests are processed on several executor threads
        self.hits = self.misses = 0

    def get_or_decode(self, data: bytes, decode: Callable[[bytes], DecodedImage]) -> DecodedImage:
        """The decoded image for these bytes: from the cache, or decode(data), kept if it fits. Decoding errors
        propagate and nothing is kept. Callers must not modify what they get back: it is shared."""
        sample = _sample(data)
        with self._lock:
            maybe_cached = sample in self._samples
        key, hashing = None, None
        if maybe_cached:
            key = new_hash(data).digest()
            with self._lock:
                hit = self._entries.get(key)
                if hit is not None:
                    self._entries.move_to_end(key)
                    self.hits += 1
                    return hit[0]
        else:
            hashing = _HASHING.submit(lambda: new_hash(data).digest())
        with self._lock:
            self.misses += 1
        image = decode(data)     # outside the lock: other requests go on meanwhile
        key = key if hashing is None else hashing.result()
        size = decoded_size(image)
        if size <= self.max_bytes:
            with self._lock:
                if key not in self._entries:
                    self._entries[key] = (image, sample)
                    self._samples[sample] += 1
                    self._size += size
                while self._size > self.max_bytes:
                    _, (old, old_sample) = self._entries.popitem(last=False)
                    self._samples[old_sample] -= 1
                    if not self._samples[old_sample]:
                        del self._samples[old_sample]
                    self._size -= decoded_size(old)
        return image

    def __len__(self) -> int:
        return len(self._entries)


SAMPLE_BYTES = 16 * 1024
_HASHING = ThreadPoolExecutor(max_workers=2, thread_name_prefix="upload-hash")


def _sample(data: bytes) -> bytes:
    view = memoryview(data)
    return new_hash(b"".join((len(data).to_bytes(8, "little"), view[:SAMPLE_BYTES], view[-SAMPLE_BYTES:])),
                    threaded=False).digest()
