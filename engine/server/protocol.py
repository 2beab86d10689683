"""Request bodies of /v1/chat/completions and /v1/completions -> typed fields and SamplingParams.

As OpenAI and vLLM do, fields this server does not know are ignored; fields it knows are type-checked here
(a wrong type is a 400 naming the field) and range-checked by SamplingParams. A few known fields that would
change the answer if silently ignored are checked, never dropped.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import orjson   # parses large image requests several times faster than the standard library (docs/perf-log.md)
from aiohttp import web

from engine.errors import InvalidInputError
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.server.defaults import SamplingDefaults
from engine.server.request_body import BodyLimits, check_chat_shape, check_json_content_type, check_json_tree, \
    read_body

MAX_CHOICES = 16                                     # n and best_of: each choice is one engine request
_INT64_MIN, _INT64_MAX = -(2 ** 63), 2 ** 63 - 1     # torch.Generator.manual_seed's range (and vLLM's bounds)


# Bodies up to this size are parsed and checked on the event loop (well under a millisecond); larger ones on a
# thread of their own, one at a time: orjson holds the GIL for a whole parse (a tenth of a second for 100,000 small
# objects), so parses in a row on several threads could keep the event loop and the engine thread waiting for as
# long as all of them take; between two parses on one thread, both get their turn.
INLINE_PARSE_BYTES = 64 << 10
_BODY_PARSER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="body")


async def read_json_body(request: web.Request, limits: BodyLimits | None = None) -> dict[str, Any]:
    """The body as a JSON object, its chat shape within `limits`. aiohttp raises 413 past client_max_size while
    reading."""
    check_json_content_type(request)
    raw = await read_body(request)
    if len(raw) <= INLINE_PARSE_BYTES:
        return parse_json_body(raw, limits)
    return await asyncio.get_running_loop().run_in_executor(_BODY_PARSER, parse_json_body, raw, limits)


def parse_json_body(raw: bytes, limits: BodyLimits | None = None) -> dict[str, Any]:
    """The checks of read_json_body after the read, in O(body): any thread."""
    if not raw.strip():
        raise InvalidInputError("the request body is empty; send a JSON object (Content-Type: application/json)",
                                code="invalid_json")
    try:
        body = _loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidInputError(f"the request body is not valid JSON: {e}", code="invalid_json") from e
    except RecursionError:      # the standard parser (orjson stops at 1024 levels)
        raise InvalidInputError("the request body is nested too deeply", code="json_too_deep") from None
    if not isinstance(body, dict):
        raise InvalidInputError(f"the request body must be a JSON object, not a JSON {type(body).__name__}",
                                code="invalid_json")
    check_chat_shape(body, limits or BodyLimits())
    check_json_tree(body)
    return body


def _loads(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass   # the standard parser decides: its error messages, and what it accepts (ints past 64 bits)
    return json.loads(raw, parse_constant=_reject_constant)


def _reject_constant(name: str) -> float:
    # Python's json accepts NaN and Infinity; they are not JSON, and NaN would slip through range checks.
    raise InvalidInputError(f"the request body is not valid JSON: {name} is not a JSON value", code="invalid_json")


@contextlib.contextmanager
def renamed_params(aliases: dict[str, str]) -> Iterator[None]:
    """Errors raised inside name the field as this request spelled it (SamplingParams says max_tokens where the
    chat request sent max_completion_tokens; the engine says messages where a completion sent prompt)."""
    try:
        yield
    except InvalidInputError as e:
        if e.param in aliases:
            e.param = aliases[e.param]
        raise


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)     # bool is an int subclass; JSON's true is not 1


def _past_64_bits(v: Any) -> bool:
    """orjson reads an integer literal past 64 bits as a float: that is an integer out of range, not a number."""
    return isinstance(v, float) and v.is_integer() and not _INT64_MIN <= v <= _INT64_MAX


class Fields:
    """Typed reads of a JSON object's fields. null means "not given", as in OpenAI's API."""

    def __init__(self, body: dict[str, Any]):
        self.body = body

    def given(self, name: str) -> bool:
        return self.body.get(name) is not None

    def _get(self, name: str, default: Any, ok: Callable[[Any], bool], what: str) -> Any:
        """The field's value if given and ok(value), `default` if not given; else a 400 that says `what`."""
        if not self.given(name):
            return default
        value = self.body[name]
        if not ok(value):
            raise InvalidInputError(f"{name} must be {what}, got {_describe(value)}", param=name)
        return value

    def boolean(self, name: str, default: bool) -> bool:
        return self._get(name, default, lambda v: isinstance(v, bool), "true or false")

    def integer(self, name: str, default: int | None) -> int | None:
        value = self._get(name, default, lambda v: _is_int(v) or _past_64_bits(v), "an integer")
        if value is not None and not _INT64_MIN <= value <= _INT64_MAX:   # torch holds 64-bit integers
            raise InvalidInputError(f"{name} is out of range (it must fit in a 64-bit integer)", param=name)
        return value

    def number(self, name: str, default: float) -> float:
        value = self._get(name, default, lambda v: _is_int(v) or isinstance(v, float), "a number")
        try:
            return float(value)
        except OverflowError:                          # an integer literal with hundreds of digits
            raise InvalidInputError(f"{name} is out of range", param=name) from None

    def string(self, name: str, default: str | None) -> str | None:
        return self._get(name, default, lambda v: isinstance(v, str), "a string")

    def obj(self, name: str) -> dict[str, Any] | None:
        return self._get(name, None, lambda v: isinstance(v, dict), "an object")

    def strings(self, name: str) -> str | list[str] | None:
        return self._get(name, None, lambda v: isinstance(v, str) or (isinstance(v, list) and all(
            isinstance(x, str) for x in v)), "a string or a list of strings")

    def integers(self, name: str) -> list[int] | None:
        return self._get(name, None, lambda v: isinstance(v, list) and all(_is_int(x) for x in v),
                         "a list of integers")


_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}


def _describe(value: Any) -> str:
    """`string "abc"`: the JSON type and a short excerpt of what was sent."""
    text = json.dumps(value, ensure_ascii=False)
    return f"{_JSON_TYPES.get(type(value), 'value')} {text if len(text) <= 40 else text[:37] + '...'}"


@dataclass(frozen=True)
class RequestOptions:
    """What a request asks of the server, beside the prompt and the sampling parameters."""
    model: str | None
    stream: bool
    include_usage: bool          # stream_options.include_usage: a last chunk with the usage
    priority: int
    continuous_usage_stats: bool = False   # stream_options.continuous_usage_stats: usage in every chunk
    past_queue_limit: bool = False         # a priority below 0 from a client with the API key
    return_token_ids: bool = False         # vLLM's: prompt_token_ids and each choice's token_ids in the response
    tokens_as_ids: bool = False            # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"


def parse_options(f: Fields, tokens_as_ids: bool = False) -> RequestOptions:
    """`tokens_as_ids`: the server's default for return_tokens_as_token_ids (--return-tokens-as-token-ids)."""
    stream = f.boolean("stream", False)
    stream_options = f.obj("stream_options") or {}
    if stream_options and not stream:
        raise InvalidInputError("stream_options is only allowed when stream is true", param="stream_options")
    with renamed_params({"include_usage": "stream_options.include_usage",
                         "continuous_usage_stats": "stream_options.continuous_usage_stats"}):
        include_usage = Fields(stream_options).boolean("include_usage", False)
        continuous = Fields(stream_options).boolean("continuous_usage_stats", False)
    return RequestOptions(model=f.string("model", None), stream=stream, include_usage=include_usage or continuous,
                          priority=f.integer("priority", 0), continuous_usage_stats=continuous,
                          return_token_ids=f.boolean("return_token_ids", False),
                          tokens_as_ids=f.boolean("return_tokens_as_token_ids", tokens_as_ids))


def truncate_prompt_tokens(f: Fields, max_model_len: int) -> int | None:
    """vLLM's truncate_prompt_tokens: keep only the prompt's last k tokens; -1 means max_model_len."""
    k = f.integer("truncate_prompt_tokens", None)
    if k is None:
        return None
    if k == -1:
        return max_model_len
    if k < 1:
        raise InvalidInputError("truncate_prompt_tokens must be a positive number of tokens, or -1 for the model's "
                                "maximum context length", param="truncate_prompt_tokens")
    if k > max_model_len:
        raise InvalidInputError(f"truncate_prompt_tokens ({k}) is greater than max_model_len ({max_model_len}); ask "
                                f"for a smaller truncation", param="truncate_prompt_tokens")
    return k


def chat_template_options(f: Fields) -> dict[str, Any]:
    """How chat messages are rendered: vLLM's add_generation_prompt, continue_final_message (the prompt ends
    inside the last, assistant, message, for the model to continue it), chat_template (this request's own
    template, rendered in the same sandbox), chat_template_kwargs, and mm_processor_kwargs (how its images
    and videos are processed: engine/inputs/mm_kwargs.py)."""
    options = dict(add_generation_prompt=f.boolean("add_generation_prompt", True),
                   continue_final_message=f.boolean("continue_final_message", False),
                   chat_template=f.string("chat_template", None), chat_template_kwargs=f.obj("chat_template_kwargs"),
                   mm_processor_kwargs=f.obj("mm_processor_kwargs"))
    if options["continue_final_message"] and options["add_generation_prompt"]:
        raise InvalidInputError("continue_final_message and add_generation_prompt cannot both be true (set "
                                "add_generation_prompt: false)", param="continue_final_message")
    return options


def choice_counts(f: Fields, options: RequestOptions) -> tuple[int, int | None]:
    """(n, best_of). best_of candidates are generated and the n most likely returned: not while streaming,
    where choices are sent before they can be compared (OpenAI refuses the same)."""
    n = f.integer("n", 1)
    best_of = f.integer("best_of", None)
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidInputError(f"n must be in [1, {MAX_CHOICES}]", param="n")
    if best_of is not None:
        if not n <= best_of <= MAX_CHOICES:
            raise InvalidInputError(f"best_of must be in [n, {MAX_CHOICES}] (n is {n})", param="best_of")
        if best_of > n and options.stream:
            raise InvalidInputError("best_of > n cannot be streamed", param="best_of")
    return n, best_of


def engine_logprobs(asked: int | None, n: int, best_of: int | None) -> int | None:
    """The logprobs the engine returns: what the client asked, and at least the chosen tokens' when best_of
    ranks candidates (by their cumulative log-probability)."""
    return asked if (best_of or n) == n else (asked or 0)


def logit_bias(f: Fields) -> dict[int, float] | None:
    """OpenAI sends {"token id as a string": bias}."""
    value = f.obj("logit_bias")
    if not value:
        return None
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidInputError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise InvalidInputError(f"logit_bias[{key!r}] must be a number", param="logit_bias")
        out[token] = float(bias)
    return out


def sampling_params(f: Fields, defaults: SamplingDefaults, max_tokens: int | None,
                    logprobs: int | None, structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
    """SamplingParams of one engine request (n is the server's: serving.Generation fans out); max_tokens and
    logprobs come resolved from the endpoint's own fields."""
    bad_words = f.strings("bad_words")
    return SamplingParams(
        temperature=f.number("temperature", defaults.temperature),
        top_p=f.number("top_p", defaults.top_p),
        top_k=f.integer("top_k", defaults.top_k),
        min_p=f.number("min_p", defaults.min_p),
        presence_penalty=f.number("presence_penalty", 0.0),
        frequency_penalty=f.number("frequency_penalty", 0.0),
        repetition_penalty=f.number("repetition_penalty", defaults.repetition_penalty),
        seed=f.integer("seed", None),
        stop=f.strings("stop"),
        stop_token_ids=f.integers("stop_token_ids"),
        ignore_eos=f.boolean("ignore_eos", False),
        max_tokens=max_tokens,
        min_tokens=f.integer("min_tokens", 0),
        logprobs=logprobs,
        skip_special_tokens=f.boolean("skip_special_tokens", True),
        include_stop_str_in_output=f.boolean("include_stop_str_in_output", False),
        prompt_logprobs=f.integer("prompt_logprobs", None),
        logit_bias=logit_bias(f),
        allowed_token_ids=f.integers("allowed_token_ids"),
        bad_words=[bad_words] if isinstance(bad_words, str) else bad_words,
        structured_outputs=structured_outputs,
    )


def check_token_ids_in_vocab(params: SamplingParams, vocab_size: int) -> None:
    """SamplingParams cannot know the vocabulary; an id past it would fail inside the engine's step."""
    bad = next((t for t in params.stop_token_ids if t >= vocab_size), None)
    if bad is not None:
        raise InvalidInputError(f"stop_token_ids: token id {bad} is out of the vocabulary [0, {vocab_size})",
                                param="stop_token_ids")
