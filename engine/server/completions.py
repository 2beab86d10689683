"""POST /v1/completions: a raw prompt (text or token ids) in, a text_completion (or a stream of them) out.

One prompt per request: a list of several prompts (OpenAI's batch form) is refused with a 400 rather than
answered with several choices, since the engine serves n=1 and clients of this server send one prompt.
"""
from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web

from engine.async_llm import StartRequest
from engine.errors import InvalidInputError
from engine.outputs import RequestOutput
from engine.server.logprobs import completion_logprobs
from engine.server.protocol import check_token_ids_in_vocab, renamed_params, sampling_params
from engine.server.serving import Generation, read_request, serve_generation, usage
from engine.server.state import ServerState

DEFAULT_MAX_TOKENS = 16       # OpenAI's and vLLM's default for /v1/completions


async def create_completion(request: web.Request) -> web.StreamResponse:
    state, f, options = await read_request(request)
    prompt_input = parse_prompt(f.body.get("prompt"))
    user_max = f.integer("max_tokens", None)
    with renamed_params({"messages": "prompt", "multi_modal_data": "prompt"}):
        max_tokens = user_max if user_max is not None else DEFAULT_MAX_TOKENS
        params = sampling_params(f, state.sampling_defaults, max_tokens, f.integer("logprobs", None))
        check_token_ids_in_vocab(params, state.vocab_size)
        start = StartRequest(f"cmpl-{uuid.uuid4().hex}", params, options.priority,
                             None if user_max is not None else state.fit_default_max_tokens)
        prompt = await state.engine.process_prompt(prompt_input, start=start)
    gen = Generation(start.request_id, prompt, params, options, int(time.time()))
    return await serve_generation(request, state, gen, CompletionFormat(gen, state))


def parse_prompt(value: Any) -> str | dict[str, Any]:
    """A string, a list of token ids, or either wrapped in a one-element list -> what the engine takes."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return {"prompt_token_ids": value}
        if all(isinstance(v, (str, list)) for v in value):
            if len(value) > 1:
                raise InvalidInputError(f"prompt holds {len(value)} prompts; this server takes one prompt per "
                                        f"request (send them as separate requests)", param="prompt")
            return parse_prompt(value[0]) if isinstance(value[0], str) else {"prompt_token_ids": value[0]}
    if value is None:
        raise InvalidInputError("prompt is required: a string or a list of token ids", param="prompt")
    raise InvalidInputError("prompt must be a non-empty string or a non-empty list of token ids", param="prompt")


class CompletionFormat:
    def __init__(self, gen: Generation, state: ServerState):
        self.gen = gen
        self.state = state
        self.text_offset = 0          # characters of completion text already covered by streamed logprobs

    def _envelope(self, choices: list[dict], **extra) -> dict:
        return {"id": self.gen.request_id, "object": "text_completion", "created": self.gen.created,
                "model": self.state.served_model_name, "choices": choices, **extra}

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, float]] | None) -> dict | None:
        if self.gen.params.logprobs is None or not token_ids or not entries:
            return None
        result = completion_logprobs(token_ids, entries[-len(token_ids):], self.gen.params.logprobs,
                                     self.state.token_text, self.text_offset)
        self.text_offset += sum(len(t) for t in result["tokens"])
        return result

    def _choice(self, text: str, logprobs: dict | None, finish_reason: str | None, stop_reason) -> dict:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason          # vLLM's extension: the stop string or token id
        return choice

    def chunk(self, out: RequestOutput) -> dict | None:
        c = out.outputs[0]
        logprobs = self._logprobs(c.token_ids_delta, c.logprobs)
        if not c.text_delta and c.finish_reason is None and logprobs is None:
            return None     # a token whose text is held back (a possible stop string) or not yet decodable
        extra = {"usage": None} if self.gen.options.include_usage else {}
        return self._envelope([self._choice(c.text_delta, logprobs, c.finish_reason, c.stop_reason)], **extra)

    def usage_chunk(self, final: RequestOutput) -> dict:
        return self._envelope([], usage=usage(final))

    def response(self, final: RequestOutput) -> dict:
        c = final.outputs[0]
        logprobs = self._logprobs(c.token_ids, c.logprobs)
        return self._envelope([self._choice(c.text, logprobs, c.finish_reason, c.stop_reason)],
                              usage=usage(final))
