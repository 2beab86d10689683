"""Tool calls and tool results through a chat template that does not know tools (SmolLM2's, the embedded demo
model's): an assistant turn whose content is null or left out renders (as vLLM normalises it), its calls are
written as hermes <tool_call> blocks, tool results as a user turn of <tool_response> blocks, the tools are listed
in the system turn, and the server says once that it rewrites. A template with tool support gets the messages as
they are."""
from __future__ import annotations

import pytest

from engine.inputs import tool_text
from engine.inputs.chat_template import ChatTemplate
from test_inputs_processor import make_processor

# SmolLM2-135M-Instruct's template, verbatim: it concatenates message['content'], so a missing content fails.
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>"
           "system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
           "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CALL = {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


@pytest.fixture(scope="module")
def smol(qwen3_dir):
    proc = make_processor(qwen3_dir)
    proc.chat_template = ChatTemplate(SMOLLM2)
    return proc


@pytest.mark.parametrize("assistant", [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                                       {"role": "assistant", "tool_calls": [CALL]}])
def test_tool_calls_and_results_render_as_hermes_text(smol, assistant, engine_log):
    tool_text._say_once.cache_clear()
    messages = [{"role": "user", "content": "Weather?"}, assistant,
                {"role": "tool", "tool_call_id": "call-1", "content": "18C"},
                {"role": "tool", "tool_call_id": "call-2", "content": "sunny"}]
    prompt = smol.process_chat(messages, tools=[WEATHER]).prompt
    assert prompt.startswith('<|im_start|>system\n# Tools\n')
    assert '\n<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    assert prompt.endswith(
        '<|im_start|>user\nWeather?<|im_end|>\n'
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>'
        '<|im_end|>\n<|im_start|>assistant\n')
    assert [r.getMessage() for r in engine_log.records].count(
        "chat template has no tool support; rendering tool calls as text") == 1
    smol.process_chat(messages, tools=[WEATHER])
    assert [r.getMessage() for r in engine_log.records].count(
        "chat template has no tool support; rendering tool calls as text") == 1     # once per process


def test_text_before_the_calls_and_an_existing_system_turn_are_kept(smol):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "Looking.", "tool_calls": [CALL]}]
    prompt = smol.process_chat(messages, tools=[WEATHER], add_generation_prompt=False).prompt
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert prompt.endswith('<|im_start|>assistant\nLooking.\n<tool_call>\n{"name": "get_weather", "arguments": '
                           '{"city": "Paris"}}\n</tool_call><|im_end|>\n')


def test_a_chat_without_tools_is_rendered_as_it_is(smol):
    prompt = smol.process_chat([{"role": "user", "content": "Hi"}]).prompt
    assert prompt == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                      "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_with_tool_support_gets_the_calls_themselves(vl_template_processor):
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "tool_calls": [CALL]},
                {"role": "tool", "content": "18C"}]
    prompt = vl_template_processor.process_chat(messages, tools=[WEATHER]).prompt
    # Qwen's template writes the calls itself (arguments as an object reach it), and the tools its own way.
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>" in prompt


@pytest.fixture(scope="module")
def vl_template_processor(qwen3_vl_dir):
    return make_processor(qwen3_vl_dir)


def test_only_an_assistant_message_may_leave_content_out(smol):
    with pytest.raises(Exception, match=r"messages\[0\].content is required") as info:
        smol.process_chat([{"role": "user", "content": None}])
    assert info.value.param == "messages[0].content"
