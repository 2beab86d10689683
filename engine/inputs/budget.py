"""Memory budgets for request processing: decoded image pixels and prompt text, per request and over all requests
in flight.

- Per request (413): the pixels a request's images decode to, added up from each image's header before any of
  its pixels is decoded, and the UTF-8 bytes of its prompt text, before the template renders it. Retrying the
  same request cannot help, so the answer says which flag bounds it.
- In flight (429, retry): the pixels being decoded and the prompt text being rendered and tokenized at once, over
  all requests. Decoding reserves an image's width x height until the decoded image is through its checks;
  processing reserves a prompt's text bytes until it is tokenized. A request that does not fit beside those in
  progress is refused at once, so that a burst of huge images or prompts cannot take the server's memory (or its
  CPU, which a short chat needs too) all at once. One reservation alone is always admitted, and the per-request
  caps are at most the in-flight ones (EngineArgs checks), so a request alone on the server always fits.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from engine.errors import PayloadTooLargeError, ServerBusyError


def megapixels(n: int) -> str:
    return f"{n / 1e6:.1f} Mpx"


def megabytes(n: int) -> str:
    return f"{n / (1 << 20):.1f} MB"


class InFlightBudget:
    """An amount (pixels, bytes) being processed at once over all requests, capped at `limit` (None: no cap)."""

    def __init__(self, limit: int | None, what: str, flag: str, code: str, describe: Callable[[int], str]):
        self.max_in_flight = limit
        self.in_flight = 0
        self.what, self.flag, self.code, self.describe = what, flag, code, describe
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def hold(self, amount: int, param: str | None = None) -> Iterator[None]:
        self._reserve(amount, param)
        try:
            yield
        finally:
            with self._lock:
                self.in_flight -= amount

    def _reserve(self, amount: int, param: str | None) -> None:
        with self._lock:
            limit = self.max_in_flight
            if limit is not None and self.in_flight and self.in_flight + amount > limit:
                d = self.describe
                raise ServerBusyError(
                    f"the server is processing {d(self.in_flight)} of {self.what} already; this request's "
                    f"{d(amount)} does not fit in its budget of {d(limit)} ({self.flag}); retry shortly or send "
                    f"less", param=param, code=self.code)
            self.in_flight += amount


class PixelBudget(InFlightBudget):
    def __init__(self, max_pixels_in_flight: int | None):
        super().__init__(max_pixels_in_flight, "images", "--max-pixels-in-flight", "image_budget_exceeded",
                         megapixels)


class TextBudget(InFlightBudget):
    def __init__(self, max_bytes_in_flight: int | None):
        super().__init__(max_bytes_in_flight, "prompt text", "--max-prompt-text-mb-in-flight",
                         "text_budget_exceeded", megabytes)


class RequestPixels:
    """The pixels one request's images decode to, added up as each image's header is read (its images load on
    several threads at once), refused with 413 past `limit`. The error names the request's field that holds its
    images (`param`): the total is the problem, not the image that happened to be read last."""

    def __init__(self, limit: int | None, param: str):
        self.limit, self.param = limit, param
        self.total = 0
        self._lock = threading.Lock()

    def add(self, pixels: int) -> None:
        with self._lock:
            self.total += pixels
            if self.limit is not None and self.total > self.limit:
                raise PayloadTooLargeError(
                    f"the images of this request decode to more than {megapixels(self.limit)} "
                    f"(--max-pixels-per-request; {megapixels(self.total)} with this one); send fewer or smaller "
                    f"images", param=self.param, code="too_many_pixels")


def check_text_size(num_bytes: int, limit: int | None, param: str) -> None:
    """413 for prompt text over the per-request cap, before anything renders or tokenizes it."""
    if limit is not None and num_bytes > limit:
        raise PayloadTooLargeError(
            f"the prompt text is {megabytes(num_bytes)}, over the limit of {megabytes(limit)} per request "
            f"(--max-prompt-text-mb); shorten it", param=param, code="prompt_text_too_large")


def text_bytes(value: Any) -> int:
    """UTF-8 bytes of every string (keys too) in nested lists and dicts: what a prompt gives the template. An
    ASCII string's length is known without reading it."""
    total, stack = 0, [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            total += len(node) if node.isascii() else len(node.encode("utf-8", "surrogatepass"))
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return total
