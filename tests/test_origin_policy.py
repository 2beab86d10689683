"""The Host, Origin and request-target rules both servers apply (engine/server/origin_policy.py), case by case."""
from __future__ import annotations

import pytest

from engine.server.origin_policy import OriginPolicy, check_request, parse_host, same_origin

POLICY = OriginPolicy.from_lists("chat.lan", "https://app.example")


@pytest.mark.parametrize("host,parsed", [
    ("localhost:8000", ("localhost", "8000")), ("LocalHost", ("localhost", None)),
    ("127.0.0.1:3001", ("127.0.0.1", "3001")),
    ("[::1]:8000", ("::1", "8000")), ("[::1]", ("::1", None)),
    ("localhost:8200@evil.example", None), ("user@localhost", None), ("localhost/x", None), ("localhost:80x", None),
    ("", None), (None, None), ("[::1", None), ("local host", None), ("localhost?", None), ("localhost#", None),
])
def test_host_is_rfc9112(host, parsed):
    assert parse_host(host) == parsed


@pytest.mark.parametrize("target,host,origin,status", [
    ("/v1/models", "localhost:8000", None, None),
    ("/v1/models", "chat.lan:8000", None, None),                    # --allowed-hosts
    ("/v1/models", "10.0.0.5:8000", None, None),                    # an address cannot be rebound
    ("/v1/models", "evil.example:8000", None, 403),
    ("/v1/models", "localhost:8000", "http://localhost:8000", None),
    ("/v1/models", "localhost:8000", "https://localhost:8000", 403),  # another scheme is another origin
    ("/v1/models", "localhost:8000", "http://localhost:8001", 403),
    ("/v1/models", "localhost:8000", "https://app.example", None),  # --allowed-origins
    ("/v1/models", "localhost:8000", "null", 403),
    ("/v1/models", "localhost:8000", "http://user@localhost:8000", 403),
    ("http://evil.example/v1/models", "localhost:8000", None, 400),
    ("*", "localhost:8000", None, 400),
    ("/v1/models", "localhost:8000@evil.example", None, 400),
    ("/v1/models", None, None, 400),
])
def test_check_request(target, host, origin, status):
    refused = check_request(target, host, origin, "http", POLICY, "proxy")
    assert (refused and refused.status) == status, refused


def test_same_origin_reads_default_ports():
    assert same_origin("http://localhost", "localhost:80", "http")
    assert same_origin("https://localhost", "localhost:443", "https")
    assert not same_origin("http://localhost", "localhost:443", "http")
