"""POST /v1/chat/completions: OpenAI chat messages (text and data-URL images) in, a chat.completion (or a stream
of chat.completion.chunk events) out."""
from __future__ import annotations

import time
import uuid

from aiohttp import web

from engine.async_llm import StartRequest
from engine.errors import InvalidInputError
from engine.outputs import RequestOutput
from engine.server.logprobs import chat_logprobs, prompt_logprobs_json
from engine.server.protocol import (Fields, chat_template_options, check_token_ids_in_vocab, choice_counts,
                                    engine_logprobs, renamed_params, sampling_params)
from engine.server.reasoning import ReasoningStreams, after_reasoning, request_reasoning
from engine.server.serving import Generation, ResponseFormat, read_request, serve_generation, usage
from engine.server.state import ServerState
from engine.server.structured import parse_structured_outputs
from engine.server.tool_parser import StreamingToolParser, parse_tool_calls
from engine.server.tools import ToolConfig, parse_tools, tool_call_constraint


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state, f, options = await read_request(request)
    tools = parse_tools(f, state.auto_tool_choice)
    constraint, constraint_param = parse_structured_outputs(f)
    forced = tool_call_constraint(tools)
    if forced is not None:
        if constraint is not None:
            raise InvalidInputError(f'tool_choice "{tools.choice}" cannot be combined with {constraint_param}',
                                    param=constraint_param)
        constraint, constraint_param = forced, "tools"
    n, best_of = choice_counts(f, options)
    top_logprobs = _top_logprobs(f)
    # max_completion_tokens is OpenAI's current name; max_tokens the deprecated one. The newer one wins.
    max_field = "max_completion_tokens" if f.given("max_completion_tokens") else "max_tokens"
    user_max = f.integer(max_field, None)
    template = chat_template_options(f)
    reasoning = request_reasoning(state.reasoning_parser, template["chat_template_kwargs"])
    with renamed_params({"max_tokens": max_field, "logprobs": "top_logprobs", "prompt": "messages"}):
        max_tokens = user_max if user_max is not None else state.sampling_defaults.max_tokens
        params = sampling_params(f, state.sampling_defaults, max_tokens, engine_logprobs(top_logprobs, n, best_of),
                                 after_reasoning(constraint, reasoning))
        check_token_ids_in_vocab(params, state.vocab_size)
        if constraint is not None:
            await state.engine.compile_structured_output(params, constraint_param)
        start = StartRequest(f"chatcmpl-{uuid.uuid4().hex}", params, options.priority,
                             None if user_max is not None else state.fit_default_max_tokens,
                             past_queue_limit=options.past_queue_limit)
        prompt = await state.engine.process_chat(f.body.get("messages"), start=start, tools=tools.tools,
                                                 **template)
    gen = Generation(start.request_id, prompt, params, options, int(time.time()), n=n, best_of=best_of)
    return await serve_generation(request, state, gen, ChatFormat(gen, state, tools, top_logprobs,
                                                                ReasoningStreams.of(reasoning, prompt)))


def _top_logprobs(f: Fields) -> int | None:
    """Chat asks with logprobs: true and top_logprobs: k; the engine wants k (0: only the chosen token)."""
    logprobs = f.boolean("logprobs", False)
    top = f.integer("top_logprobs", None)
    if top is not None and not logprobs:
        raise InvalidInputError("top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if logprobs else None


class ChatFormat(ResponseFormat):
    chunk_object = "chat.completion.chunk"

    def __init__(self, gen: Generation, state: ServerState, tools: ToolConfig, logprobs: int | None,
                 reasoning: ReasoningStreams | None = None):
        super().__init__(gen, state, logprobs)
        self.tools = tools
        self.reasoning = reasoning
        self.tool_parsers: dict[int, StreamingToolParser] = {}
        self.role_sent: set[int] = set()

    def _finish_reason(self, reason: str | None, called: bool) -> str | None:
        # OpenAI: "tool_calls" when the model chose to call; a named tool_choice ends with "stop".
        return "tool_calls" if reason == "stop" and called and self.tools.choice != "named" else reason

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, float]] | None) -> dict | None:
        if self.logprobs is None or not token_ids or not entries:
            return None
        return chat_logprobs(token_ids, entries[-len(token_ids):], self.logprobs, self.state.token_text)

    def chunk(self, out: RequestOutput, index: int) -> dict | None:
        c = out.outputs[0]
        logprobs = self._logprobs(c.token_ids_delta, c.logprobs)
        text, text_delta, calls, parser, reasoning_delta = c.text, c.text_delta, [], None, ""
        if self.reasoning is not None:
            reasoning_delta, text, text_delta = self.reasoning.feed(out, index)
        if self.tools.parse_calls:
            parser = self.tool_parsers.setdefault(index, StreamingToolParser())
            text_delta, calls = parser.feed(text, final=out.finished)
        role_sent = index in self.role_sent
        if role_sent and not text_delta and not reasoning_delta and not calls and c.finish_reason is None \
                and logprobs is None:
            return None     # a token whose text is held back (a possible stop string) or not yet decodable
        delta: dict = {} if role_sent else {"role": "assistant"}
        if reasoning_delta:
            delta["reasoning_content"] = reasoning_delta
        if text_delta or not role_sent:
            delta["content"] = text_delta
        if calls:
            delta["tool_calls"] = calls
        self.role_sent.add(index)
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": self._finish_reason(c.finish_reason, parser is not None and parser.called)}
        if c.finish_reason is not None:
            choice["stop_reason"] = c.stop_reason        # vLLM's extension: the stop string or token id
        return self.chunk_of(out, choice)

    def response(self, finals: list[RequestOutput]) -> dict:
        extra = {}
        if self.gen.params.prompt_logprobs is not None:
            extra["prompt_logprobs"] = prompt_logprobs_json(finals[0].prompt_logprobs, self.state.token_text)
        return self.envelope("chat.completion", [self._choice(i, f) for i, f in enumerate(finals)],
                             usage=usage(finals), **extra)

    def _choice(self, index: int, final: RequestOutput) -> dict:
        c = final.outputs[0]
        reasoning, text = self.reasoning.split(c.text) if self.reasoning is not None else (None, c.text)
        message: dict = {"role": "assistant", "content": text}
        if self.tools.parse_calls:
            parsed = parse_tool_calls(text or "")
            message = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls}
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning
        return {"index": index, "message": message, "logprobs": self._logprobs(c.token_ids, c.logprobs),
                "finish_reason": self._finish_reason(c.finish_reason, bool(message.get("tool_calls"))),
                "stop_reason": c.stop_reason}
