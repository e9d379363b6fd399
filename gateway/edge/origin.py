"""Which web pages may drive the gateway: one pure decision, ``origin_allowed``, that the
WebSocket handshake (``gateway/doors/ws.py``) and the HTTP API (``OriginGuard``) both follow.

Browsers send ``Origin`` on every WebSocket handshake and on every POST; SDKs, curl and
the CLI send none and are not concerned. ``allowed_origins`` (``SF_ALLOWED_ORIGINS``):

* empty (the default): only the same origin. The Origin's host and port must be those of
  the request's ``Host`` header, and its scheme the request's (``http`` for ``http`` and
  ``ws``, ``https`` for ``https`` and ``wss``). The demo page the gateway serves itself
  passes; a page from any other site does not, so with auth off (``streamfleet serve``)
  a site the user happens to visit cannot use a local gateway.
* ``*``: any origin.
* a comma-separated list, e.g. ``https://app.example.com``: exactly those origins.
"""

from __future__ import annotations

from functools import lru_cache
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from streamfleet.gateway.edge.httperror import openai_error_response
from streamfleet.shared.errors import ErrorCode, StreamfleetError

__all__ = ["refused_origin", "origin_allowed", "OriginGuard"]

#: the scheme a same-origin page has, by the scheme of the request it makes
_PAGE_SCHEME = {"http": "http", "ws": "http", "https": "https", "wss": "https"}
_DEFAULT_PORT = {"http": 80, "https": 443}
#: methods that change nothing; the browser keeps a cross-origin answer from the page anyway
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


@lru_cache(maxsize=16)
def _parse_allowed(allowed: str) -> frozenset[str]:
    return frozenset(o.strip() for o in allowed.split(",") if o.strip())


def _host_port(netloc: str, scheme: str) -> tuple[str, int] | None:
    """``("host", port)`` of ``host[:port]``, the scheme's default port when none is given;
    None when it is not a plain host and port."""
    if not netloc or "@" in netloc:
        return None
    try:
        parts = urlsplit("//" + netloc)
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname or parts.path or parts.query or parts.fragment:
        return None
    return parts.hostname.lower(), port if port is not None else _DEFAULT_PORT[scheme]


def origin_allowed(origin: str | None, host: str | None, scheme: str, allowed: str) -> bool:
    """Whether a request carrying ``Origin: origin`` may be served.

    Args:
        origin: the request's ``Origin`` header; None when it has none (not a browser).
        host: the request's ``Host`` header.
        scheme: the request's scheme as the server sees it: ``http``, ``https``, ``ws`` or
            ``wss``.
        allowed: the ``allowed_origins`` setting (see the module docstring).
    """
    if origin is None:
        return True
    allowed_set = _parse_allowed(allowed)
    if "*" in allowed_set:
        return True
    if allowed_set:
        return origin in allowed_set
    page_scheme = _PAGE_SCHEME.get(scheme.lower())
    if page_scheme is None or host is None:
        return False
    try:
        parts = urlsplit(origin)
    except ValueError:
        return False
    # an origin is scheme://host[:port] and nothing more ("null" and file: pages fail here)
    if parts.scheme.lower() != page_scheme or parts.path or parts.query or parts.fragment:
        return False
    mine = _host_port(parts.netloc, page_scheme)
    return mine is not None and mine == _host_port(host, page_scheme)


class OriginGuard:
    """ASGI middleware: an HTTP request with a method that can change something (POST, ...)
    and an ``Origin`` that ``origin_allowed`` refuses gets 403 ``forbidden`` (the OpenAI
    error body) before any route runs. WebSockets are checked by their session."""

    def __init__(self, app: ASGIApp, allowed_origins: str) -> None:
        self.app = app
        self.allowed_origins = allowed_origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = refused_origin(scope, self.allowed_origins)
        if refusal is not None:
            await openai_error_response(refusal)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def refused_origin(scope: Scope, allowed_origins: str) -> StreamfleetError | None:
    """The ``forbidden`` error for an HTTP request that may change something (POST, ...)
    from an ``Origin`` that ``origin_allowed`` refuses; None when it may go on."""
    if scope["type"] == "http" and scope["method"] not in SAFE_METHODS:
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        if not origin_allowed(origin, headers.get("host"), scope.get("scheme", "http"), allowed_origins):
            return StreamfleetError(f"origin {origin!r} is not allowed", code=ErrorCode.forbidden)
    return None
