"""Tool calling and structured output over HTTP, through the `openai` SDK and raw requests, against a real engine
(tiny random Qwen3-VL with Qwen's own chat template, started with --enable-auto-tool-choice --tool-call-parser
hermes). The random model never calls a tool or writes JSON by itself: "required" and named tool choices, JSON
schemas, regexes and choices are enforced by constrained decoding, so every output here must parse and
validate, even sampled at temperature 1.0."""
from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest
from transformers import AutoTokenizer

from engine.inputs.chat_template import ChatTemplate
from engine.inputs.tool_text import tools_as_text
from engine_server import http, start_engine_server
from test_inputs_tool_text import SMOLLM2

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 23}},
                                       "required": ["hour"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
SERVED = "tiny-vl"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(qwen3_vl_dir, tmp_path_factory):
    srv = start_engine_server(qwen3_vl_dir, tmp_path_factory.mktemp("engine-tools"), "--enable-auto-tool-choice",
                              "--tool-call-parser", "hermes", served_name=SERVED)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def assert_valid_calls(tool_calls, names=None):
    assert tool_calls
    for call in tool_calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", range(3))
def test_required_tool_choice_always_calls_a_tool(client, seed):
    reply = client.chat.completions.create(model=SERVED, messages=USER, tools=TOOLS, tool_choice="required",
                                           temperature=1.0, seed=seed, max_tokens=300)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.content is None
    assert_valid_calls(choice.message.tool_calls, {"get_weather", "get_time"})


def test_named_tool_choice_calls_that_function_once(client):
    reply = client.chat.completions.create(
        model=SERVED, messages=USER, tools=TOOLS, temperature=1.0, seed=7, max_tokens=300,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"          # OpenAI's finish for a forced function
    assert len(choice.message.tool_calls) == 1
    assert_valid_calls(choice.message.tool_calls, {"get_time"})


def test_streamed_tool_calls_arrive_as_openai_deltas(client):
    kwargs = dict(model=SERVED, messages=USER, tools=TOOLS, tool_choice="required", temperature=1.0, seed=3,
                  max_tokens=300)
    whole = client.chat.completions.create(**kwargs).choices[0].message
    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert not delta.content
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:
                assert call["id"] is None
                call["id"], call["name"] = d.id, d.function.name
            call["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls]


def streamed_calls(client, **kwargs) -> tuple[list[tuple[str, str]], str | None]:
    """A streamed reply's tool calls as (name, arguments) added up from the deltas, and its finish reason."""
    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, ["", ""])
                call[0] += (d.function.name or "") if d.id else ""
                call[1] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return [tuple(calls[i]) for i in sorted(calls)], finish


def test_a_named_call_cut_by_max_tokens_is_the_same_streamed_or_not(client):
    kwargs = dict(model=SERVED, messages=USER, tools=TOOLS, temperature=1.0, seed=7,
                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    tokens = [t.token for t in client.chat.completions.create(
        max_tokens=300, logprobs=True, **kwargs).choices[0].logprobs.content]
    arguments = re.compile(r'"arguments"\s*:\s*\S')          # the random model pads JSON with whitespace
    cut = next(i for i in range(len(tokens)) if arguments.search("".join(tokens[:i]))) + 1   # inside the arguments
    written = "".join(tokens[:cut])
    whole = client.chat.completions.create(max_tokens=cut, **kwargs).choices[0]
    assert whole.finish_reason == "length"
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == \
        [("get_time", written[arguments.search(written).end() - 1:])]
    assert streamed_calls(client, max_tokens=cut, **kwargs) == \
        ([(c.function.name, c.function.arguments) for c in whole.message.tool_calls], "length")


def test_auto_and_none_tool_choice_answer(client):
    for choice in ("auto", "none"):
        reply = client.chat.completions.create(model=SERVED, messages=USER, tools=TOOLS, tool_choice=choice,
                                               max_tokens=8, temperature=0)
        assert reply.choices[0].finish_reason in ("stop", "length")


def test_a_full_tool_round_trip_renders_through_the_models_template(client, qwen3_vl_dir):
    first = client.chat.completions.create(model=SERVED, messages=USER, tools=TOOLS, tool_choice="required",
                                           temperature=1.0, seed=1, max_tokens=300).choices[0].message
    history = USER + [first.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temp": 21})} for c in first.tool_calls]
    reply = client.chat.completions.create(model=SERVED, messages=history, tools=TOOLS, max_tokens=4, temperature=0)
    # The prompt is the template's rendering of the whole history, as transformers renders it.
    tok = AutoTokenizer.from_pretrained(qwen3_vl_dir)
    as_template_sees = USER + [{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}}
        for c in first.tool_calls]}] + history[2:]
    expected = tok.apply_chat_template(as_template_sees, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<tool_response>" in expected and "<tool_call>" in expected
    assert reply.usage.prompt_tokens == len(tok(expected, add_special_tokens=False).input_ids)


def test_a_tool_round_trip_with_null_content_through_a_template_without_tool_support(client, qwen3_vl_dir):
    first = client.chat.completions.create(model=SERVED, messages=USER, tools=TOOLS, tool_choice="required",
                                           temperature=1.0, seed=2, max_tokens=300).choices[0].message
    assert first.content is None
    # What the openai SDK and LangChain send back: the assistant message with "content": null.
    history = USER + [first.model_dump()] + [
        {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temp": 21})} for c in first.tool_calls]
    reply = client.chat.completions.create(model=SERVED, messages=history, tools=TOOLS, max_tokens=4, temperature=0,
                                           extra_body={"chat_template": SMOLLM2})
    tok = AutoTokenizer.from_pretrained(qwen3_vl_dir)
    rendered = tools_as_text([USER[0], {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}}
        for c in first.tool_calls]}, *history[2:]], TOOLS)
    expected = ChatTemplate(SMOLLM2).render(rendered)
    assert "<tool_call>" in expected and "<tool_response>" in expected
    assert reply.usage.prompt_tokens == len(tok(expected, add_special_tokens=False).input_ids)


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    kind: Literal["cat", "dog"]
    age: int = pydantic.Field(ge=0, le=30)


@pytest.mark.parametrize("seed", range(2))
def test_parse_with_a_pydantic_model(client, seed):
    reply = client.chat.completions.parse(model=SERVED, messages=[{"role": "user", "content": "A pet?"}],
                                          response_format=Pet, temperature=1.0, seed=seed, max_tokens=300)
    assert isinstance(reply.choices[0].message.parsed, Pet)


def test_json_object_regex_and_choice(client):
    def ask(**extra):
        return client.chat.completions.create(model=SERVED, messages=USER, temperature=1.0, seed=5, max_tokens=300,
                                              **extra).choices[0].message.content
    assert isinstance(json.loads(ask(response_format={"type": "json_object"})), dict)
    assert re.fullmatch(r"\d{3}-[a-z]{2}", ask(extra_body={"structured_outputs": {"regex": r"\d{3}-[a-z]{2}"}}))
    assert ask(extra_body={"guided_choice": ["north", "south"]}) in ("north", "south")
    assert ask(extra_body={"structured_outputs": {"choice": ["up", "down"]}}) in ("up", "down")


def test_streamed_json_schema_output_validates(client):
    schema = Pet.model_json_schema()
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=SERVED, messages=USER, stream=True, temperature=1.0, seed=11, max_tokens=300,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}}))
    jsonschema.validate(json.loads(text), schema)


def test_completions_take_structured_outputs(server):
    reply = http("POST", server.url + "/v1/completions", {
        "prompt": "The answer:", "max_tokens": 50, "temperature": 1.0, "seed": 2,
        "structured_outputs": {"regex": "(yes|no), [0-9]{2}"}})
    assert reply.status == 200, reply.text
    assert re.fullmatch(r"(yes|no), [0-9]{2}", reply.json()["choices"][0]["text"])


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs"),
    ({"guided_regex": "[z-a]"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "start: nothing_defined"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_invalid_constraints_and_tools_are_400_naming_the_field(server, body, param):
    reply = http("POST", server.url + "/v1/chat/completions", {"messages": USER, "max_tokens": 5, **body})
    assert reply.status == 400, reply.text
    err = reply.json()["error"]
    assert err["param"] == param or err["param"].startswith(param + "."), err
