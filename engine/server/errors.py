"""The OpenAI error shape, `{"error": {"message", "type", "param", "code"}}`, and the errors only HTTP has.

Engine errors (engine.errors) already carry status, type, param and code; this module adds the ones that come
from the HTTP layer (API key, unknown model, unknown route) and turns any of them into a JSON response.
"""
from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from engine.errors import EngineError


class AuthenticationError(EngineError):
    """Missing or wrong API key. OpenAI answers 401 with code invalid_api_key; the SDK raises AuthenticationError."""
    status = 401
    err_type = "invalid_request_error"


class NotFoundError(EngineError):
    """An unknown model (code model_not_found) or route."""
    status = 404
    err_type = "invalid_request_error"


class MethodNotAllowedError(EngineError):
    status = 405
    err_type = "invalid_request_error"


def dumps(obj: Any) -> str:
    """Compact JSON, UTF-8 as is (the content type says charset=utf-8); NaN/Infinity are not JSON, so fail loudly
    rather than send a body that strict clients cannot parse."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def error_body(message: str, err_type: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def engine_error_body(err: EngineError) -> dict:
    return error_body(err.message, err.err_type, err.param, err.code)


def error_response(err: EngineError) -> web.Response:
    response = web.json_response(engine_error_body(err), status=err.status, dumps=dumps)
    retry_after = getattr(err, "retry_after_s", None)
    if retry_after is not None:      # a 503 or 429: when to come back, as HTTP says it
        response.headers["Retry-After"] = str(retry_after)
    return response
