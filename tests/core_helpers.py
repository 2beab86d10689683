"""Requests and a step loop for the engine core's own tests: no model, no tokenizer, no device."""
from __future__ import annotations

import itertools

import torch

from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput
from engine.inputs.types import ImageItem, ProcessedPrompt
from engine.sampling_params import SamplingParams

EOS = 2
_clock = itertools.count(1)


def make_request(request_id: str, prompt: int | list[int], max_tokens: int = 16, priority: int = 0,
                 images: list[ImageItem] = (), **params) -> Request:
    """A request whose prompt is `prompt` token ids (or that many distinct ones); arrival order = creation order."""
    ids = list(range(10, 10 + prompt)) if isinstance(prompt, int) else list(prompt)
    params = SamplingParams(max_tokens=max_tokens, **params)
    return Request(request_id, ProcessedPrompt(ids, images=list(images)), params, [EOS], max_tokens, priority,
                   arrival_time=float(next(_clock)))


def image(content_hash: str, offset: int, length: int) -> ImageItem:
    """An image placeholder span; only its place and content hash matter to the core."""
    return ImageItem(raw=torch.zeros(1, 1, 3, dtype=torch.uint8), grid_thw=(1, 2, 2), content_hash=content_hash,
                     offset=offset, length=length)


class StepLoop:
    """The engine's loop without a model (LLMEngine.step): step N+1 is scheduled before step N's sampled tokens
    reach the host. The "device" samples `next_token(request)`."""

    def __init__(self, scheduler: Scheduler, next_token=lambda req: 1000 + req.num_output_tokens):
        self.scheduler = scheduler
        self.next_token = next_token
        self.inflight: SchedulerOutput | None = None

    def step(self) -> SchedulerOutput:
        so = self.scheduler.schedule()
        self.land()
        self.inflight = None if so.is_empty else so
        return so

    def land(self) -> None:
        """The step in flight finishes: its sampled tokens reach the host."""
        if self.inflight is not None:
            requests = self.scheduler.requests               # a request finished meanwhile samples a token too
            sampled = {s.request_id: [self.next_token(requests[s.request_id]) if s.request_id in requests else 0]
                       for s in self.inflight.sampled}
            self.scheduler.update_from_output(self.inflight, sampled)
            self.inflight = None

    def run(self, max_steps: int = 1000) -> int:
        """Steps until every request finished; returns how many were taken."""
        for n in range(max_steps):
            if not self.scheduler.has_unfinished_requests() and self.inflight is None:
                return n
            self.step()
        raise AssertionError("requests still unfinished")
