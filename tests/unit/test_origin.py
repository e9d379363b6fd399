"""The Origin rule that WebSockets and the HTTP API share (gateway/edge/origin.py)."""

from __future__ import annotations

import orjson
import pytest

from streamfleet.gateway.edge.origin import OriginGuard, origin_allowed, refused_origin
from streamfleet.shared.errors import ErrorCode


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


# -- the HTTP API: refused_origin and OriginGuard ----------------------------------------------
GW = "127.0.0.1:8000"
SAME = f"http://{GW}"


def scope(method: str = "POST", path: str = "/v1/completions", origin: str | None = None, *,
          kind: str = "http", scheme: str = "http") -> dict:
    headers = [(b"host", GW.encode()), (b"content-type", b"application/json")]
    if origin is not None:
        headers.append((b"origin", origin.encode()))
    return {"type": kind, "method": method, "path": path, "headers": headers, "scheme": scheme}


@pytest.mark.parametrize("allowed,method,path,origin,refused", [
    # the default (same origin only)
    ("", "POST", "/v1/completions", None, False),                       # not a browser
    ("", "POST", "/v1/completions", SAME, False),
    ("", "POST", "/v1/chat/completions", SAME, False),
    ("", "POST", "/v1/completions", "http://evil.example", True),
    ("", "POST", "/v1/chat/completions", "http://evil.example", True),
    ("", "PUT", "/v1/anything", "http://evil.example", True),           # any method that can change something
    ("", "GET", "/v1/models", "http://evil.example", False),            # reading is not refused
    ("", "HEAD", "/v1/models", "http://evil.example", False),
    ("", "OPTIONS", "/v1/completions", "http://evil.example", False),
    # a list: exactly those origins
    ("http://good.example", "POST", "/v1/completions", "http://good.example", False),
    ("http://good.example", "POST", "/v1/completions", "http://evil.example", True),
    ("http://good.example", "POST", "/v1/completions", SAME, True),     # the gateway's own origin is not listed
    ("http://good.example", "POST", "/v1/completions", None, False),
    # any
    ("*", "POST", "/v1/completions", "http://evil.example", False),
])
def test_an_http_request_that_can_change_something_follows_the_origin_rule(allowed, method, path, origin, refused):
    error = refused_origin(scope(method, path, origin), allowed)
    if not refused:
        assert error is None
        return
    assert error is not None and error.code == ErrorCode.forbidden and error.status == 403
    assert repr(origin) in error.message  # it names the origin
    body = error.to_openai()["error"]
    assert body["code"] == "forbidden" and body["type"]


def test_a_websocket_scope_is_left_to_its_session():
    assert refused_origin(scope("GET", "/v1/stream", "http://evil.example", kind="websocket", scheme="ws"), "") \
        is None


def test_the_scheme_of_the_request_decides_the_same_origin():
    assert refused_origin(scope(origin="https://" + GW, scheme="https"), "") is None
    assert refused_origin(scope(origin="https://" + GW, scheme="http"), "") is not None


class _App:
    """The app behind the guard: records each call."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def __call__(self, scope, receive, send) -> None:
        self.calls.append((scope, receive, send))


async def test_the_guard_answers_403_before_the_app_or_the_body_is_touched():
    app = _App()
    guard = OriginGuard(app, "")
    sent: list[dict] = []
    read = []

    async def receive():  # the body: must not be read for a refused request
        read.append(1)
        return {"type": "http.request", "body": b"{not json", "more_body": False}

    async def send(message):
        sent.append(message)

    await guard(scope(origin="http://evil.example"), receive, send)
    assert app.calls == [] and read == []
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 403
    body = orjson.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    assert set(body) == {"error"} and body["error"]["code"] == "forbidden"
    assert "evil.example" in body["error"]["message"]


async def test_the_guard_hands_an_allowed_request_to_the_app_as_it_came():
    app = _App()
    guard = OriginGuard(app, "")

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        raise AssertionError("the guard wrote for an allowed request")

    for s in (scope(origin=SAME), scope(), scope("GET", "/v1/models", "http://evil.example")):
        await guard(s, receive, send)
    # the very scope, receive and send: nothing buffered in between (a stream passes as it is made)
    assert [(c[0]["method"], c[1], c[2]) for c in app.calls] == [("POST", receive, send), ("POST", receive, send),
                                                                  ("GET", receive, send)]
