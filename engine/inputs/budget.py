"""A memory budget for decoding images: the pixels being decoded at once, over all requests, are capped.

Each image's size is known from its header before any pixel is decoded; decoding reserves width x height
pixels (3 bytes each, as RGB) until the decoded image is through its checks, and a request whose image does not
fit beside those being decoded is answered 429 (retry), so that a burst of huge images cannot take the server's
memory all at once. One image alone is always admitted: the per-image limit (--max-image-pixels) bounds it.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from engine.errors import ServerBusyError


class PixelBudget:
    def __init__(self, max_pixels_in_flight: int | None):
        self.max_pixels = max_pixels_in_flight      # None: no cap
        self.in_flight = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def hold(self, pixels: int, param: str | None = None) -> Iterator[None]:
        self._reserve(pixels, param)
        try:
            yield
        finally:
            with self._lock:
                self.in_flight -= pixels

    def _reserve(self, pixels: int, param: str | None) -> None:
        with self._lock:
            if self.max_pixels is not None and self.in_flight and self.in_flight + pixels > self.max_pixels:
                raise ServerBusyError(
                    f"the server is decoding {self.in_flight / 1e6:.0f} Mpx of images already; this "
                    f"{pixels / 1e6:.1f} Mpx image does not fit in its budget of {self.max_pixels / 1e6:.0f} Mpx "
                    f"(--max-pixels-in-flight); retry shortly or send a smaller image", param=param,
                    code="image_budget_exceeded")
            self.in_flight += pixels
