"""Who may drive the local model through this proxy: requests from the page it serves, and clients that are not
browsers (curl, SDKs). A page on another site must not, even though the user's browser can reach 127.0.0.1.

The rules (origin-form targets, an RFC 9112 Host naming this machine, the page's own Origin, a JSON body) live in
engine/server/origin_policy.py, which the engine applies too; this module answers them in the proxy's shape and
adds CORS headers for the origins given with --allowed-origins.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from engine.server.origin_policy import OriginPolicy, check_request, json_declared, preflight_headers, response_cors
from proxy.errors import error_response

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
__all__ = ["OriginPolicy", "cors_signal", "guard_middleware"]


def refusal_of(request: web.Request, policy: OriginPolicy) -> web.Response | None:
    """None if the request may go on, else the 400/403/415 answer."""
    refused = check_request(request.raw_path, request.headers.get("Host"), request.headers.get("Origin"),
                            request.scheme, policy, "proxy")
    if refused is not None:
        err_type = "forbidden" if refused.status == 403 else "invalid_request_error"
        return error_response(refused.status, refused.message, err_type, code=refused.code)
    if request.method in ("POST", "PUT", "PATCH") and not json_declared(request.headers.get("Content-Type")):
        declared = request.headers.get("Content-Type")
        shown = repr(declared[:60]) if declared else "missing"
        return error_response(415, f"Content-Type must be application/json, not {shown} (curl: -H "
                                   "'Content-Type: application/json')", "invalid_request_error",
                              code="unsupported_media_type")
    return None


def guard_middleware(policy: OriginPolicy) -> Callable:
    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        preflight = preflight_headers(request.method, request.headers.get("Origin"), policy)
        if preflight is not None:
            return web.Response(status=204, headers=preflight)
        refused = refusal_of(request, policy)
        return refused if refused is not None else await handler(request)
    return guard


def cors_signal(policy: OriginPolicy) -> Callable:
    """on_response_prepare: CORS headers for a listed origin, also on streams (prepared inside the handler)."""
    async def add_cors(request: web.Request, response: web.StreamResponse) -> None:
        response.headers.update(response_cors(request.headers.get("Origin"), request.host, request.scheme, policy))
    return add_cors
