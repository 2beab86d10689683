"""When a request speculates. Speculating costs twice: its steps wait for their tokens before the next is
scheduled (a draft continues tokens the host must know), and a rejected draft is computed for nothing. So a
request drafts only while the batch is small, and stops for a while when its drafts keep missing."""
from __future__ import annotations

from dataclasses import dataclass

from engine.spec_decode.config import SpeculativeConfig

MISS_STREAK = 8          # steps in a row that kept no draft token (on a GPU drafting none counts) before backing off
MIN_BACKOFF_STEPS = 8
MAX_BACKOFF_STEPS = 256


@dataclass
class _Track:
    misses: int = 0                      # steps in a row that drafted nothing or had every draft rejected
    backoff: int = MIN_BACKOFF_STEPS     # the next back-off's length (doubles while drafts keep missing)
    resume_at: int = 0                   # the step from which it may speculate again


class SpeculationPolicy:
    """`waiting_is_free`: the device runs each step on the calling thread (the CPU), so reading a step before
    scheduling the next costs nothing and a step that drafted nothing is no miss; on a GPU it costs the overlap
    of the host's work with the device's, so it is."""

    def __init__(self, config: SpeculativeConfig, waiting_is_free: bool = False):
        self.config = config
        self.waiting_is_free = waiting_is_free
        self.step = 0
        self._tracks: dict[str, _Track] = {}

    def on_schedule(self, num_running: int) -> bool:
        """A new step: whether the batch is small enough to speculate at all."""
        self.step += 1
        return num_running < self.config.disable_by_batch_size

    def allows(self, request_id: str) -> bool:
        track = self._tracks.get(request_id)
        return track is None or self.step >= track.resume_at

    def record(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """A speculating request's step came back: it drafted num_drafted tokens (maybe none: nothing to look up)
        and kept num_accepted of them."""
        if not num_drafted and self.waiting_is_free:
            return
        track = self._tracks.setdefault(request_id, _Track())
        if num_accepted:
            track.misses, track.backoff = 0, MIN_BACKOFF_STEPS
            return
        track.misses += 1
        if track.misses >= MISS_STREAK:
            track.misses = 0
            track.resume_at = self.step + track.backoff
            track.backoff = min(2 * track.backoff, MAX_BACKOFF_STEPS)

    def forget(self, request_id: str) -> None:
        self._tracks.pop(request_id, None)
