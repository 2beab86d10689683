"""--reasoning-parser qwen3 end to end: the tiny Qwen3 and Qwen3-VL built with a Thinking template (the generation
prompt opens `<think>`) answer with `reasoning_content` and `content` separated exactly at `</think>`, in a
message and in stream deltas, in chat and in the Responses API.

The random models write random tokens; to make the split checkable, the output is drawn from a few plain-text
tokens plus `</think>` (allowed_token_ids), with a logit bias that makes `</think>` come early but not first.
The raw output is read back from the chosen tokens (logprobs), so each test knows the exact text the model
wrote and where the split must fall."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from engine_server import http, start_engine_server

SERVED = "tiny-thinking"
WORDS = ["The", " capital", " of", " France", " is", " Paris", "."]
USER = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module", params=["qwen3", "qwen3-vl"])
def server(request, qwen3_thinking_dir, qwen3_vl_thinking_dir, tmp_path_factory):
    model = qwen3_thinking_dir if request.param == "qwen3" else qwen3_vl_thinking_dir
    srv = start_engine_server(model, tmp_path_factory.mktemp("engine-reasoning"), "--reasoning-parser", "qwen3",
                              "--enable-auto-tool-choice", "--tool-call-parser", "hermes", served_name=SERVED)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def token_ids(server, text: str) -> list[int]:
    reply = http("POST", server.url + "/tokenize", {"model": SERVED, "prompt": text, "add_special_tokens": False})
    assert reply.status == 200, reply.text
    return reply.json()["tokens"]


@pytest.fixture(scope="module")
def forcing(server):
    """Sampling that writes plain words and, after a few of them, `</think>` (a single token, as in Qwen3)."""
    end = token_ids(server, "</think>")
    assert len(end) == 1
    words = sorted({t for w in WORDS for t in token_ids(server, w)})
    return dict(temperature=1.0, max_tokens=16, logprobs=True,
                extra_body={"allowed_token_ids": words + end, "logit_bias": {str(end[0]): 2.5}})


def raw_text(choice) -> str:
    return "".join(entry.token for entry in choice.logprobs.content)


def split_runs(client, forcing, seeds=range(12)):
    """(seed, the raw output, the reply) of the seeds whose output thinks a little and then answers."""
    runs = []
    for seed in seeds:
        reply = client.chat.completions.create(model=SERVED, messages=USER, seed=seed, **forcing)
        raw = raw_text(reply.choices[0])
        if not raw.startswith("</think>") and "</think>" in raw:
            runs.append((seed, raw, reply))
    assert runs, "no seed wrote reasoning before </think>; loosen the logit bias"
    return runs


def test_a_message_splits_reasoning_and_content_exactly_at_the_end_tag(client, forcing):
    for _, raw, reply in split_runs(client, forcing):
        message = reply.choices[0].message
        reasoning, _, content = raw.partition("</think>")
        assert message.reasoning_content == reasoning      # the prompt opened <think>: no tag in the output
        assert message.content == (content or None)


def test_an_output_cut_inside_its_reasoning_is_all_reasoning(client, forcing):
    reply = client.chat.completions.create(model=SERVED, messages=USER, seed=0,
                                           **{**forcing, "extra_body": {"allowed_token_ids": forcing["extra_body"][
                                               "allowed_token_ids"][:-1]}})
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.reasoning_content == raw_text(reply.choices[0])
    assert reply.choices[0].message.content is None


def test_streamed_deltas_carry_the_same_split(client, forcing):
    for seed, raw, reply in split_runs(client, forcing, seeds=range(6)):
        reasoning, content, raw_streamed = [], [], []
        for chunk in client.chat.completions.create(model=SERVED, messages=USER, seed=seed, stream=True,
                                                    **forcing):
            delta = chunk.choices[0].delta
            reasoning.append(getattr(delta, "reasoning_content", None) or "")
            content.append(delta.content or "")
            raw_streamed += [entry.token for entry in (chunk.choices[0].logprobs.content or [])] \
                if chunk.choices[0].logprobs else []
        assert "".join(raw_streamed) == raw
        assert "".join(reasoning) == reply.choices[0].message.reasoning_content
        assert "".join(content) == (reply.choices[0].message.content or "")
        assert not any("</" in piece for piece in reasoning)       # no piece of the tag leaks into reasoning


def test_enable_thinking_false_splits_nothing(client, forcing):
    reply = client.chat.completions.create(model=SERVED, messages=USER, seed=3,
                                           **{**forcing, "extra_body": {**forcing["extra_body"], "chat_template_kwargs":
                                                                        {"enable_thinking": False}}})
    message = reply.choices[0].message
    assert message.content == raw_text(reply.choices[0])
    assert getattr(message, "reasoning_content", None) is None


SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}


def test_structured_output_applies_after_the_reasoning(client, server):
    end = token_ids(server, "</think>")[0]
    reply = client.chat.completions.create(
        model=SERVED, messages=USER, temperature=1.0, seed=1, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
        extra_body={"logit_bias": {str(end): 6.0}})
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "stop"
    assert message.reasoning_content is not None and "</think>" not in message.reasoning_content
    jsonschema.validate(json.loads(message.content), SCHEMA)


def test_a_forced_tool_call_comes_after_the_reasoning(client, server):
    end = token_ids(server, "</think>")[0]
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}}}
    reply = client.chat.completions.create(model=SERVED, messages=USER, tools=[tool], tool_choice="required",
                                           parallel_tool_calls=False,
                                           temperature=1.0, seed=2, max_tokens=200,
                                           extra_body={"logit_bias": {str(end): 6.0}})
    message = reply.choices[0].message
    assert message.reasoning_content is not None
    assert [c.function.name for c in message.tool_calls] and all(
        json.loads(c.function.arguments)["city"] in ("Paris", "Rome") for c in message.tool_calls)


def test_a_response_has_a_reasoning_item_before_its_message(client, forcing):
    seed, raw, _ = split_runs(client, forcing, seeds=range(6))[0]
    extra = {k: v for k, v in forcing["extra_body"].items()}
    ask = dict(model=SERVED, input=USER[0]["content"], temperature=1.0, max_output_tokens=16, extra_body={
        **extra, "seed": seed})
    reasoning, _, content = raw.partition("</think>")
    reply = client.responses.create(**ask)
    assert [item.type for item in reply.output] == ["reasoning", "message"]
    assert reply.output[0].content[0].text == reasoning
    assert reply.output_text == content
    assert 0 < reply.usage.output_tokens_details.reasoning_tokens < reply.usage.output_tokens
    with client.responses.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == content
    assert [item.type for item in final.output] == ["reasoning", "message"]


def test_a_stream_opens_with_the_role_alone_and_reasoning_deltas_carry_no_content(server, client, forcing):
    seed, _, reply = split_runs(client, forcing, seeds=range(6))[0]
    body = {"model": SERVED, "messages": USER, "seed": seed, "stream": True,
            **{k: v for k, v in forcing.items() if k not in ("extra_body", "logprobs")}, **forcing["extra_body"]}
    answer = http("POST", server.url + "/v1/chat/completions", body)
    assert answer.status == 200, answer.text
    events = [line[len("data: "):] for line in answer.text.splitlines() if line.startswith("data: ")]
    deltas = [json.loads(e)["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert all("role" not in d for d in deltas[1:])
    thinking = [d for d in deltas if "reasoning_content" in d]
    assert thinking and all("content" not in d for d in thinking)
    assert "".join(d["reasoning_content"] for d in thinking) == reply.choices[0].message.reasoning_content
    assert "".join(d.get("content", "") for d in deltas) == (reply.choices[0].message.content or "")
