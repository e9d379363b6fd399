"""The Origin rule that WebSockets and the HTTP API share (gateway/origin.py)."""

from __future__ import annotations

import pytest

from streamfleet.gateway.origin import origin_allowed


@pytest.mark.parametrize("allowed", ["", "*", "https://app.example"])
def test_no_origin_header_is_not_a_browser_and_always_passes(allowed):
    assert origin_allowed(None, "127.0.0.1:8000", "ws", allowed)
    assert origin_allowed(None, None, "http", allowed)


@pytest.mark.parametrize("origin,host,scheme", [
    ("http://127.0.0.1:8000", "127.0.0.1:8000", "ws"),
    ("http://127.0.0.1:8000", "127.0.0.1:8000", "http"),
    ("https://api.example.com", "api.example.com", "wss"),
    ("https://api.example.com", "api.example.com:443", "https"),
    ("https://api.example.com:443", "api.example.com", "wss"),
    ("http://example.com", "example.com:80", "ws"),
    ("http://LocalHost:8000", "localhost:8000", "ws"),
    ("http://[::1]:8000", "[::1]:8000", "ws"),
])
def test_empty_list_allows_the_same_origin(origin, host, scheme):
    assert origin_allowed(origin, host, scheme, "")


@pytest.mark.parametrize("origin,host,scheme", [
    ("http://evil.example", "127.0.0.1:8000", "ws"),            # another site
    ("http://127.0.0.1:8001", "127.0.0.1:8000", "ws"),          # another port
    ("http://127.0.0.1", "127.0.0.1:8000", "ws"),               # default port 80 != 8000
    ("http://localhost:8000", "127.0.0.1:8000", "ws"),          # another name for the host
    ("https://127.0.0.1:8000", "127.0.0.1:8000", "ws"),         # https page, ws request
    ("http://api.example.com", "api.example.com", "wss"),       # http page, wss request
    ("http://api.example.com", "api.example.com", "https"),
    ("https://api.example.com", "api.example.com", "http"),
    ("null", "127.0.0.1:8000", "ws"),                           # sandboxed frame, file: page
    ("file://", "127.0.0.1:8000", "ws"),
    ("", "127.0.0.1:8000", "ws"),
    ("http://127.0.0.1:8000/", "127.0.0.1:8000", "ws"),         # not an origin
    ("http://127.0.0.1:8000/x", "127.0.0.1:8000", "http"),
    ("http://user@127.0.0.1:8000", "127.0.0.1:8000", "ws"),
    ("http://127.0.0.1:notaport", "127.0.0.1:notaport", "ws"),
    ("http://127.0.0.1:99999", "127.0.0.1:99999", "ws"),
    ("http://127.0.0.1:8000", None, "ws"),                      # no Host header
    ("http://127.0.0.1:8000", "", "ws"),
    ("http://127.0.0.1:8000", "127.0.0.1:8000/path", "ws"),
    ("http://127.0.0.1:8000", "127.0.0.1:8000", "ftp"),
    ("http://127.0.0.1:8000.evil.example", "127.0.0.1:8000", "ws"),
    ("http://127.0.0.1:8000", "127.0.0.1:8000.evil.example", "ws"),
])
def test_empty_list_refuses_every_other_origin(origin, host, scheme):
    assert not origin_allowed(origin, host, scheme, "")


def test_star_allows_any_origin():
    assert origin_allowed("http://evil.example", "127.0.0.1:8000", "ws", "*")
    assert origin_allowed("null", "127.0.0.1:8000", "http", " * ")
    assert origin_allowed("https://x.example", None, "https", "https://a.example, *")


def test_a_list_is_an_exact_match_and_nothing_else():
    allowed = "https://app.example, http://localhost:3000"
    assert origin_allowed("https://app.example", "gw.example", "wss", allowed)
    assert origin_allowed("http://localhost:3000", "127.0.0.1:8000", "ws", allowed)
    assert not origin_allowed("https://app.example:443", "gw.example", "wss", allowed)
    assert not origin_allowed("https://evil.example", "gw.example", "wss", allowed)
    # as before the same-origin default existed: with a list, the gateway's own pages must be listed too
    assert not origin_allowed("http://127.0.0.1:8000", "127.0.0.1:8000", "ws", allowed)
    assert not origin_allowed("null", "127.0.0.1:8000", "ws", allowed)
