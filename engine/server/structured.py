"""The structured-output fields of a request -> StructuredOutputsParams: OpenAI's `response_format`
(json_object, json_schema), vLLM's `structured_outputs` (json, regex, choice, grammar, json_object) and its
older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. At most one may be given."""
from __future__ import annotations

from typing import Any

from engine.errors import InvalidInputError
from engine.sampling_params import StructuredOutputsParams
from engine.server.protocol import Fields

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")


def parse_structured_outputs(f: Fields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The constraint and the field that asked for it (named in the 400 when it does not compile)."""
    found = [(name, parse) for name, parse in (("response_format", _response_format),
                                               ("structured_outputs", _structured_outputs),
                                               *((g, _guided) for g in _GUIDED)) if f.given(name)]
    results = [(name, parse(name, f.body[name])) for name, parse in found]
    results = [(name, so) for name, so in results if so is not None]
    if len(results) > 1:
        raise InvalidInputError(f"give one output constraint, not {' and '.join(n for n, _ in results)}",
                                param=results[1][0])
    return (results[0][1], results[0][0]) if results else (None, None)


def _response_format(name: str, value: Any) -> StructuredOutputsParams | None:
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidInputError('response_format must be {"type": "text"}, {"type": "json_object"} or '
                                '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}', param=name)
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise InvalidInputError("response_format.json_schema must be an object with a schema object",
                                param=f"{name}.json_schema")
    # OpenAI allows the schema to be left out (then any JSON object).
    return StructuredOutputsParams(json=spec.get("schema") or {"type": "object"})


def _structured_outputs(name: str, value: Any) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise InvalidInputError(f"{name} must be an object with one of json, regex, choice, grammar, json_object",
                                param=name)
    unknown = [k for k, v in value.items() if v is not None and k not in _KEYS]
    if unknown:
        raise InvalidInputError(f"{name}: unsupported field(s) {unknown}; this server takes {', '.join(_KEYS)}",
                                param=f"{name}.{unknown[0]}")
    fields = {k: value[k] for k in _KEYS if value.get(k) is not None}
    for key in ("regex", "grammar"):
        if key in fields and not isinstance(fields[key], str):
            raise InvalidInputError(f"{name}.{key} must be a string", param=f"{name}.{key}")
    if "json" in fields and not isinstance(fields["json"], (str, dict)):
        raise InvalidInputError(f"{name}.json must be a JSON schema (object or string)", param=f"{name}.json")
    return StructuredOutputsParams(**fields)


def _guided(name: str, value: Any) -> StructuredOutputsParams:
    """vLLM's older guided_* fields: one structured_outputs key each; errors name the field as it was sent."""
    try:
        return _structured_outputs(name, {_GUIDED[name]: value})
    except InvalidInputError as err:
        err.param = name
        err.message = err.message.replace(f"{name}.{_GUIDED[name]}", name)
        err.args = (err.message,)
        raise
