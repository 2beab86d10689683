"""Who may drive the local model through this proxy: requests from the page it serves, and clients that are not
browsers (curl, SDKs). A page on another site must not, even though the user's browser can reach 127.0.0.1.

- Host must name this machine (localhost, an IP literal) or a name given with --allowed-hosts: with DNS
  rebinding, a foreign page reaches 127.0.0.1 under its own host name, so its requests carry that name.
- Origin, which browsers send with every cross-origin request and every POST, must be the page's own (the same
  host and port as Host) or one given with --allowed-origins; those also get CORS headers.
- A POST must declare a JSON body (the engine's rule): a cross-site form, text/plain or typeless post (a
  "simple" request, sent without a CORS preflight) is refused before it reaches the engine.
"""
from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import web

from proxy.errors import error_response

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain"})


@dataclass(frozen=True)
class OriginPolicy:
    allowed_hosts: frozenset[str] = frozenset()      # extra host names (lower case, no port)
    allowed_origins: frozenset[str] = frozenset()    # "scheme://host[:port]" allowed cross-origin; "*" is any


def host_name(host: str) -> str:
    """'Example.com:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def host_allowed(host: str | None, policy: OriginPolicy) -> bool:
    if not host:
        return False
    name = host_name(host)
    if name in LOCAL_NAMES or name in policy.allowed_hosts or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)      # an address is no DNS name: it cannot be rebound
        return True
    except ValueError:
        return False


def same_origin(origin: str, host: str) -> bool:
    """Whether Origin (scheme://host[:port]) names the host and port this request was sent to."""
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False
    default_port = "80" if parts.scheme == "http" else "443"
    return _with_port(parts.netloc, default_port) == _with_port(host, default_port)


def _with_port(netloc: str, default_port: str) -> str:
    netloc = netloc.strip().lower()
    has_port = ":" in netloc.rsplit("]", 1)[-1]          # the colons of an IPv6 literal are inside [ ]
    return netloc if has_port else f"{netloc}:{default_port}"


def normalize_origin(origin: str) -> str:
    return origin.strip().rstrip("/").lower()


def origin_listed(origin: str, policy: OriginPolicy) -> bool:
    return "*" in policy.allowed_origins or normalize_origin(origin) in policy.allowed_origins


def check_request(request: web.Request, policy: OriginPolicy) -> web.Response | None:
    """None if the request may go on, else the 403/415 answer."""
    host = request.headers.get("Host")
    if not host_allowed(host, policy):
        return error_response(403, f"Host {host!r} is not a name this server answers to (a guard against DNS "
                                   "rebinding). To reach it under that name, start the proxy with "
                                   "--allowed-hosts NAME (or env LOCALCHAT_ALLOWED_HOSTS).",
                              "forbidden", code="host_not_allowed")
    origin = request.headers.get("Origin")
    if origin is not None and origin != "null" and not same_origin(origin, host) \
            and not origin_listed(origin, policy):
        return cross_origin_refused(origin)
    if origin == "null" and not origin_listed(origin, policy):    # sandboxed frames, file:// pages
        return cross_origin_refused(origin)
    if request.method in ("POST", "PUT", "PATCH") and not json_declared(request.headers.get("Content-Type")):
        declared = request.headers.get("Content-Type")
        shown = repr(declared[:60]) if declared else "missing"
        return error_response(415, f"Content-Type must be application/json, not {shown} (curl: -H "
                                   "'Content-Type: application/json')", "invalid_request_error",
                              code="unsupported_media_type")
    return None


def json_declared(content_type: str | None) -> bool:
    """The engine's rule (engine/server/request_body.py), so that both answer alike: application/json or an
    application/...+json type, with any parameters; a missing type is refused."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def cross_origin_refused(origin: str) -> web.Response:
    return error_response(403, f"Cross-origin request from {origin[:100]!r} refused: only the chat page served "
                               "here may use this API from a browser. To allow another site, start the proxy "
                               "with --allowed-origins ORIGIN (or env LOCALCHAT_ALLOWED_ORIGINS).",
                          "forbidden", code="origin_not_allowed")


def guard_middleware(policy: OriginPolicy) -> Callable:
    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if request.method == "OPTIONS" and origin is not None and origin_listed(origin, policy):
            return web.Response(status=204, headers=cors_headers(origin, preflight=True))
        refused = check_request(request, policy)
        return refused if refused is not None else await handler(request)
    return guard


def cors_signal(policy: OriginPolicy) -> Callable:
    """on_response_prepare: CORS headers for a listed origin, also on streams (prepared inside the handler)."""
    async def add_cors(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is not None and origin_listed(origin, policy) and not same_origin(origin, request.host):
            response.headers.update(cors_headers(origin))
    return add_cors


def cors_headers(origin: str, preflight: bool = False) -> dict[str, str]:
    headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
    if preflight:
        headers.update({"Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
                        "Access-Control-Allow-Headers": "Content-Type, Authorization",
                        "Access-Control-Max-Age": "600"})
    return headers
