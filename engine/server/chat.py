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
                                    engine_logprobs, renamed_params, sampling_params, truncate_prompt_tokens)
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
    truncate = truncate_prompt_tokens(f, state.max_model_len)
    echo = _echo_text(f) if f.boolean("echo", False) else None
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
                                                 truncate_prompt_tokens=truncate, **template)
    gen = Generation(start.request_id, prompt, params, options, int(time.time()), n=n, best_of=best_of)
    return await serve_generation(request, state, gen, ChatFormat(gen, state, tools, top_logprobs,
                                                                ReasoningStreams.of(reasoning, prompt), echo))


def _top_logprobs(f: Fields) -> int | None:
    """Chat asks with logprobs: true and top_logprobs: k; the engine wants k (0: only the chosen token)."""
    logprobs = f.boolean("logprobs", False)
    top = f.integer("top_logprobs", None)
    if top is not None and not logprobs:
        raise InvalidInputError("top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if logprobs else None


def _echo_text(f: Fields) -> str:
    """vLLM's chat echo: the last message's text goes before the answer when that message has the answer's role
    (the assistant's, or with add_generation_prompt false the last message's own); otherwise nothing."""
    messages = f.body.get("messages")
    last = messages[-1] if isinstance(messages, list) and messages and isinstance(messages[-1], dict) else {}
    role = "assistant" if f.boolean("add_generation_prompt", True) else last.get("role")
    content = last.get("content") if last.get("role") == role else None
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else ""


class ChatFormat(ResponseFormat):
    """Chat's shapes, as vLLM sends them: a stream opens each choice with `{"role": "assistant", "content": ""}`
    alone (then the echoed text, if any); a plain text delta always carries `content` (an empty one in a final
    chunk that adds no text)."""
    chunk_object = "chat.completion.chunk"

    def __init__(self, gen: Generation, state: ServerState, tools: ToolConfig, logprobs: int | None,
                 reasoning: ReasoningStreams | None = None, echo: str | None = None):
        super().__init__(gen, state, logprobs)
        self.tools = tools
        self.reasoning = reasoning
        self.echo = echo or ""          # the text the answer continues (chat echo)
        self.tool_parsers: dict[int, StreamingToolParser] = {}
        self.opened: set[int] = set()   # the choices whose opening chunks were sent

    def _finish_reason(self, reason: str | None, called: bool) -> str | None:
        # OpenAI: "tool_calls" when the model chose to call; a named tool_choice ends with "stop".
        return "tool_calls" if reason == "stop" and called and self.tools.choice != "named" else reason

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, float]] | None) -> dict | None:
        if self.logprobs is None or not token_ids or not entries:
            return None
        return chat_logprobs(token_ids, entries[-len(token_ids):], self.logprobs, self.token_text)

    def events(self, out: RequestOutput, index: int) -> list[dict]:
        opening = [] if index in self.opened else self._opening_chunks(out, index)
        self.opened.add(index)
        return opening + super().events(out, index)

    def _opening_chunks(self, out: RequestOutput, index: int) -> list[dict]:
        """The role alone (and with return_token_ids the prompt's ids), then the echoed text if any."""
        extra = {"prompt_token_ids": out.prompt_token_ids} if self.gen.options.return_token_ids else {}
        chunks = [self.chunk_of(out, _stream_choice(index, {"role": "assistant", "content": ""}), True, **extra)]
        if self.echo:
            chunks.append(self.chunk_of(out, _stream_choice(index, {"content": self.echo}), True))
        return chunks

    def chunk(self, out: RequestOutput, index: int) -> dict | None:
        c = out.outputs[0]
        logprobs = self._logprobs(c.token_ids_delta, c.logprobs)
        text, text_delta, calls, parser, reasoning_delta = c.text, c.text_delta, [], None, ""
        if self.reasoning is not None:
            reasoning_delta, text, text_delta = self.reasoning.feed(out, index)
        if self.tools.parse_calls:
            parser = self.tool_parsers.setdefault(index, StreamingToolParser())
            text_delta, calls = parser.feed(text, final=out.finished)
        token_ids = self.gen.options.return_token_ids and bool(c.token_ids_delta)
        if not text_delta and not reasoning_delta and not calls and c.finish_reason is None and logprobs is None \
                and not token_ids:
            return None     # a token whose text is held back (a possible stop string) or not yet decodable
        delta: dict = {}
        if reasoning_delta:
            delta["reasoning_content"] = reasoning_delta
        if text_delta or (parser is None and not reasoning_delta):
            delta["content"] = text_delta
        if calls:
            delta["tool_calls"] = calls
        choice = _stream_choice(index, delta, logprobs,
                                self._finish_reason(c.finish_reason, parser is not None and parser.called))
        if c.finish_reason is not None:
            choice["stop_reason"] = c.stop_reason        # vLLM's extension: the stop string or token id
        if self.gen.options.return_token_ids:
            choice["token_ids"] = c.token_ids_delta
        return self.chunk_of(out, choice)

    def response(self, finals: list[RequestOutput]) -> dict:
        prompt_logprobs = None
        if self.gen.params.prompt_logprobs is not None:
            prompt_logprobs = prompt_logprobs_json(finals[0].prompt_logprobs, self.state.token_text)
        extra = {"prompt_token_ids": finals[0].prompt_token_ids} if self.gen.options.return_token_ids else {}
        return self.envelope("chat.completion", [self._choice(i, f) for i, f in enumerate(finals)],
                             usage=usage(finals), prompt_logprobs=prompt_logprobs, **extra)

    def _choice(self, index: int, final: RequestOutput) -> dict:
        c = final.outputs[0]
        reasoning, text = self.reasoning.split(c.text) if self.reasoning is not None else (None, c.text)
        message: dict = {"role": "assistant", "content": text}
        if self.tools.parse_calls:
            parsed = parse_tool_calls(text or "")
            message = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls}
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning
        if self.echo:
            message["content"] = self.echo + (message["content"] or "")
        choice = {"index": index, "message": message, "logprobs": self._logprobs(c.token_ids, c.logprobs),
                  "finish_reason": self._finish_reason(c.finish_reason, bool(message.get("tool_calls"))),
                  "stop_reason": c.stop_reason}
        if self.gen.options.return_token_ids:
            choice["token_ids"] = list(c.token_ids)
        return choice


def _stream_choice(index: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
