"""The API key (`--api-key` or env VLLM_API_KEY) guards every /v1 route, as in vLLM: `Authorization: Bearer KEY`.
/health, /stats, /metrics and /version stay open, for probes, dashboards and `curl localhost:3001/stats`."""
from __future__ import annotations

import hmac
from collections.abc import Callable

from aiohttp import web

from engine.server.errors import AuthenticationError
from engine.server.middleware import Handler

_PROTECTED_PREFIX = "/v1"


def requires_key(path: str) -> bool:
    return path == _PROTECTED_PREFIX or path.startswith(_PROTECTED_PREFIX + "/")


def check_api_key(authorization: str | None, api_key: str) -> None:
    """Raise AuthenticationError unless `authorization` is `Bearer <api_key>`."""
    if not authorization:
        raise AuthenticationError("missing API key: send the header `Authorization: Bearer <key>` (the key the "
                                  "server was started with, --api-key or VLLM_API_KEY)", code="invalid_api_key")
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationError("malformed Authorization header: expected `Bearer <key>`", code="invalid_api_key")
    # Constant-time: the time taken must not tell an attacker how many leading characters were right.
    if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise AuthenticationError("incorrect API key provided", code="invalid_api_key")


def api_key_middleware(api_key: str) -> Callable:
    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if requires_key(request.path):
            check_api_key(request.headers.get("Authorization"), api_key)
        return await handler(request)
    return auth
