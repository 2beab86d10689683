"""Decoded uploads, kept by the hash of their bytes.

An OpenAI-style chat is stateless: each turn re-sends every earlier image, and decoding one 1024x1024 PNG takes
~20 ms on the H200's host. The prefix cache already spares the model from re-reading those images; this spares
the decoder. Entries are least-recently-used first out, bounded by their decoded size.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
from PIL import Image

try:   # cryptographic (a collision would hand one upload another's pixels, or another's cached KV), and
    # 3.5x faster than SHA-NI sha256 on one core: 0.5 ms for a 1024x1024 image; more cores, less.
    from blake3 import blake3

    def new_hash(data: bytes = b""):
        return blake3(data, max_threads=blake3.AUTO)
except ImportError:  # pragma: no cover
    def new_hash(data: bytes = b""):
        return hashlib.sha256(data)

DecodedImage = Image.Image | np.ndarray


class PixelDigest:
    """The hash of an image's uint8 pixels, fed their rows top to bottom by the PNG decoder while it decodes
    (png.decode_rgb8's on_rows, on its worker threads), so that no separate pass over the pixels follows the
    decode. digest(pixels) is that hash if exactly those pixels were fed; otherwise it hashes them now."""

    def __init__(self):
        self._hash = new_hash()
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
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, DecodedImage] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()     # requests are processed on several executor threads
        self.hits = self.misses = 0

    def get_or_decode(self, data: bytes, decode: Callable[[bytes], DecodedImage]) -> DecodedImage:
        """The decoded image for these bytes: from the cache, or decode(data), kept if it fits. Decoding errors
        propagate and nothing is kept. Callers must not modify what they get back: it is shared."""
        key = new_hash(data).digest()
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return hit
            self.misses += 1
        image = decode(data)     # outside the lock: other requests go on meanwhile
        size = decoded_size(image)
        if size <= self.max_bytes:
            with self._lock:
                if key not in self._entries:
                    self._entries[key] = image
                    self._size += size
                while self._size > self.max_bytes:
                    _, old = self._entries.popitem(last=False)
                    self._size -= decoded_size(old)
        return image

    def __len__(self) -> int:
        return len(self._entries)
