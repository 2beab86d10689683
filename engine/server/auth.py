"""Who may call the engine, and who may ask for more than others.

- The API key (`--api-key` or env VLLM_API_KEY) guards every /v1 route, as in vLLM: `Authorization: Bearer KEY`.
  /health, /stats, /metrics, /version, /tokenize and /detokenize stay open, for probes and dashboards.
- The proxy key (env LOCALCHAT_PROXY_KEY, a random key the launcher makes for each run and hands only to the
  proxy, never on a command line) closes every route but /health to anyone without it or the API key: the engine
  port is then of use to the proxy alone (the launcher's --expose-engine leaves it out).
- A request that carries the API key is privileged: it may ask for a priority below 0, which may pass the queue
  limit. The proxy's key admits, it does not privilege: the proxy's clients are anonymous browsers.
Keys are compared in constant time.
"""
from __future__ import annotations

import hmac
import os
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from engine.server.cli import PROXY_KEY_ENV
from engine.server.errors import AuthenticationError
from engine.server.middleware import Handler

_PROTECTED_PREFIX = "/v1"
_ALWAYS_OPEN = frozenset({"/health"})          # the launcher's and the proxy's probe; it says only "ok"
PRIVILEGED = web.RequestKey("privileged", bool)    # the request carried the API key


@dataclass(frozen=True)
class Keys:
    api_key: str | None = None
    proxy_key: str | None = None

    @classmethod
    def from_env(cls, api_key: str | None) -> Keys:
        """The API key from the flags, the proxy key from the environment, which keeps it out of `ps` (and out
        of the environment of anything this process starts)."""
        return cls(api_key, os.environ.pop(PROXY_KEY_ENV, None) or None)

    def required(self, path: str) -> bool:
        if self.proxy_key is not None:
            return path not in _ALWAYS_OPEN
        return self.api_key is not None and (path == _PROTECTED_PREFIX or path.startswith(_PROTECTED_PREFIX + "/"))


def bearer_token(authorization: str | None) -> str:
    """The token of `Bearer <token>`; AuthenticationError if the header is missing or malformed."""
    if not authorization:
        raise AuthenticationError("missing API key: send the header `Authorization: Bearer <key>` (the key the "
                                  "server was started with, --api-key or VLLM_API_KEY)", code="invalid_api_key")
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationError("malformed Authorization header: expected `Bearer <key>`", code="invalid_api_key")
    return token.strip()


def key_matches(token: str | None, key: str | None) -> bool:
    # Constant-time: the time taken must not tell an attacker how many leading characters were right.
    return token is not None and key is not None and hmac.compare_digest(token.encode(), key.encode())


def api_key_middleware(keys: Keys) -> Callable:
    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        required = keys.required(request.path)
        token = _token(request.headers.get("Authorization"))
        privileged = key_matches(token, keys.api_key)
        if required and not privileged and not key_matches(token, keys.proxy_key):
            raise _refusal(keys, request.headers.get("Authorization"))
        request[PRIVILEGED] = privileged
        return await handler(request)
    return auth


def _token(authorization: str | None) -> str | None:
    try:
        return bearer_token(authorization)
    except AuthenticationError:
        return None


def _refusal(keys: Keys, authorization: str | None) -> AuthenticationError:
    if keys.proxy_key is not None:
        return AuthenticationError("this engine was started by the launcher and answers only its proxy (use the "
                                   "chat page's address) and clients with the --api-key the app was started with; "
                                   "`./run_app.sh --expose-engine` opens it", code="invalid_api_key")
    bearer_token(authorization)          # says what is wrong with a missing or malformed header
    return AuthenticationError("incorrect API key provided", code="invalid_api_key")
