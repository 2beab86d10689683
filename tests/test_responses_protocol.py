"""Responses API input items -> chat messages (engine/server/responses_protocol.py), without a model: the
conversation a chat template then renders, and the 400s for what cannot be honoured."""
from __future__ import annotations

import pytest

from engine.errors import InvalidInputError
from engine.server.protocol import Fields
from engine.server.responses_items import function_call_item, message_item, reasoning_item
from engine.server.responses_protocol import chat_tools, input_messages, text_format


def test_a_string_is_one_user_message():
    assert input_messages("Hi") == [{"role": "user", "content": "Hi"}]


def test_items_become_the_chat_conversation_they_describe():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                        {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Hm."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny at noon."}]},
    ]
    assert input_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Hm.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
        {"role": "assistant", "content": "Sunny at noon."},
    ]


def test_a_responses_own_output_items_continue_the_conversation():
    """What a stored response adds to its conversation: its reasoning and text as one assistant turn."""
    out = [reasoning_item("Think."), message_item("Answer."), function_call_item("f", "{}")]
    [turn] = input_messages(out, "output")
    assert turn["role"] == "assistant" and turn["content"] == "Answer." and turn["reasoning_content"] == "Think."
    assert turn["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    assert turn["tool_calls"][0]["id"] == out[2]["call_id"]


def test_an_image_part_becomes_an_image_url_part():
    [msg] = input_messages([{"role": "user", "content": [{"type": "input_text", "text": "What?"},
                                                         {"type": "input_image", "image_url": "data:image/png;base64,AA",
                                                          "detail": "auto"}]}])
    assert msg["content"] == [{"type": "text", "text": "What?"},
                              {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]


@pytest.mark.parametrize("items, param", [
    ([{"role": "tool", "content": "x"}], "input[0].role"),
    ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id"),
    ([{"type": "web_search_call", "id": "ws_1"}], "input[0].type"),
    ([{"role": "user", "content": 3}], "input[0].content"),
    ([{"type": "function_call_output", "call_id": "c", "output": {"a": 1}}], "input[0].output"),
    ("", None),
])
def test_malformed_items_are_refused_naming_the_place(items, param):
    with pytest.raises(InvalidInputError) as err:
        input_messages(items if items != "" else [])
    assert err.value.param == (param or "input")


def test_function_tools_take_the_chat_shape():
    f = chat_tools(Fields({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"},
                                      "strict": True}],
                           "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": False}))
    assert f.body == {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                      "tool_choice": {"type": "function", "function": {"name": "f"}}, "parallel_tool_calls": False}


def test_text_format_gives_the_constraint():
    assert text_format(Fields({}))[1] is None
    assert text_format(Fields({"text": {"format": {"type": "json_object"}}}))[1].json_object
    schema = {"type": "object"}
    fmt, so = text_format(Fields({"text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}))
    assert so.json == schema and fmt["name"] == "x"
