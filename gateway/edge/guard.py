"""The edge before auth (docs/security.md, "The edge before auth"): what one gateway
process holds for a client before it knows who the client is, bounded.

* ``EdgeGuard``: the process's count of the connections on its HTTP port, in all and per
  client address until they authenticate; a connection past either cap is refused.
* ``EdgeHttpToolsProtocol``: uvicorn's httptools protocol (the C parser, kept for its
  speed) with the request head bounded before it is
  parsed further: the request target's length, the head's bytes and header count, and the
  time the head may take to arrive.

A refusal is a whole HTTP response with ``Connection: close`` and an OpenAI-style error
body, written at once. The connection then lingers for up to ``LINGER_S``, reading and
dropping what the client still sends, so that a client in the middle of sending reads
the answer rather than a reset.

The gRPC port has no hook per connection in grpcio: it is bounded by its own options
(``gateway.doors.grpc_server.GrpcDoor``).
"""

from __future__ import annotations

import time
from asyncio import AbstractEventLoop, TimerHandle, Transport
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import httptools
import orjson
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from streamfleet.shared.errors import ErrorCode
from streamfleet.shared.logging import get_logger
from streamfleet.shared.metrics import gateway as metrics
from streamfleet.shared.settings import GatewaySettings

__all__ = ["EdgeGuard", "EdgeHttpToolsProtocol", "EdgeLimits", "Refusal", "Ticket", "SCOPE_KEY", "authenticated",
           "edge_protocol"]

log = get_logger("gateway.edge")

#: the ASGI scope key of a connection's ``Ticket`` (HTTP and WebSocket scopes alike)
SCOPE_KEY = "streamfleet.edge"
#: seconds a refused connection is read (and what comes dropped) before it is closed
LINGER_S = 2.0
#: a refusal of each kind is logged at most this often (with the count since): an attack
#: must not flood the log
LOG_EVERY_S = 10.0


@dataclass(frozen=True)
class Refusal:
    """An answer to a connection or request head the gateway will not hold."""

    status: int
    code: ErrorCode
    message: str
    #: ``Retry-After`` (seconds), for refusals that a retry may pass
    retry_after_s: int | None = None

    def response(self, default_headers: Sequence[tuple[bytes, bytes]] = ()) -> bytes:
        """The whole HTTP/1.1 response: status line, headers (``Connection: close``), body."""
        kind = "rate_limit_error" if self.status == 429 else \
            "invalid_request_error" if self.status < 500 else "server_error"
        body = orjson.dumps({"error": {"message": self.message, "type": kind, "param": None, "code": str(self.code)}})
        parts = [STATUS_LINE[self.status]]
        for name, value in default_headers:
            parts += [name, b": ", value, b"\r\n"]
        if self.retry_after_s is not None:
            parts.append(b"retry-after: %d\r\n" % self.retry_after_s)
        parts += [b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body),
                  body]
        return b"".join(parts)


OVER_CAPACITY = Refusal(503, ErrorCode.overloaded, "this gateway holds too many connections; retry another or "
                        "later", retry_after_s=1)
TOO_MANY_FROM_ADDRESS = Refusal(429, ErrorCode.too_many_requests, "too many unauthenticated connections from "
                                "this address; close some or authenticate them", retry_after_s=1)
TARGET_TOO_LONG = Refusal(414, ErrorCode.invalid_request, "the request target (URL) is too long")
HEAD_TOO_LARGE = Refusal(431, ErrorCode.invalid_request, "the request head (request line and headers) is too "
                         "large")
TOO_MANY_HEADERS = Refusal(431, ErrorCode.invalid_request, "the request has too many header fields")
HEAD_TIMEOUT = Refusal(408, ErrorCode.timeout, "the request head did not arrive in time")


@dataclass(frozen=True)
class EdgeLimits:
    """The bounds of one request head (``SF_MAX_REQUEST_LINE_BYTES``,
    ``SF_MAX_HEADER_BYTES``, ``SF_MAX_HEADER_COUNT``, ``SF_HEADER_TIMEOUT_S``; 0 = none)."""

    max_request_line_bytes: int = 8192
    max_header_bytes: int = 32_768
    max_header_count: int = 100
    header_timeout_s: float = 10.0

    @classmethod
    def from_settings(cls, s: GatewaySettings) -> EdgeLimits:
        return cls(s.max_request_line_bytes, s.max_header_bytes, s.max_header_count, s.header_timeout_s)


class Ticket:
    """One admitted connection's place in its ``EdgeGuard``'s counts, given back once
    (``release``); ``authenticated`` takes it out of its address's count early."""

    __slots__ = ("guard", "address", "released")

    def __init__(self, guard: EdgeGuard, address: str | None) -> None:
        self.guard = guard
        #: the client address it counts against (None: not counted per address, or no longer)
        self.address = address
        self.released = False

    def authenticated(self) -> None:
        """The connection presented a valid API key: it no longer counts against its
        address's cap of connections before auth."""
        if self.address is not None:
            self.guard._leave(self.address)
            self.address = None

    def release(self) -> None:
        """The connection closed."""
        if not self.released:
            self.released = True
            self.guard.open -= 1
            self.authenticated()


class EdgeGuard:
    """The connections open on one process's HTTP port: at most ``max_open`` in all and
    ``max_per_address`` from one client address before they authenticate (0 = no cap).

    Pure bookkeeping, no I/O: the protocol asks ``admit`` in ``connection_made`` and gives
    the ticket back in ``connection_lost``.
    """

    def __init__(self, max_open: int = 0, max_per_address: int = 0) -> None:
        self.max_open = max_open
        self.max_per_address = max_per_address
        #: connections admitted and not yet closed
        self.open = 0
        #: client address -> its admitted connections that have not authenticated
        self.pre_auth: dict[str, int] = {}

    def admit(self, address: str | None) -> Ticket | Refusal:
        """A ticket for a new connection from ``address``, or the refusal it gets."""
        if self.max_open and self.open >= self.max_open:
            return OVER_CAPACITY
        if self.max_per_address and address is not None:
            if self.pre_auth.get(address, 0) >= self.max_per_address:
                return TOO_MANY_FROM_ADDRESS
            self.pre_auth[address] = self.pre_auth.get(address, 0) + 1
        else:
            address = None  # (no cap: no count per address either)
        self.open += 1
        return Ticket(self, address)

    def _leave(self, address: str) -> None:
        n = self.pre_auth.get(address, 0) - 1
        if n > 0:
            self.pre_auth[address] = n
        else:
            self.pre_auth.pop(address, None)


def authenticated(scope: MutableMapping[str, Any]) -> None:
    """The connection of ``scope`` presented a valid API key (``Ticket.authenticated``);
    nothing when the server counts no connections (an in-process test client)."""
    ticket = scope.get(SCOPE_KEY)
    if ticket is not None:
        ticket.authenticated()


class _Throttle:
    """Logs one line per refusal kind at most every ``LOG_EVERY_S``, with the count since."""

    def __init__(self) -> None:
        self.last: dict[int, tuple[float, int]] = {}

    def __call__(self, refusal: Refusal, client: tuple[str, int] | None) -> None:
        now = time.monotonic()
        last, skipped = self.last.get(refusal.status, (-LOG_EVERY_S, 0))
        if now - last < LOG_EVERY_S:
            self.last[refusal.status] = (last, skipped + 1)
            return
        self.last[refusal.status] = (now, 0)
        log.warning("connection refused at the edge", status=refusal.status, reason=refusal.message,
                    client=client[0] if client else None, refused_since_last_line=skipped)


_log_refusal = _Throttle()


class _HeadRefused(Exception):
    """Raised in a parser callback to stop parsing; the refusal is ``_refusal``."""


class EdgeHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with the edge's bounds (see the module's docstring).
    ``edge_protocol`` makes the subclass a server uses, with its limits and guard.

    Per connection it counts the bytes of the request head as they arrive and parses no
    more than ``max_header_bytes`` of it: a head that has not ended by then gets 431
    (httptools itself has no limit, and it joins a long header's pieces at a cost that grows
    with the square of its length; docs/security.md). The request target and the header
    count are checked in the parser's callbacks. A timer armed when the connection opens,
    and when the first byte of each later request head arrives, closes a connection whose
    head has not ended in ``header_timeout_s`` (uvicorn's keep-alive timeout covers the
    silence between requests). A pipelined head that follows a body within one read is
    counted from the next read on (one read is at most 256 KiB).
    """

    limits: ClassVar[EdgeLimits] = EdgeLimits()
    guard: ClassVar[EdgeGuard] = EdgeGuard()

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.ticket: Ticket | None = None
        self._in_head = True  # the bytes arriving now belong to a request head
        self._head_bytes = 0  # ... this many of them so far
        self._header_count = 0
        self._head_timer: TimerHandle | None = None
        self._linger: TimerHandle | None = None
        self._refusal: Refusal | None = None  # decided in a parser callback
        self._refused = False  # a refusal was decided: what the client still sends is dropped

    # -- the connection ----------------------------------------------------------------
    def connection_made(self, transport: Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        admitted = self.guard.admit(self.client[0] if self.client else None)
        if isinstance(admitted, Refusal):
            self._refuse(admitted)
            return
        self.ticket = admitted
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        if self.ticket is not None:
            self.ticket.release()
            self.ticket = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # lingering after a refusal: read and dropped
        self._unset_keepalive_if_required()
        limit = self.limits.max_header_bytes
        while self._in_head:
            if self._head_timer is None:  # the first byte of this head
                self._arm_head_timer()
            room = limit - self._head_bytes if limit > 0 else len(data)
            if len(data) <= room:
                self._head_bytes += len(data)
                break
            head, data = data[:room], data[room:]
            self._head_bytes = limit
            if head and not self._feed(head):
                return
            if self._in_head:  # the head has not ended within the limit: none of the rest is parsed
                self._refuse(HEAD_TOO_LARGE)
                return
            # the head ended within the limit: the rest is its body (or the next head: the loop)
        if data:
            self._feed(data)

    def _feed(self, data: bytes) -> bool:
        """Parse ``data`` (as uvicorn's ``data_received`` does, and the edge's refusals);
        False when this protocol reads no more of the connection (refused, upgraded, failed)."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return False
        except httptools.HttpParserError:
            refusal, self._refusal = self._refusal, None
            if refusal is not None:
                self._refuse(refusal)
            else:
                msg = "Invalid HTTP request received."
                self.logger.warning(msg)
                self.send_400_response(msg)
            return False
        return not (self._refused or self.transport.is_closing())

    def handle_websocket_upgrade(self) -> None:
        """uvicorn's upgrade, the ticket handed to the WebSocket protocol (which gives it
        back when its connection closes: ``gateway.server.LeanWebSocketProtocol``)."""
        self._cancel_head_timer()
        ticket, self.ticket = self.ticket, None
        super().handle_websocket_upgrade()
        if ticket is not None:
            protocol = self.transport.get_protocol()
            if protocol is not self and hasattr(protocol, "edge_ticket"):
                protocol.edge_ticket = ticket
            else:
                ticket.release()

    # -- parser callbacks --------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_count = 0
        if self.ticket is not None:
            self.scope[SCOPE_KEY] = self.ticket  # type: ignore[literal-required]

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if 0 < self.limits.max_request_line_bytes < len(self.url):
            self._refusal = TARGET_TOO_LONG
            raise _HeadRefused

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if 0 < self.limits.max_header_count < self._header_count:
            self._refusal = TOO_MANY_HEADERS
            raise _HeadRefused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True  # what comes next is the next request's head
        self._head_bytes = 0

    # -- refusals and the head timer ---------------------------------------------------
    def _refuse(self, refusal: Refusal) -> None:
        """Answer ``refusal`` and close: at once, or after the response under way (nothing
        may be written into it)."""
        self._cancel_head_timer()
        self._refused = True
        metrics.refusals.labels("edge", str(refusal.code)).inc()
        _log_refusal(refusal, self.client)
        transport = self.transport
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False  # (the response closes the connection when it ends)
            return
        transport.write(refusal.response(self.server_state.default_headers))
        if transport.can_write_eof():
            transport.write_eof()
            self.flow.resume_reading()
            self._linger = self.loop.call_later(LINGER_S, transport.close)
        else:
            transport.close()

    def _arm_head_timer(self) -> None:
        if self.limits.header_timeout_s > 0:
            self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._refused or not self._in_head or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm_head_timer()  # a response is under way: the next head may wait for it
            return
        if self._head_bytes:
            self._refuse(HEAD_TIMEOUT)
        else:  # nothing came: nobody to answer
            self._refused = True
            self.transport.close()


def edge_protocol(settings: GatewaySettings) -> type[EdgeHttpToolsProtocol]:
    """The protocol class for uvicorn's ``http=``: ``EdgeHttpToolsProtocol`` with the limits
    of ``settings`` and a guard of its own (one per server)."""
    guard = EdgeGuard(settings.max_open_connections, settings.max_connections_per_address)
    return type("EdgeHttpToolsProtocol", (EdgeHttpToolsProtocol,),
                {"limits": EdgeLimits.from_settings(settings), "guard": guard, "__module__": __name__})
