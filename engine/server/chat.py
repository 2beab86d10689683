"""POST /v1/chat/completions: OpenAI chat messages (text and data-URL images) in, a chat.completion (or a stream
of chat.completion.chunk events) out."""
from __future__ import annotations

import time
import uuid

from aiohttp import web

from engine.async_llm import StartRequest
from engine.errors import InvalidInputError
from engine.outputs import RequestOutput
from engine.server.logprobs import chat_logprobs
from engine.server.protocol import Fields, check_token_ids_in_vocab, renamed_params, sampling_params
from engine.server.serving import Generation, read_request, serve_generation, usage
from engine.server.state import ServerState


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state, f, options = await read_request(request)
    top_logprobs = _top_logprobs(f)
    # max_completion_tokens is OpenAI's current name; max_tokens the deprecated one. The newer one wins.
    max_field = "max_completion_tokens" if f.given("max_completion_tokens") else "max_tokens"
    user_max = f.integer(max_field, None)
    add_generation_prompt = f.boolean("add_generation_prompt", True)
    template_kwargs = f.obj("chat_template_kwargs")
    with renamed_params({"max_tokens": max_field, "logprobs": "top_logprobs", "prompt": "messages"}):
        max_tokens = user_max if user_max is not None else state.sampling_defaults.max_tokens
        params = sampling_params(f, state.sampling_defaults, max_tokens, top_logprobs)
        check_token_ids_in_vocab(params, state.vocab_size)
        start = StartRequest(f"chatcmpl-{uuid.uuid4().hex}", params, options.priority,
                             None if user_max is not None else state.fit_default_max_tokens)
        prompt = await state.engine.process_chat(f.body.get("messages"), add_generation_prompt, template_kwargs,
                                                 start=start)
    gen = Generation(start.request_id, prompt, params, options, int(time.time()))
    return await serve_generation(request, state, gen, ChatFormat(gen, state))


def _top_logprobs(f: Fields) -> int | None:
    """Chat asks with logprobs: true and top_logprobs: k; the engine wants k (0: only the chosen token)."""
    logprobs = f.boolean("logprobs", False)
    top = f.integer("top_logprobs", None)
    if top is not None and not logprobs:
        raise InvalidInputError("top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if logprobs else None


class ChatFormat:
    def __init__(self, gen: Generation, state: ServerState):
        self.gen = gen
        self.state = state
        self.role_sent = False

    def _envelope(self, obj: str, choices: list[dict], **extra) -> dict:
        return {"id": self.gen.request_id, "object": obj, "created": self.gen.created,
                "model": self.state.served_model_name, "choices": choices, **extra}

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, float]] | None) -> dict | None:
        if self.gen.params.logprobs is None or not token_ids or not entries:
            return None
        return chat_logprobs(token_ids, entries[-len(token_ids):], self.gen.params.logprobs, self.state.token_text)

    def chunk(self, out: RequestOutput) -> dict | None:
        c = out.outputs[0]
        logprobs = self._logprobs(c.token_ids_delta, c.logprobs)
        if self.role_sent and not c.text_delta and c.finish_reason is None and logprobs is None:
            return None     # a token whose text is held back (a possible stop string) or not yet decodable
        delta: dict = {} if self.role_sent else {"role": "assistant"}
        if c.text_delta or not self.role_sent:
            delta["content"] = c.text_delta
        self.role_sent = True
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": c.finish_reason}
        if c.finish_reason is not None:
            choice["stop_reason"] = c.stop_reason        # vLLM's extension: the stop string or token id
        extra = {"usage": None} if self.gen.options.include_usage else {}
        return self._envelope("chat.completion.chunk", [choice], **extra)

    def usage_chunk(self, final: RequestOutput) -> dict:
        return self._envelope("chat.completion.chunk", [], usage=usage(final))

    def response(self, final: RequestOutput) -> dict:
        c = final.outputs[0]
        choice = {"index": 0, "message": {"role": "assistant", "content": c.text},
                  "logprobs": self._logprobs(c.token_ids, c.logprobs), "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason}
        return self._envelope("chat.completion", [choice], usage=usage(final))
