"""What crosses between the server and AsyncLLM: the typed commands other threads send its engine thread (drained
between two steps), a request's start order, and the snapshots the engine thread publishes (model, counters)."""
from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.inputs.types import ProcessedPrompt
from engine.sampling_params import SamplingParams
from engine.stats import Histogram


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


@dataclass(frozen=True)
class ModelInfo:
    """The served model as the server describes it; fixed once the engine is built."""
    name: str                        # --served-model-name, else the model directory's name
    max_model_len: int
    vocab_size: int
    multimodal: bool
    max_images_per_prompt: int
    demo_model: bool                 # --demo-model: the page shows a banner
    max_videos_per_prompt: int = 0
    video: dict[str, float] | None = None   # the video processor's sampling and pixel defaults (the page's estimate)


@dataclass(frozen=True)
class StatsSnapshot:
    """The engine's counters (/stats) and its tokens-per-step histogram (/metrics), as the engine thread copied
    them after its last step."""
    counters: dict[str, Any]
    iteration_tokens: Histogram


@dataclass
class StartRequest:
    """Queue the request as soon as its prompt is processed, from the worker thread that processed it: the engine
    then starts without waiting for the event loop to come back for the prompt (~0.3 ms on the H200's host).
    `fit(prompt, params)` first adapts the parameters to the prompt (a server-chosen max_tokens)."""
    request_id: str
    params: SamplingParams
    priority: int = 0
    fit: Callable[[ProcessedPrompt, SamplingParams], None] | None = None
    past_queue_limit: bool = False      # a privileged request (the API key) may pass --max-waiting-requests
