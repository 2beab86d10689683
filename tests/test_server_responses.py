"""/v1/responses through the openai SDK itself (responses.create / stream / parse / retrieve / delete), against
the engine and through the proxy: tiny random Qwen3-VL with Qwen's own template, --enable-auto-tool-choice
--tool-call-parser hermes. A Response runs the chat path, so greedy answers must equal the chat API's for the
same conversation, token for token; tool calls and JSON are forced by constrained decoding, so they always
parse even from a random model."""
from __future__ import annotations

import base64
import io
import json
import signal

import jsonschema
import openai
import pydantic
import pytest
from PIL import Image

from engine.server.response_store import ResponseStore
from engine_server import http, start_engine_server
from servers import start_proxy

SERVED = "tiny-vl"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                          "required": ["city"], "additionalProperties": False}}
GREEDY = dict(model=SERVED, temperature=0, max_output_tokens=12)


@pytest.fixture(scope="module")
def engine(qwen3_vl_dir, tmp_path_factory):
    srv = start_engine_server(qwen3_vl_dir, tmp_path_factory.mktemp("engine-responses"),
                              "--enable-auto-tool-choice", "--tool-call-parser", "hermes", served_name=SERVED)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def proxy(engine, tmp_path_factory):
    srv = start_proxy(engine.url, tmp_path_factory.mktemp("proxy-responses"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(engine):
    return openai.OpenAI(base_url=engine.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module", params=["engine", "proxy"])
def any_client(request, engine, proxy):
    """The same tests straight at the engine and through the proxy."""
    url = (engine if request.param == "engine" else proxy).url
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def chat(client, messages, **extra):
    return client.chat.completions.create(model=SERVED, messages=messages, temperature=0, max_tokens=12, **extra)


def test_a_response_answers_as_the_chat_api_does_for_the_same_conversation(any_client):
    reply = any_client.responses.create(input="What is the capital of France?", instructions="Be brief.", **GREEDY)
    same = chat(any_client, [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "What is the capital of France?"}])
    assert reply.object == "response" and reply.id.startswith("resp_")
    assert [item.type for item in reply.output] == ["message"]
    assert reply.output_text == same.choices[0].message.content
    assert reply.usage.input_tokens == same.usage.prompt_tokens
    assert reply.usage.output_tokens == same.usage.completion_tokens
    assert reply.status == ("incomplete" if same.choices[0].finish_reason == "length" else "completed")
    if reply.status == "incomplete":
        assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.instructions == "Be brief." and reply.max_output_tokens == 12 and reply.temperature == 0


def test_a_streamed_response_sends_the_events_in_order_and_ends_as_the_whole_one(any_client):
    whole = any_client.responses.create(input="Say hello.", **GREEDY)
    with any_client.responses.stream(input="Say hello.", **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.status == whole.status


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    population: int


@pytest.mark.parametrize("streamed", [False, True])
def test_parse_returns_the_schema_typed_output(any_client, streamed):
    ask = dict(model=SERVED, input="A city as JSON.", text_format=City, temperature=1.0, max_output_tokens=200,
               extra_body={"seed": 1})
    if streamed:
        with any_client.responses.stream(**ask) as stream:
            reply = stream.get_final_response()
    else:
        reply = any_client.responses.parse(**ask)
    assert reply.status == "completed"
    assert isinstance(reply.output_parsed, City)
    assert reply.text.format.type == "json_schema"


def test_json_object_format_gives_json(client):
    reply = client.responses.create(model=SERVED, input="JSON please", text={"format": {"type": "json_object"}},
                                    max_output_tokens=300, temperature=1.0, extra_body={"seed": 0})
    assert reply.status == "completed"
    assert isinstance(json.loads(reply.output_text), dict)


@pytest.mark.parametrize("streamed", [False, True])
def test_a_required_tool_choice_returns_function_calls_with_valid_arguments(any_client, streamed):
    ask = dict(model=SERVED, input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
               temperature=1.0, max_output_tokens=300, extra_body={"seed": 2})
    if streamed:
        with any_client.responses.stream(**ask) as stream:
            events = list(stream)
            reply = stream.get_final_response()
        args = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert [a.arguments for a in args] == [i.arguments for i in reply.output if i.type == "function_call"]
    else:
        reply = any_client.responses.create(**ask)
    calls = [item for item in reply.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.call_id.startswith("call_") for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_a_named_tool_choice_calls_that_tool(client):
    reply = client.responses.create(model=SERVED, input="Weather?", tools=[WEATHER], max_output_tokens=300,
                                    tool_choice={"type": "function", "name": "get_weather"})
    assert [item.type for item in reply.output] == ["function_call"]


def function_calls(output) -> list[tuple[str, str]]:
    return [(item.name, item.arguments) for item in output if item.type == "function_call"]


def test_a_function_call_cut_by_max_output_tokens_is_the_same_streamed_or_not(client):
    ask = dict(model=SERVED, input="Weather?", tools=[WEATHER], temperature=1.0, extra_body={"seed": 7},
               tool_choice={"type": "function", "name": "get_weather"})
    full = client.responses.create(max_output_tokens=300, **ask)
    (name, arguments), = function_calls(full.output)
    cuts_inside_the_arguments = 0
    for limit in range(1, full.usage.output_tokens, max(1, full.usage.output_tokens // 8)):
        whole = client.responses.create(max_output_tokens=limit, **ask)
        with client.responses.stream(max_output_tokens=limit, **ask) as stream:
            events = list(stream)
            streamed = stream.get_final_response()
        assert whole.status == streamed.status == "incomplete"
        assert function_calls(streamed.output) == function_calls(whole.output)
        assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == \
            [a for _, a in function_calls(whole.output)]
        calls = function_calls(whole.output)
        if calls and calls[0][1]:
            # The arguments written so far (a character the cut split is U+FFFD in both).
            assert calls[0][0] == name and arguments.startswith(calls[0][1].rstrip("\ufffd"))
            cuts_inside_the_arguments += 1
    assert cuts_inside_the_arguments


def test_previous_response_id_continues_the_stored_conversation(client):
    first = client.responses.create(input="Hi there.", instructions="Be brief.", **GREEDY)
    second = client.responses.create(input="And then?", previous_response_id=first.id, **GREEDY)
    same = chat(client, [{"role": "user", "content": "Hi there."},
                         {"role": "assistant", "content": first.output_text},
                         {"role": "user", "content": "And then?"}])   # instructions are not carried over
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == same.usage.prompt_tokens
    assert second.output_text == same.choices[0].message.content


def test_function_call_outputs_continue_a_tool_call(client):
    first = client.responses.create(model=SERVED, input="Weather in Paris?", tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=300)
    call = next(item for item in first.output if item.type == "function_call")
    result = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    chained = client.responses.create(input=result, previous_response_id=first.id, tools=[WEATHER],
                                      tool_choice="none", **GREEDY)
    # The same conversation sent whole, as input items (what clients that do not store responses send).
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             *result]
    whole = client.responses.create(input=items, tools=[WEATHER], tool_choice="none", store=False, **GREEDY)
    same = chat(client, [{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": "", "tool_calls": [
                             {"id": call.call_id, "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}}]},
                         {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}],
                tools=[{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description",
                                                                                   "parameters")}}],
                tool_choice="none")
    assert chained.usage.input_tokens == whole.usage.input_tokens == same.usage.prompt_tokens
    assert chained.output_text == whole.output_text == same.choices[0].message.content


def test_stored_responses_can_be_read_and_deleted_and_store_false_keeps_nothing(any_client):
    kept = any_client.responses.create(input="Hi", **GREEDY)
    assert any_client.responses.retrieve(kept.id).output_text == kept.output_text
    any_client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        any_client.responses.retrieve(kept.id)
    gone = any_client.responses.create(input="Hi", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError, match="store: false"):
        any_client.responses.create(input="More", previous_response_id=gone.id, **GREEDY)


def test_an_image_goes_in_as_input_image(client):
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    content = [{"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": url}]
    reply = client.responses.create(input=[{"role": "user", "content": content}], **GREEDY)
    same = chat(client, [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                      {"type": "image_url", "image_url": {"url": url}}]}])
    assert reply.usage.input_tokens == same.usage.prompt_tokens
    assert reply.output_text == same.choices[0].message.content


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "input[0].content[0].image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_data": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
    ({"input": []}, "input"),
    ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
])
def test_what_cannot_be_honoured_is_a_clear_4xx_naming_the_field(engine, body, param):
    reply = http("POST", engine.url + "/v1/responses", {"model": SERVED, **body})
    assert reply.status in (400, 404), reply.text
    assert reply.json()["error"]["param"] == param


def test_the_store_keeps_within_its_count_and_bytes():
    store = ResponseStore(max_count=3, max_bytes=2000)
    for i in range(5):
        store.put({"id": f"resp_{i}"}, [{"role": "user", "content": "x" * 100}])
    assert len(store) == 3
    with pytest.raises(Exception, match="dropped"):
        store.get("resp_0")
    store.get("resp_2")                                   # read: it becomes the newest
    store.put({"id": "resp_big"}, [{"role": "user", "content": "y" * 1200}])
    assert store.bytes <= 2000
    store.get("resp_2")
    with pytest.raises(Exception):
        store.get("resp_3")
    store.put({"id": "resp_huge"}, [{"role": "user", "content": "z" * 3000}])   # larger than the store
    with pytest.raises(Exception):
        store.get("resp_huge")


def test_an_openai_agents_sdk_turn_calls_the_tool_and_answers(engine):
    """One agent turn through the OpenAI Agents SDK on the Responses API: the first model call must call the tool
    (tool_choice required, forced by the grammar), the SDK runs it and sends its output back, and the second call
    (tool_choice reset to auto by the SDK, as after any tool use) answers in the agent's output type, whose
    schema (text.format) makes the random model's answer end."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    model = agents.OpenAIResponsesModel(model=SERVED, openai_client=openai.AsyncOpenAI(
        base_url=engine.url + "/v1", api_key="none", max_retries=0, timeout=120))
    class Answer(pydantic.BaseModel):
        summary: str = pydantic.Field(max_length=20)

    agent = agents.Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather], model=model,
                         output_type=Answer,
                         model_settings=agents.ModelSettings(tool_choice="required", temperature=1.0,
                                                             max_tokens=300, parallel_tool_calls=False,
                                                             extra_body={"seed": 3}))
    result = agents.Runner.run_sync(agent, "Weather in Paris?", max_turns=3)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert kinds[-1] == "message_output_item"
    assert len(calls) == 1 and isinstance(calls[0], str)
    assert result.new_items[1].output == f"sunny in {calls[0]}"
    assert isinstance(result.final_output, Answer)


def test_a_stream_cut_by_the_server_stopping_ends_with_an_error_event(qwen3_vl_dir, tmp_path):
    """SIGTERM while a long Response streams: past the grace period the stream's last event is `error` (which the
    openai SDK raises), not a cut connection and not [DONE]."""
    srv = start_engine_server(qwen3_vl_dir, tmp_path, served_name=SERVED)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        stream = client.responses.create(model=SERVED, input="Count.", max_output_tokens=1900, stream=True,
                                         extra_body={"ignore_eos": True})
        seen = []
        with pytest.raises(openai.APIError, match="shutting down"):
            for event in stream:
                seen.append(event.type)
                if seen.count("response.output_text.delta") == 2:
                    srv.proc.send_signal(signal.SIGTERM)
        assert seen[:2] == ["response.created", "response.in_progress"] and "response.completed" not in seen
        assert srv.proc.wait(20) == 0
    finally:
        srv.stop()
