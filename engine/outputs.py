"""What the engine hands back per request per step (vLLM's RequestOutput / CompletionOutput)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str                           # all text generated so far (stop string trimmed)
    token_ids: list[int]
    finish_reason: str | None = None    # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token that ended it (None for EOS)
    text_delta: str = ""                # what this step added to `text` (streaming)
    token_ids_delta: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None   # per token: {token_id: logprob} for the chosen + top-k


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    last_token_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)   # seconds between successive tokens
    num_cached_tokens: int = 0          # prompt tokens served from the prefix cache


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None            # set when the request failed inside the engine
    prompt_logprobs: list[dict[int, float] | None] | None = None   # per prompt token (None at position 0)
