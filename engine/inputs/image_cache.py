"""Processed uploads (images and videos), kept by the hash of their bytes and of how they were processed.

An OpenAI-style chat is stateless: each turn re-sends every earlier image. The prefix cache already spares the
model from re-reading those images; this spares the host from decoding, resizing and hashing them again. Entries
are least-recently-used first out, bounded by the bytes of their pixels.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from blake3 import blake3

from engine.inputs.types import ProcessedImage, ProcessedVideo


class ImageCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, ProcessedImage | ProcessedVideo] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()     # images load on several executor threads at once
        self.hits = self.misses = 0

    def get_or_process(self, data: bytes, process: Callable[[], ProcessedImage | ProcessedVideo],
                       settings: str = "") -> ProcessedImage | ProcessedVideo:
        """The processed upload for these bytes and `settings` (what else decides the result: a request's own
        processor settings): from the cache, or process(), kept if it fits. Errors propagate and nothing is
        kept. Callers must not modify what they get back: it is shared."""
        # Cryptographic: a collision would hand one upload another's pixels, and with them another's cached KV.
        # One thread (here and for the content hash): blake3's own pool would be a second pool beside the
        # executor, and on a busy host it waits for cores.
        hasher = blake3(settings.encode() + b"\0") if settings else blake3()
        key = hasher.update(data).digest()
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return hit
            self.misses += 1
        image = process()        # outside the lock: other requests go on meanwhile
        size = image.nbytes
        if size <= self.max_bytes:
            with self._lock:
                if key not in self._entries:
                    self._entries[key] = image
                    self._size += size
                while self._size > self.max_bytes:
                    _, old = self._entries.popitem(last=False)
                    self._size -= old.nbytes
        return image

    def __len__(self) -> int:
        return len(self._entries)
