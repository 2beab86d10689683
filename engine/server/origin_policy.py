"""Who may drive a local server from a browser: the Host, Origin and request-target rules that the proxy and the
engine both apply (one module, so that both refuse alike). Standard library only: the proxy imports it too.

- The request target must be origin-form (`/path?query`): an absolute-form target names a host of its own
  (`GET http://evil.example/ HTTP/1.1`), which a server that reads Host must not have to reconcile with it.
- Host must be a valid RFC 9112 Host (uri-host [":" port]: no userinfo, no path) naming this machine
  (localhost, an IP literal) or a name given with --allowed-hosts: with DNS rebinding, a foreign page reaches
  127.0.0.1 under its own host name, so its requests carry that name.
- Origin, which browsers send with every cross-origin request and every POST, must be the server's own (the
  same scheme, host and port as this request) or one given with --allowed-origins; those also get CORS headers.
  "null" (sandboxed frames, file:// pages) counts as foreign.
- A body must be declared as JSON (`json_declared`): a cross-site form, text/plain or typeless post (a "simple"
  request, sent without a CORS preflight) is refused.
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain"})
# RFC 3986 reg-name (unreserved, pct-encoded, sub-delims) or an IPv4 address, then an optional port; an IPv6
# literal in brackets. No "@" (userinfo), "/", "?" or "#" can appear in either.
_REG_NAME = re.compile(r"(?P<name>[A-Za-z0-9\-._~!$&'()*+,;=%]*)(?::(?P<port>[0-9]*))?")
_IP_LITERAL = re.compile(r"\[(?P<name>[0-9A-Fa-f:.]+|v[0-9A-Fa-f]+\.[A-Za-z0-9\-._~!$&'()*+,;=:]+)\]"
                         r"(?::(?P<port>[0-9]*))?")


@dataclass(frozen=True)
class OriginPolicy:
    allowed_hosts: frozenset[str] = frozenset()      # extra host names (lower case, no port)
    allowed_origins: frozenset[str] = frozenset()    # "scheme://host[:port]" allowed cross-origin; "*" is any

    @classmethod
    def from_lists(cls, hosts: str, origins: str) -> OriginPolicy:
        """From the comma-separated values of --allowed-hosts and --allowed-origins."""
        return cls(frozenset(h.lower() for h in split_list(hosts)),
                   frozenset(normalize_origin(o) for o in split_list(origins)))


@dataclass(frozen=True)
class Refusal:
    """Why a request may not go on, for the server to answer in its own error shape."""
    status: int
    code: str
    message: str


def split_list(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def parse_host(host: str | None) -> tuple[str, str | None] | None:
    """(lower-case name without brackets, port or None) of a Host value, or None if it is not RFC 9112's
    `uri-host [":" port]`."""
    if not host:
        return None
    match = (_IP_LITERAL if host.startswith("[") else _REG_NAME).fullmatch(host)
    if match is None or not match["name"]:
        return None
    return match["name"].lower(), match["port"] or None


def host_allowed(name: str, policy: OriginPolicy) -> bool:
    if name in LOCAL_NAMES or name in policy.allowed_hosts or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)      # an address is no DNS name: it cannot be rebound
        return True
    except ValueError:
        return False


def same_origin(origin: str, host: str, scheme: str) -> bool:
    """Whether Origin (scheme://host[:port]) names the scheme, host and port this request was sent to."""
    parts = urlsplit(origin.strip())
    if parts.scheme.lower() != scheme or not parts.netloc or "@" in parts.netloc:
        return False
    default_port = "80" if scheme == "http" else "443"
    return _with_port(parts.netloc, default_port) == _with_port(host, default_port)


def _with_port(netloc: str, default_port: str) -> str:
    netloc = netloc.strip().lower()
    has_port = ":" in netloc.rsplit("]", 1)[-1]          # the colons of an IPv6 literal are inside [ ]
    return netloc if has_port else f"{netloc}:{default_port}"


def normalize_origin(origin: str) -> str:
    return origin.strip().rstrip("/").lower()


def origin_listed(origin: str, policy: OriginPolicy) -> bool:
    return "*" in policy.allowed_origins or normalize_origin(origin) in policy.allowed_origins


def json_declared(content_type: str | None) -> bool:
    """application/json or an application/...+json type, with any parameters; a missing type is refused."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def check_request(target: str, host: str | None, origin: str | None, scheme: str, policy: OriginPolicy,
                  server: str) -> Refusal | None:
    """None if a request with this raw request target, Host, Origin (None: not sent) and scheme may go on, else
    why not. `server` names the program whose flags the advice mentions ("proxy", "engine")."""
    if not target.startswith("/"):
        return Refusal(400, "invalid_request_target", f"the request target {target[:100]!r} is not a path: send "
                                                      "`METHOD /path HTTP/1.1` with the host in the Host header")
    parsed = parse_host(host)
    if parsed is None:
        shown = repr(host[:100]) if host else "missing"
        return Refusal(400, "invalid_host", f"the Host header is {shown}: it must be a host name or address with "
                                            "an optional port (RFC 9112), such as localhost:8000")
    if not host_allowed(parsed[0], policy):
        return Refusal(403, "host_not_allowed", f"Host {host[:100]!r} is not a name this server answers to (a guard "
                                                "against DNS rebinding). To reach it under that name, start the "
                                                f"{server} with --allowed-hosts NAME (or env "
                                                "LOCALCHAT_ALLOWED_HOSTS).")
    if origin is not None and not origin_listed(origin, policy) and (
            origin == "null" or not same_origin(origin, host, scheme)):
        return Refusal(403, "origin_not_allowed", f"Cross-origin request from {origin[:100]!r} refused: only the "
                                                  "chat page served here may use this API from a browser. To allow "
                                                  f"another site, start the {server} with --allowed-origins ORIGIN "
                                                  "(or env LOCALCHAT_ALLOWED_ORIGINS).")
    return None


def preflight_headers(method: str, origin: str | None, policy: OriginPolicy) -> dict[str, str] | None:
    """The headers of the 204 that answers a CORS preflight (OPTIONS) from a listed origin; None for any other
    request, which then meets check_request."""
    if method == "OPTIONS" and origin is not None and origin_listed(origin, policy):
        return cors_headers(origin, preflight=True)
    return None


def response_cors(origin: str | None, host: str, scheme: str, policy: OriginPolicy) -> dict[str, str]:
    """CORS headers for a response to a listed origin's page (none for the server's own page or anyone else)."""
    if origin is not None and origin_listed(origin, policy) and not same_origin(origin, host, scheme):
        return cors_headers(origin)
    return {}


def cors_headers(origin: str, preflight: bool = False) -> dict[str, str]:
    headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
    if preflight:
        headers.update({"Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
                        "Access-Control-Allow-Headers": "Content-Type, Authorization",
                        "Access-Control-Max-Age": "600"})
    return headers
