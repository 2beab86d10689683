"""The typed messages other threads send AsyncLLM's engine thread, which drains them between two steps."""
from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.inputs.types import ProcessedPrompt
from engine.sampling_params import SamplingParams


@dataclass
class AddRequest:
    """Engine-thread command: queue a checked request (its stream already waits for outputs)."""
    request_id: str
    prompt: ProcessedPrompt
    params: SamplingParams
    priority: int
    arrival_time: float


@dataclass
class AbortRequest:
    """Engine-thread command: stop a request and free its blocks (its client left)."""
    request_id: str


@dataclass
class ReadState:
    """Engine-thread command: copy some engine state for another thread (`read`, run between two steps)."""
    read: Callable[[], Any]
    result: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)

    def run(self) -> None:
        """On the engine thread: the copy, or the error, goes to the reader."""
        try:
            self.result.set_result(self.read())
        except Exception as e:   # noqa: BLE001 - the reader gets the error, the engine loop goes on
            self.result.set_exception(e)


EngineCommand = AddRequest | AbortRequest | ReadState
