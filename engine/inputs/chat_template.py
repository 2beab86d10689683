"""The model's chat template, rendered in a jinja2 sandbox exactly as transformers' apply_chat_template does.

A chat template is code shipped with the model, and the messages it renders come from users, so it runs in
jinja2's ImmutableSandboxedEnvironment (no attribute access to Python internals, no mutation of the inputs) with
the globals and filters transformers gives it: raise_exception, tojson (no HTML escaping), strftime_now, a plain
dict() and a namespace() that refuses underscore names. Everything the template sees is first rebuilt from plain
JSON types, so objects such as decoded images never reach it (templates only test whether media keys exist).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import EngineError, InvalidInputError, ModelLoadError

# "openai": the template loops over message.content parts; "string": it expects content to be one string.
ContentFormat = Literal["openai", "string"]


class ChatTemplate:
    """A compiled chat template. `default_kwargs` (the tokenizer's special tokens) are visible to the template,
    as apply_chat_template makes them; keyword arguments given to render() override them."""

    def __init__(self, source: str, default_kwargs: Mapping[str, Any] | None = None):
        self.source = source
        self.default_kwargs = dict(default_kwargs or {})
        env = _make_environment()
        try:
            ast = env.parse(source)
            self._template = env.from_string(ast)
        except jinja2.TemplateError as e:
            raise ModelLoadError(f"the chat template does not compile: {e}") from e
        self.content_format: ContentFormat = "openai" if _loops_over_content(ast) else "string"
        # A template that never reads a message's tool_calls has no tool support (engine/inputs/tool_text.py).
        self.knows_tools = _reads_tool_calls(ast)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               **kwargs: Any) -> str:
        """The prompt text for `messages`. A template error (or the template's own raise_exception, e.g. "roles
        must alternate") is the request's fault for this model, so it becomes InvalidInputError."""
        # apply_chat_template drops None-valued keys: OpenAI clients send content=None beside tool_calls, and
        # templates handle a missing key but would render a literal "None".
        messages = [{k: v for k, v in m.items() if v is not None} if isinstance(m, Mapping) else m
                    for m in messages]
        variables = _plain({**self.default_kwargs, **kwargs})
        try:
            return self._template.render(messages=_plain(messages), tools=_plain(tools), documents=None,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            # raise_exception's message is the template author's own words ("Conversation roles must alternate").
            raise InvalidInputError(f"chat template error: {e.message or e}", param="messages") from e
        except Exception as e:  # noqa: BLE001 - templates run arbitrary expressions (e.g. str + list -> TypeError)
            raise InvalidInputError(f"the chat template could not render these messages: "
                                    f"{type(e).__name__}: {e}", param="messages") from e


def load_chat_template(model_path: str | Path, tokenizer: Any = None) -> ChatTemplate | None:
    """The model's chat template: chat_template.jinja in the model directory, else chat_template.json, else
    tokenizer_config.json's chat_template, else the tokenizer's own (e.g. read from GGUF metadata). None if the
    model has none (a base model): chat requests are then refused, completions still work."""
    path = Path(model_path)
    directory = path if path.is_dir() else path.parent
    source = None
    if path.is_dir() and (directory / "chat_template.jinja").is_file():
        source = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    if source is None and path.is_dir():
        for name in ("chat_template.json", "tokenizer_config.json"):
            if (directory / name).is_file():
                source = _pick(json.loads((directory / name).read_text(encoding="utf-8")).get("chat_template"))
                if source is not None:
                    break
    if source is None and tokenizer is not None:
        source = _pick(getattr(tokenizer, "chat_template", None))
    if source is None:
        return None
    special = dict(getattr(tokenizer, "special_tokens_map", None) or {}) if tokenizer is not None else {}
    return ChatTemplate(source, default_kwargs=special)


def _pick(template: Any) -> str | None:
    """A chat_template entry is a string, or (older tokenizers) a list of {"name", "template"} / a name -> template
    dict; the one named "default" is the chat template."""
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if isinstance(template, dict):
        return template.get("default")
    return None


# ---- the environment transformers builds (utils/chat_template_utils.py), minus its assistant-mask extension ----
def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
    # jinja's own tojson escapes <, >, & and ' for HTML; prompts need the JSON verbatim.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """dict() for templates, without exposing the dict type itself (its attributes) to the sandbox."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore-prefixed names, so a template cannot reach CPython internals."""

    def __init__(*args, **kwargs):  # same signature trick as jinja2's Namespace, so namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


def _plain(value: Any) -> Any:
    """`value` rebuilt from JSON types; anything else (an image, a tensor) becomes an inert "<TypeName>" string."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):      # subclasses (enums...) carry methods the sandbox should not see
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


def _loops_over_content(ast: jinja2.nodes.Template) -> bool:
    """Whether the template iterates over some `x.content` / `x['content']` (then it understands content parts).
    The same idea as vLLM's chat-template content-format detection, reduced to the one pattern templates use."""
    return any(_is_field(loop.iter, "content") for loop in ast.find_all(jinja2.nodes.For))


def _reads_tool_calls(ast: jinja2.nodes.Template) -> bool:
    """Whether the template reads some `x.tool_calls` / `x['tool_calls']`."""
    return any(_is_field(node, "tool_calls") for node in ast.find_all((jinja2.nodes.Getattr, jinja2.nodes.Getitem)))


def _is_field(node: jinja2.nodes.Node, name: str) -> bool:
    """Whether `node` is `x.name` or `x['name']`."""
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == name
    return isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const) \
        and node.arg.value == name


@functools.lru_cache(maxsize=16)
def request_template(source: str) -> ChatTemplate:
    """A request's own chat template, compiled once per distinct source. It gets no tokenizer kwargs: the
    request's template writes its special tokens itself."""
    if not isinstance(source, str) or not source.strip():
        raise InvalidInputError("chat_template must be a non-empty Jinja template", param="chat_template")
    try:
        return ChatTemplate(source)
    except EngineError as e:
        raise InvalidInputError(f"chat_template: {e.message}", param="chat_template") from None


def cut_after_final_message(text: str, final: dict[str, Any]) -> str:
    """The rendered chat up to the end of the last message's text, as transformers' continue_final_message."""
    content = final.get("content")
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        content = texts[-1] if texts else None
    if final.get("role") != "assistant" or not isinstance(content, str) or not content.strip():
        raise InvalidInputError("continue_final_message needs the last message to be an assistant message with "
                                "text", param="continue_final_message")
    at = text.rfind(content.strip())
    if at < 0:
        raise InvalidInputError("continue_final_message: the chat template does not write the last message's text "
                                "verbatim", param="continue_final_message")
    return text[:at + len(content.strip())]
