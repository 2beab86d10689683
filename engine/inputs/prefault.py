"""Output arrays for decoded images, faulted in before they are needed.

A decoded image outlives its decode (the decoded-image cache keeps it), so every decode writes into fresh
memory, and the kernel maps fresh memory a 4 KB page at a time, at its first write: 768 page faults for a
1024x1024 RGB image, 1.3-1.6 ms on the local host, paid inside the decode. Uploads tend to repeat a size (one
camera, one screen), so after each decode a background thread faults in one array of that size for the next;
an image of a size seen before is then decoded into memory that is already mapped. In the server (local host,
bench/image_timeline.py, 7 runs each way) that took the decode of a 1024x1024 screenshot from 6.1-6.6 to
5.2-6.0 ms, and noise from 13.8-15.3 to 12.8-14.6 ms.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

PAGE = 4096


class PrefaultedArrays:
    """At most one ready uint8 array per shape, for the max_sizes shapes asked for last, max_bytes in all."""

    def __init__(self, max_bytes: int = 64 << 20, max_sizes: int = 4):
        self.max_bytes, self.max_sizes = max_bytes, max_sizes
        self._ready: OrderedDict[tuple[int, ...], np.ndarray] = OrderedDict()
        self._filling: dict[tuple[int, ...], Future] = {}
        self._lock = threading.Lock()
        self._filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefault")

    def take(self, shape: tuple[int, ...]) -> np.ndarray:
        """An uint8 array of `shape` whose contents are undefined: the one faulted in for this shape, if ready;
        else a fresh one (np.empty), faulted in by the caller's writes."""
        with self._lock:
            out = self._ready.pop(tuple(shape), None)
        return out if out is not None else np.empty(shape, dtype=np.uint8)

    def refill(self, shape: tuple[int, ...]) -> None:
        """Fault in an array of `shape` for the next take(), in the background. Called once the decode that
        took one is done, so that the two do not compete for the cores."""
        shape = tuple(shape)
        if int(np.prod(shape)) > self.max_bytes:
            return
        with self._lock:
            if shape in self._ready:
                self._ready.move_to_end(shape)     # asked for again: the last to be evicted
            if shape in self._ready or shape in self._filling:
                return
            self._filling[shape] = self._filler.submit(self._fill, shape)

    def ready_shapes(self) -> list[tuple[int, ...]]:
        """The shapes with an array ready, the one to be evicted first first."""
        with self._lock:
            return list(self._ready)

    def wait(self) -> None:
        """Until the fills asked for so far are done (for tests and benchmarks)."""
        with self._lock:
            pending = list(self._filling.values())
        for future in pending:
            future.result()

    def _fill(self, shape: tuple[int, ...]) -> None:
        try:
            array = np.empty(shape, dtype=np.uint8)
            array.reshape(-1)[::PAGE] = 0      # one write per page maps it
        except MemoryError:                    # no room now: that decode maps its own pages, as without a pool
            array = None
        with self._lock:
            del self._filling[shape]
            if array is None:
                return
            self._ready[shape] = array
            while self._ready and (len(self._ready) > self.max_sizes or
                                   sum(a.nbytes for a in self._ready.values()) > self.max_bytes):
                self._ready.popitem(last=False)    # the shape asked for longest ago


# The decoders' outputs (engine/inputs/png.py).
OUTPUTS = PrefaultedArrays()
