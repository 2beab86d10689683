"""POST /v1/responses (OpenAI's Responses API, as vLLM and SGLang serve it), GET and DELETE /v1/responses/{id}.

A request becomes a chat request (responses_protocol.py: input items -> chat messages, function tools ->
chat tools, text.format -> an output constraint) and runs the chat path: the same template, tool parser,
reasoning parser, constraints and generation (serve_generation). The answer comes back as a Response object,
or as its stream of named events (responses_items.py). `previous_response_id` continues a stored response: its
whole conversation, output included, goes before this request's input; `instructions` are never carried over.
Responses are stored (response_store.py) unless the request says `store: false`.
"""
from __future__ import annotations

import time

from aiohttp import web

from engine.async_llm import StartRequest
from engine.outputs import RequestOutput
from engine.server.errors import dumps
from engine.server.protocol import Fields, renamed_params, sampling_params
from engine.server.reasoning import ReasoningStreams, after_reasoning, request_reasoning
from engine.server.request_body import check_chat_shape
from engine.server.responses_items import OutputEvents, function_call_item, message_item, new_id, reasoning_item
from engine.server.responses_protocol import chat_tools, check_unsupported, input_messages, text_format
from engine.server.serving import Generation, ResponseFormat, read_request, serve_generation
from engine.server.state import STATE, ServerState
from engine.server.tool_parser import StreamingToolParser, parse_tool_calls
from engine.server.tools import ToolConfig, parse_tools, tool_call_constraint

# Request fields a Response object repeats back, with OpenAI's defaults.
_ECHOED = {"instructions": None, "max_output_tokens": None, "metadata": {}, "parallel_tool_calls": True,
           "previous_response_id": None, "tool_choice": "auto", "tools": [], "user": None, "reasoning": None,
           "truncation": "disabled", "store": True}


async def create_response(request: web.Request) -> web.StreamResponse:
    state, f, options = await read_request(request)
    check_chat_shape(f.body, state.body_limits, "input")     # the chat's limits on the input items, before any work
    check_unsupported(f)
    store = f.boolean("store", True)
    conversation = _conversation(state, f)
    instructions = f.string("instructions", None)
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    tools = parse_tools(chat_tools(f), state.auto_tool_choice)
    fmt, constraint = text_format(f)
    # A forced tool call writes no text, so text.format (the shape of a text answer) has nothing to apply to:
    # agents send both, and the tool call wins.
    forced = tool_call_constraint(tools)
    constraint, param = (forced, "tools") if forced is not None else (constraint, "text.format")
    template_kwargs = f.obj("chat_template_kwargs")
    reasoning = request_reasoning(state.reasoning_parser, template_kwargs)
    user_max = f.integer("max_output_tokens", None)
    with renamed_params({"max_tokens": "max_output_tokens", "messages": "input", "prompt": "input"}):
        max_tokens = user_max if user_max is not None else state.sampling_defaults.max_tokens
        params = sampling_params(f, state.sampling_defaults, max_tokens, None, after_reasoning(constraint, reasoning))
        if constraint is not None:
            await state.engine.compile_structured_output(params, param)
        start = StartRequest(new_id("resp"), params, options.priority,
                             None if user_max is not None else state.fit_default_max_tokens)
        prompt = await state.engine.process_chat(messages, start=start, tools=tools.tools,
                                                 chat_template_kwargs=template_kwargs)
    gen = Generation(start.request_id, prompt, params, options, int(time.time()))
    echo = {**{k: f.body[k] if f.given(k) else v for k, v in _ECHOED.items()}, "store": store,
            "temperature": params.temperature, "top_p": params.top_p, "text": {"format": fmt}}
    shape = ResponsesFormat(gen, state, tools, ReasoningStreams.of(reasoning, prompt), echo,
                            conversation if store else None)
    return await serve_generation(request, state, gen, shape)


def _conversation(state: ServerState, f: Fields) -> list[dict]:
    """The chat messages of the stored conversation that previous_response_id continues, then of `input`."""
    previous = f.string("previous_response_id", None)
    history = [] if previous is None else state.responses.get(previous, param="previous_response_id").messages
    return history + input_messages(f.body.get("input"))


async def retrieve_response(request: web.Request) -> web.Response:
    stored = request.app[STATE].responses.get(request.match_info["response_id"])
    return web.json_response(stored.response, dumps=dumps)


async def delete_response(request: web.Request) -> web.Response:
    store = request.app[STATE].responses
    response_id = request.match_info["response_id"]
    store.get(response_id)                                # a 404 for an unknown id
    store.pop(response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": True}, dumps=dumps)


class ResponsesFormat(ResponseFormat):
    """A Response object, or its stream of events; stores the finished response when asked."""
    named_events = True

    def __init__(self, gen: Generation, state: ServerState, tools: ToolConfig, reasoning: ReasoningStreams | None,
                 echo: dict, conversation: list[dict] | None):
        super().__init__(gen, state, None)
        self.tools = tools
        self.reasoning = reasoning
        self.echo = echo
        self.conversation = conversation         # None: not stored
        self.stream = OutputEvents()
        self.tool_parser = StreamingToolParser()
        self.sequence = 0

    # ---- the whole response ----------------------------------------------------------------------------------
    def response(self, finals: list[RequestOutput]) -> dict:
        return self._finish(finals[0], self._items(finals[0]))

    def _items(self, final: RequestOutput) -> list[dict]:
        c = final.outputs[0]
        status = _status(c.finish_reason)
        reasoning, content = self.reasoning.split(c.text) if self.reasoning is not None else (None, c.text)
        items = [] if reasoning is None else [reasoning_item(reasoning)]
        calls = []
        if self.tools.parse_calls and content:
            parsed = parse_tool_calls(content)
            content, calls = parsed.content, parsed.tool_calls
        if content or not calls:
            items.append(message_item(content or "", status))
        items += [function_call_item(call["function"]["name"], call["function"]["arguments"]) for call in calls]
        return items

    def _finish(self, final: RequestOutput, items: list[dict]) -> dict:
        c = final.outputs[0]
        response = self._envelope(_status(c.finish_reason), items, self._usage(final, items))
        if c.finish_reason == "length":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.conversation is not None:
            self.state.responses.put(response, self.conversation + input_messages(items, "output"))
        return response

    def _envelope(self, status: str, output: list[dict], used: dict | None) -> dict:
        return {"id": self.gen.request_id, "object": "response", "created_at": self.gen.created,
                "model": self.state.served_model_name, "status": status, "output": output, "error": None,
                "incomplete_details": None, "usage": used, "background": False, **self.echo}

    def _usage(self, final: RequestOutput, items: list[dict]) -> dict:
        prompt, output = len(final.prompt_token_ids), len(final.outputs[0].token_ids)
        reasoning_tokens = 0
        if items and items[0]["type"] == "reasoning":
            reasoning_tokens = self._reasoning_tokens(final.outputs[0].token_ids)
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": final.metrics.num_cached_tokens},
                "output_tokens": output, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": prompt + output}

    def _reasoning_tokens(self, token_ids: list[int]) -> int:
        """The output tokens up to the end of the reasoning, its tag included (all of them if it never ends)."""
        end, tail = self.reasoning.parser.end, ""
        for n, token in enumerate(token_ids, 1):
            joined = tail + self.state.token_text(token)
            if end in joined:
                return n
            tail = joined[-len(end):]
        return len(token_ids)

    # ---- the stream ------------------------------------------------------------------------------------------
    def opening(self) -> list[dict]:
        shell = self._envelope("in_progress", [], None)
        return self._numbered([{"type": "response.created", "response": shell},
                               {"type": "response.in_progress", "response": shell}])

    def events(self, out: RequestOutput, index: int) -> list[dict]:
        c = out.outputs[0]
        text, text_delta, reasoning_delta, calls = c.text, c.text_delta, "", []
        if self.reasoning is not None:
            reasoning_delta, text, text_delta = self.reasoning.feed(out, index)
        if self.tools.parse_calls:
            text_delta, calls = self.tool_parser.feed(text, final=out.finished)
        events = self.stream.reasoning(reasoning_delta) if reasoning_delta else []
        if text_delta:
            events += self.stream.text(text_delta)
        for delta in calls:
            events += self.stream.tool_call(delta)
        if out.finished:
            if not self.tool_parser.called and not any(i["type"] == "message" for i in self.stream.items):
                events += self.stream.text("")           # a message item, empty, as the whole response has
            events += self.stream.close(_status(c.finish_reason))
        return self._numbered(events)

    def closing(self, finals: list[RequestOutput]) -> list[dict]:
        # response.completed also for a response cut by max_output_tokens (its status says incomplete), as vLLM
        # sends it: the openai SDK's stream helpers finish only on that event.
        return self._numbered([{"type": "response.completed", "response": self._finish(finals[0], self.stream.items)}])

    def _numbered(self, events: list[dict]) -> list[dict]:
        for event in events:
            event["sequence_number"] = self.sequence
            self.sequence += 1
        return events


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"
