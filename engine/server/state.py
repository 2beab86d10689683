"""What every handler shares: the engine, the served model's name, the sampling defaults, the metrics."""
from __future__ import annotations

import asyncio
import functools
import hashlib
import time
from dataclasses import dataclass, field

from aiohttp import web

from engine import __version__
from engine.async_llm import AsyncLLM
from engine.errors import EngineOverloadedError
from engine.inputs.types import ProcessedPrompt
from engine.sampling_params import SamplingParams
from engine.logger import init_logger
from engine.server.defaults import SamplingDefaults
from engine.server.errors import NotFoundError
from engine.server.metrics import ServerMetrics
from engine.server.request_body import BodyLimits
from engine.server.response_store import ResponseStore

logger = init_logger(__name__)


@dataclass
class ServerState:
    engine: AsyncLLM
    served_model_name: str
    model_path: str
    sampling_defaults: SamplingDefaults
    log_requests: bool = True
    auto_tool_choice: bool = False     # --enable-auto-tool-choice
    reasoning_parser: str | None = None    # --reasoning-parser
    stream_write_timeout: float | None = None      # seconds one SSE write may wait for a stalled reader
    stream_buffer_bytes: int = 1 << 20             # output a stream may have waiting for a slow reader
    allow_anonymous_priority: bool = False         # --allow-anonymous-priority
    body_limits: BodyLimits = field(default_factory=BodyLimits)
    return_tokens_as_token_ids: bool = False       # --return-tokens-as-token-ids: a request's default
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    generations: dict[asyncio.Task, str] = field(default_factory=dict)   # serve_generation's tasks -> request id
    responses: ResponseStore = field(default_factory=ResponseStore)     # /v1/responses kept for chaining

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.max_model_len)     # token-count buckets up to max_model_len

    @functools.cached_property
    def system_fingerprint(self) -> str:
        """OpenAI's system_fingerprint: this server's version and what it serves, as vLLM's
        `vllm-<version>-<hash8>`; the same for every response of one server."""
        info = self.engine.model_info
        what = repr((self.model_path, info.name, info.max_model_len, info.vocab_size, info.multimodal))
        return f"localchat-{__version__}-{hashlib.blake2b(what.encode(), digest_size=4).hexdigest()}"

    @property
    def max_model_len(self) -> int:
        return self.engine.model_info.max_model_len

    def token_text(self, token_id: int) -> str:
        """A token's text as logprobs show it."""
        return self.engine.token_text(token_id)

    def fit_default_max_tokens(self, prompt: ProcessedPrompt, params: SamplingParams) -> None:
        """A max_tokens the server chose (completions' 16, generation_config's max_new_tokens) is cut to the room
        the prompt leaves; only a max_tokens the client asked for is an error when it does not fit."""
        if params.max_tokens is not None:
            params.max_tokens = max(1, min(params.max_tokens, self.max_model_len - len(prompt.prompt_token_ids)))

    @property
    def vocab_size(self) -> int:
        return self.engine.model_info.vocab_size

    def check_model(self, requested: str | None) -> None:
        """An omitted model means the served one (as vLLM); the model's path is accepted as an alias."""
        if requested is None or requested in (self.served_model_name, self.model_path):
            return
        raise NotFoundError(f"the model `{requested}` does not exist; this server serves "
                            f"`{self.served_model_name}` (see GET /v1/models)", param="model",
                            code="model_not_found")

    async def drain(self, grace_s: float) -> None:
        """At shutdown: let running generations finish for up to grace_s, then end the rest with an error
        (a stream gets an error event and [DONE], a plain request a 503), which aborts them in the engine;
        whatever still runs a second later is cancelled. (aiohttp itself only stops waiting for a handler.)"""
        running = {task for task in self.generations if not task.done()}
        if not running:
            return
        logger.info("Waiting up to %.0fs for %d running request(s) to finish", grace_s, len(running))
        _, pending = await asyncio.wait(running, timeout=grace_s)
        if not pending:
            return
        logger.info("Ending %d request(s) still running at shutdown", len(pending))
        for task in pending:
            self.engine.fail_request(self.generations[task], EngineOverloadedError(
                "the server is shutting down; the answer was cut short", code="server_shutdown"))
        _, pending = await asyncio.wait(pending, timeout=1.0)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=1.0)


STATE = web.AppKey("state", ServerState)
