"""ChatTemplate renders a model's chat template exactly as transformers' apply_chat_template(tokenize=False) does,
inside a jinja2 sandbox, and turns template failures into InvalidInputError."""
from __future__ import annotations

import json

import pytest
from PIL import Image
from transformers import AutoTokenizer

from engine.errors import InvalidInputError, ModelLoadError
from engine.inputs.chat_template import ChatTemplate, load_chat_template
from engine.inputs.tokenizer import load_tokenizer

IMAGE = Image.new("RGB", (40, 30), (200, 10, 10))
PNG_URL = "data:image/png;base64,iVBORw0KGgo="  # never decoded: templates only see that an image is there

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city <b>now</b> & later, café",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

QWEN3_VL_CONVERSATIONS = {
    "one user string": [{"role": "user", "content": "Hello!"}],
    "system string": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    "system as parts": [
        {"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    "multi-turn": [
        {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"}],
    "assistant turn as parts": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "there"}]},
        {"role": "user", "content": "Bye"}],
    "several images": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": PNG_URL}}, {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": PNG_URL}, {"type": "image", "image": IMAGE},
        {"type": "text", "text": "Compare these."}]}],
    "image in an earlier turn": [
        {"role": "user", "content": [{"type": "image", "image": IMAGE}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "A red square."},
        {"role": "user", "content": [{"type": "text", "text": "Which shade?"}]}],
    "tool calls and results": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
        {"role": "tool", "content": "18C"},
        {"role": "tool", "content": [{"type": "text", "text": "21C"}]},
        {"role": "assistant", "content": "Paris 18C, Rome 21C."}],
    "unicode and markup": [{"role": "user", "content": "日本語 🙂 <b>bold</b> & \"quotes\"\n\nnew para"}],
}


@pytest.fixture(scope="module")
def qwen3_vl_tokenizer(qwen3_vl_dir):
    return AutoTokenizer.from_pretrained(qwen3_vl_dir)


@pytest.fixture(scope="module")
def qwen3_vl_template(qwen3_vl_dir, qwen3_vl_tokenizer):
    return load_chat_template(qwen3_vl_dir, qwen3_vl_tokenizer)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf):
    return load_tokenizer(smollm2_gguf)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(QWEN3_VL_CONVERSATIONS))
def test_qwen3_vl_template_renders_like_transformers(qwen3_vl_template, qwen3_vl_tokenizer, name,
                                                      add_generation_prompt):
    messages = QWEN3_VL_CONVERSATIONS[name]
    expected = qwen3_vl_tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
    assert qwen3_vl_template.render(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.parametrize("name", ["one user string", "system string", "tool calls and results"])
def test_qwen3_vl_template_renders_tools_like_transformers(qwen3_vl_template, qwen3_vl_tokenizer, name):
    messages = QWEN3_VL_CONVERSATIONS[name]
    expected = qwen3_vl_tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                                      add_generation_prompt=True)
    rendered = qwen3_vl_template.render(messages, add_generation_prompt=True, tools=TOOLS)
    assert rendered == expected
    assert "<b>now</b> & later, café" in rendered  # tojson neither HTML-escapes nor ASCII-escapes


def test_template_kwargs_reach_the_template(qwen3_vl_template, qwen3_vl_tokenizer):
    messages = QWEN3_VL_CONVERSATIONS["several images"]
    expected = qwen3_vl_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                      add_vision_id=True)
    rendered = qwen3_vl_template.render(messages, add_generation_prompt=True, add_vision_id=True)
    assert rendered == expected and "Picture 3: " in rendered


def test_the_reference_template_file_is_the_one_loaded(qwen3_vl_dir, qwen3_vl_template):
    assert qwen3_vl_template.source == (qwen3_vl_dir / "chat_template.jinja").read_text()


SMOLLM2_CONVERSATIONS = {
    "default system prompt": [{"role": "user", "content": "What is the capital of France?"}],
    "own system prompt": [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}],
    "multi-turn": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 🙂"},
                   {"role": "user", "content": "Bye"}],
}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(SMOLLM2_CONVERSATIONS))
def test_gguf_template_renders_like_transformers(smollm2_gguf, smollm2_tokenizer, name, add_generation_prompt):
    template = load_chat_template(smollm2_gguf, smollm2_tokenizer)
    messages = SMOLLM2_CONVERSATIONS[name]
    expected = smollm2_tokenizer.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=add_generation_prompt)
    assert template.render(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.parametrize("source, content_format", [
    ("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
])
def test_content_format_says_whether_the_template_loops_over_content_parts(source, content_format):
    assert ChatTemplate(source).content_format == content_format


def test_content_format_of_the_shipped_templates(qwen3_vl_template, smollm2_gguf, smollm2_tokenizer):
    assert qwen3_vl_template.content_format == "openai"
    assert load_chat_template(smollm2_gguf, smollm2_tokenizer).content_format == "string"


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ messages.append(1) }}",                          # immutable sandbox: inputs cannot be mutated
    "{% set ns = namespace(_private=1) %}",              # transformers' namespace() refuses underscore names
])
def test_sandbox_blocks_escapes_with_invalid_input_error(source):
    with pytest.raises(InvalidInputError, match="unsafe|underscore"):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])


def test_raise_exception_becomes_invalid_input_error_with_the_templates_message():
    template = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('Roles must alternate') }}"
                            "{% endif %}")
    with pytest.raises(InvalidInputError, match="Roles must alternate") as info:
        template.render([{"role": "assistant", "content": "hi"}])
    assert info.value.param == "messages"


def test_a_python_error_inside_the_template_becomes_invalid_input_error():
    template = ChatTemplate("{% for m in messages %}{{ m.role + m.content }}{% endfor %}")  # str + list
    with pytest.raises(InvalidInputError, match="could not render"):
        template.render([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])


def test_a_template_that_does_not_compile_is_a_model_load_error():
    with pytest.raises(ModelLoadError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_objects_reach_the_template_only_as_inert_placeholders():
    template = ChatTemplate("{{ messages[0].content[0].image }}")
    assert template.render([{"role": "user", "content": [{"type": "image", "image": IMAGE}]}]) == "<Image>"


def test_none_valued_keys_are_dropped_as_transformers_does():
    template = ChatTemplate("{{ 'content' in messages[0] }}")
    assert template.render([{"role": "assistant", "content": None}]) == "False"


def test_strftime_now_and_tojson_are_available():
    rendered = ChatTemplate("{{ strftime_now('%Y') }} {{ {'a': 'é<'} | tojson }}").render([])
    year, payload = rendered.split(" ", 1)
    assert year.isdigit() and json.loads(payload) == {"a": "é<"} and "é<" in payload


def test_special_tokens_are_visible_as_apply_chat_template_makes_them(qwen3_vl_tokenizer, qwen3_vl_dir):
    template = load_chat_template(qwen3_vl_dir, qwen3_vl_tokenizer)
    rendered = ChatTemplate("{{ eos_token }}|{{ pad_token }}", template.default_kwargs).render([])
    assert rendered == f"{qwen3_vl_tokenizer.eos_token}|{qwen3_vl_tokenizer.pad_token}"


def test_template_sources_in_priority_order(tmp_path, qwen3_vl_tokenizer):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "from tokenizer_config"}]}))
    assert load_chat_template(tmp_path).source == "from tokenizer_config"
    (tmp_path / "chat_template.jinja").write_text("from jinja file")
    assert load_chat_template(tmp_path).source == "from jinja file"


def test_no_template_anywhere_gives_none(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert load_chat_template(tmp_path, tokenizer=None) is None
