"""The hermes tool-call parser on crafted model outputs (a random model never writes tool calls by itself):
whole outputs become OpenAI tool_calls, and streaming the same text in any pieces gives deltas that add up to
the same calls and content (a cut call and a block that is no call included), never leaking a half-written
<tool_call> tag into the content."""
from __future__ import annotations

import json

import pytest

from engine.server.tool_parser import StreamingToolParser, parse_tool_calls

ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>'
TWO = ONE + '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris", "fmt": "{h}:{m}"}}\n</tool_call>'


def calls(text):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parse_tool_calls(text).tool_calls]


def test_one_call_and_no_content():
    parsed = parse_tool_calls(ONE)
    assert parsed.content is None
    assert calls(ONE) == [("get_weather", {"city": "Paris", "days": [1, 2]})]
    call = parsed.tool_calls[0]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")


def test_parallel_calls_and_content_before_them():
    text = "Let me look that up.\n\n" + TWO
    assert parse_tool_calls(text).content == "Let me look that up."
    assert [name for name, _ in calls(text)] == ["get_weather", "get_time"]
    assert calls(text)[1][1] == {"tz": "Europe/Paris", "fmt": "{h}:{m}"}


def test_plain_text_and_blocks_without_a_call_stay_content():
    assert parse_tool_calls("Just text.").tool_calls == []
    for nameless in ('Hm <tool_call>\n{"arguments": {"a": }\n</tool_call>', "<tool_call>not json</tool_call>"):
        assert (parse_tool_calls(nameless).content, parse_tool_calls(nameless).tool_calls) == (nameless, [])
    assert calls('<tool_call>\n{"name": "f", "arguments": {"a": 1}}') == [("f", {"a": 1})]   # cut before the tag


def test_a_named_call_keeps_the_arguments_the_model_wrote_even_cut():
    cut = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {"city": "Par')
    assert cut.content is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in cut.tool_calls] == [("f", '{"city": "Par')]
    broken = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>')
    assert broken.tool_calls[0]["function"]["arguments"] == '{"a": }'


def test_a_finished_call_in_another_key_order_is_read_whole():
    text = '<tool_call>\n{"arguments": {"x": 1}, "name": "g"}\n</tool_call>'
    assert calls(text) == [("g", {"x": 1})]
    assert calls('<tool_call>{"name": "h", "parameters": {"y": [2]}}</tool_call>') == [("h", {"y": [2]})]


def stream(text: str, step: int):
    parser, content, deltas = StreamingToolParser(), "", []
    for end in list(range(step, len(text), step)) + [len(text)]:
        c, d = parser.feed(text[:end], final=end == len(text))
        content += c
        deltas += d
    return content, deltas, parser


def assemble(deltas):
    out = {}
    for d in deltas:
        call = out.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
        if "id" in d:
            assert call["id"] is None, "a call's id and name come once"
            call["id"], call["name"] = d["id"], d["function"]["name"]
        call["arguments"] += d["function"]["arguments"]
    return [out[i] for i in sorted(out)]


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streamed_deltas_add_up_to_the_whole_parse(step):
    text = "Checking.\n" + TWO
    content, deltas, parser = stream(text, step)
    assert content == "Checking."
    got = assemble(deltas)
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == calls(text)
    assert parser.called and all(c["id"].startswith("chatcmpl-tool-") for c in got)
    assert [d["index"] for d in deltas if "id" in d] == [0, 1]


@pytest.mark.parametrize("step", [1, 4])
def test_text_without_calls_streams_whole_including_a_lone_angle_bracket(step):
    text = "a < b and <tool is not a tag"
    content, deltas, parser = stream(text, step)
    assert content == text and deltas == [] and not parser.called


def test_a_partial_tag_is_held_back_until_it_is_known():
    parser = StreamingToolParser()
    assert parser.feed("Hi <tool_c", final=False) == ("Hi", [])
    content, deltas = parser.feed('Hi <tool_call>\n{"name": "f", "argu', final=False)
    assert content == "" and deltas == []
    content, deltas = parser.feed('Hi <tool_call>\n{"name": "f", "arguments": {"x": "}', final=False)
    assert deltas[0]["function"] == {"name": "f", "arguments": ""}
    assert deltas[1]["function"]["arguments"] == '{"x": "}'       # a brace inside a string is not the end


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "f", "arguments": {"city": "Par',                        # cut by max_tokens
    'Hm <tool_call>\n{"arguments": 1\n</tool_call>',                               # no call: all content
    '<tool_call>\n{"arguments": {"x": 1}, "name": "g"}\n</tool_call>\n' + ONE,    # read whole, then streamed
    '<tool_call>junk</tool_call>\n' + ONE,                                         # a call after a block that is none
])
@pytest.mark.parametrize("step", [1, 5, 1000])
def test_streamed_and_whole_parses_agree(text, step):
    content, deltas, _ = stream(text, step)
    whole = parse_tool_calls(text)
    assert (content or None) == (whole.content or None)
    got = assemble(deltas)
    assert [(c["name"], c["arguments"]) for c in got] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls]
    assert [d["index"] for d in deltas if "id" in d] == list(range(len(got)))
