"""OpenAI-shaped error bodies, so the page and SDK clients read proxy errors exactly like engine errors."""
from __future__ import annotations

from aiohttp import web


def error_body(message: str, err_type: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


# Retry-After of a 503 that knows no better (the engine unreachable, restarting without a countdown, the pool
# full): every 503 says when to come back.
RETRY_AFTER_S = 2


def error_response(status: int, message: str, err_type: str, code: str | None = None,
                   extra: dict | None = None) -> web.Response:
    body = error_body(message, err_type, code)
    if extra:
        body.update(extra)
    response = web.json_response(body, status=status)
    if status == 503:
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


def unreachable_message(engine_url: str) -> str:
    return (f"The inference engine at {engine_url} is not reachable. It may still be starting "
            "(loading the model can take a while) or it has stopped; see vllm.log.")


def engine_unavailable(engine_url: str, extra: dict | None = None) -> web.Response:
    """503 for an engine that does not answer: not started yet, or gone."""
    return error_response(503, unreachable_message(engine_url), "service_unavailable",
                          code="engine_unavailable", extra=extra)


def payload_too_large(limit_bytes: int) -> web.Response:
    mb = limit_bytes / (1 << 20)
    return error_response(
        413, f"Request body is larger than the proxy's limit of {mb:g} MB. Send fewer or smaller images "
        "(or start the proxy with a larger --max-upload-mb).", "invalid_request_error", code="payload_too_large")
