"""The edge before auth (gateway/edge/guard.py), without processes: the guard's counts, the
refusal responses, and the bounded httptools protocol over a fake transport."""

from __future__ import annotations

import asyncio

import h11
import orjson
import pytest
import uvicorn
from uvicorn.server import ServerState

from streamfleet.gateway.edge.guard import (
    HEAD_TOO_LARGE,
    OVER_CAPACITY,
    SCOPE_KEY,
    TOO_MANY_FROM_ADDRESS,
    EdgeGuard,
    EdgeHttpToolsProtocol,
    EdgeLimits,
    Refusal,
    Ticket,
    authenticated,
)
from streamfleet.shared.errors import ErrorCode
from streamfleet.shared.settings import GatewaySettings
from tests.support.wait import until_async


# -- the guard ---------------------------------------------------------------------------
def test_the_guard_caps_all_connections_and_gives_places_back():
    guard = EdgeGuard(max_open=2)
    a, b = guard.admit("10.0.0.1"), guard.admit("10.0.0.2")
    assert isinstance(a, Ticket) and isinstance(b, Ticket) and guard.open == 2
    assert guard.admit("10.0.0.3") is OVER_CAPACITY
    a.release()
    a.release()  # once only
    assert guard.open == 1
    assert isinstance(guard.admit("10.0.0.3"), Ticket)


def test_the_guard_caps_connections_per_address_until_they_authenticate():
    guard = EdgeGuard(max_per_address=2)
    first, second = guard.admit("10.0.0.1"), guard.admit("10.0.0.1")
    assert guard.admit("10.0.0.1") is TOO_MANY_FROM_ADDRESS
    assert isinstance(guard.admit("10.0.0.2"), Ticket)  # another address has its own count
    first.authenticated()
    first.authenticated()
    assert guard.pre_auth["10.0.0.1"] == 1 and guard.open == 3  # still open, no longer counted per address
    third = guard.admit("10.0.0.1")
    assert isinstance(third, Ticket)
    first.release()  # it had left the address's count already
    assert guard.pre_auth["10.0.0.1"] == 2
    second.release()
    third.release()
    assert "10.0.0.1" not in guard.pre_auth


def test_no_caps_count_only_the_open_connections():
    guard = EdgeGuard()
    tickets = [guard.admit("10.0.0.1") for _ in range(1000)]
    assert all(isinstance(t, Ticket) for t in tickets) and guard.open == 1000 and guard.pre_auth == {}
    assert isinstance(guard.admit(None), Ticket)


def test_authenticated_takes_the_ticket_of_the_scope():
    guard = EdgeGuard(max_per_address=1)
    ticket = guard.admit("10.0.0.1")
    authenticated({SCOPE_KEY: ticket})
    authenticated({})  # (an in-process test client: no ticket)
    assert isinstance(guard.admit("10.0.0.1"), Ticket)


@pytest.mark.parametrize("refusal", [OVER_CAPACITY, TOO_MANY_FROM_ADDRESS, HEAD_TOO_LARGE,
                                     Refusal(408, ErrorCode.timeout, "slow")])
def test_a_refusal_is_a_whole_http_response_that_closes(refusal):
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="GET", target="/", headers=[("Host", "gw")]))
    client.send(h11.EndOfMessage())
    client.receive_data(refusal.response([(b"server", b"uvicorn")]))
    response, data = client.next_event(), client.next_event()
    assert client.next_event() == h11.EndOfMessage()
    assert response.status_code == refusal.status
    headers = dict(response.headers)
    assert headers[b"connection"] == b"close" and headers[b"server"] == b"uvicorn"
    assert (headers.get(b"retry-after") is not None) == (refusal.retry_after_s is not None)
    error = orjson.loads(data.data)["error"]
    assert error["code"] == str(refusal.code) and error["message"] == refusal.message
    assert error["type"] == {429: "rate_limit_error", 503: "server_error"}.get(refusal.status, "invalid_request_error")


# -- the protocol, over a fake transport -------------------------------------------------
class FakeTransport(asyncio.Transport):
    def __init__(self, protocol=None, peer=("10.0.0.1", 50000)) -> None:
        super().__init__()
        self.protocol = protocol
        self.peer = peer
        self.written = b""
        self.closed = False
        self.eof = False

    def get_extra_info(self, name, default=None):
        return {"peername": self.peer, "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def write(self, data) -> None:
        assert not self.eof, "written after write_eof"
        self.written += bytes(data)

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_protocol(self):
        return self.protocol

    def set_protocol(self, protocol) -> None:
        self.protocol = protocol


async def echo_length(scope, receive, send) -> None:
    """An ASGI app that answers the length of the body it read."""
    if scope["type"] == "lifespan":
        return
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": str(len(body)).encode()})


class Spied(EdgeHttpToolsProtocol):
    """Records the length of every piece handed to the parser."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fed: list[int] = []

    def _feed(self, data: bytes) -> bool:
        self.fed.append(len(data))
        return super()._feed(data)


def _protocol(limits: EdgeLimits, guard: EdgeGuard | None = None):
    config = uvicorn.Config(echo_length, log_config=None, lifespan="off")
    cls = type("P", (Spied,), {"limits": limits, "guard": guard or EdgeGuard()})
    proto = cls(config=config, server_state=ServerState(), app_state={}, _loop=asyncio.get_running_loop())
    transport = FakeTransport(proto)
    proto.connection_made(transport)
    return proto, transport


async def _settle(transport: FakeTransport, responses: int = 1, timeout: float = 2.0) -> None:
    """Wait until ``responses`` whole (chunked) responses were written."""
    deadline = asyncio.get_running_loop().time() + timeout
    while transport.written.count(b"\r\n0\r\n\r\n") < responses and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)


def _statuses(written: bytes) -> list[int]:
    return [int(line.split(b" ")[1]) for line in written.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]


async def test_a_head_past_the_limit_is_not_parsed_further():
    proto, transport = _protocol(EdgeLimits(max_header_bytes=1024))
    proto.data_received(b"GET / HTTP/1.1\r\nHost: gw\r\nX-Big: ")
    for _ in range(100):  # 100 KiB in 1 KiB pieces: parsing stops at 1 KiB of head
        proto.data_received(b"a" * 1024)
    assert sum(proto.fed) == 1024 and _statuses(transport.written) == [431] and transport.eof
    await asyncio.sleep(0)
    assert not transport.closed  # it lingers (reads and drops) before closing
    proto._linger.cancel()
    transport.close()
    await asyncio.sleep(0)
    assert proto.guard.open == 0


async def test_a_body_after_a_small_head_and_pipelined_requests_pass():
    proto, transport = _protocol(EdgeLimits(max_header_bytes=256))
    body = b"x" * 5000
    post = b"POST / HTTP/1.1\r\nHost: gw\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    proto.data_received(post + b"GET / HTTP/1.1\r\nHost: gw\r\n\r\n")  # one read: head, body, next head
    await _settle(transport, 2)
    assert _statuses(transport.written) == [200, 200] and b"5000" in transport.written, transport.written
    assert not transport.closed


async def test_the_target_and_the_header_count_are_bounded():
    proto, transport = _protocol(EdgeLimits(max_request_line_bytes=100))
    proto.data_received(b"GET /" + b"a" * 60)
    assert transport.written == b""
    proto.data_received(b"a" * 60 + b" HTTP/1.1\r\n")
    assert _statuses(transport.written) == [414]
    proto, transport = _protocol(EdgeLimits(max_header_count=3))
    proto.data_received(b"GET / HTTP/1.1\r\nA: 1\r\nB: 2\r\nC: 3\r\nD: 4\r\n\r\n")
    assert _statuses(transport.written) == [431] and b"too many header fields" in transport.written
    proto, transport = _protocol(EdgeLimits(max_header_count=3))
    proto.data_received(b"GET / HTTP/1.1\r\nA: 1\r\nB: 2\r\nC: 3\r\n\r\n")
    await _settle(transport)
    assert _statuses(transport.written) == [200]


async def test_malformed_input_is_still_uvicorns_400():
    proto, transport = _protocol(EdgeLimits())
    proto.data_received(b"NOT HTTP AT ALL\r\n\r\n")
    assert _statuses(transport.written) == [400] and transport.closed


async def test_the_head_timer_closes_a_silent_connection_and_answers_a_slow_head():
    proto, transport = _protocol(EdgeLimits(header_timeout_s=0.05))
    await until_async(lambda: transport.closed, "the silent connection closed", timeout=5)
    assert transport.written == b""  # nothing came: nobody to answer
    proto, transport = _protocol(EdgeLimits(header_timeout_s=0.05))
    proto.data_received(b"GET / HT")
    await until_async(lambda: _statuses(transport.written) == [408], "a 408 for the slow head", timeout=5)
    # a whole head in time stops the timer; the next head's first byte starts it again
    proto, transport = _protocol(EdgeLimits(header_timeout_s=0.1))
    proto.data_received(b"GET / HTTP/1.1\r\nHost: gw\r\n\r\n")
    await _settle(transport)
    # a witness whose head timer started after this one's: once it fired, this one's would have
    _, witness = _protocol(EdgeLimits(header_timeout_s=0.1))
    await until_async(lambda: witness.closed, "the witness's head timer", timeout=5)
    assert _statuses(transport.written) == [200] and not transport.closed
    proto._unset_keepalive_if_required()  # (uvicorn's own keep-alive timer is not under test)
    proto.data_received(b"GE")
    await until_async(lambda: _statuses(transport.written) == [200, 408], "a 408 for the next slow head", timeout=5)


async def test_a_connection_past_the_guard_is_refused_before_it_says_anything():
    guard = EdgeGuard(max_open=1)
    first, _ = _protocol(EdgeLimits(), guard)
    second, transport = _protocol(EdgeLimits(), guard)
    assert _statuses(transport.written) == [503] and transport.eof and second.ticket is None
    second.data_received(b"GET / HTTP/1.1\r\nHost: gw\r\n\r\n")  # read and dropped
    assert _statuses(transport.written) == [503]
    second._linger.cancel()
    assert guard.open == 1 and first.ticket is not None
    await asyncio.sleep(0)


async def test_the_ticket_is_in_the_request_scope():
    guard = EdgeGuard(max_per_address=1)
    proto, transport = _protocol(EdgeLimits(), guard)
    proto.data_received(b"GET / HTTP/1.1\r\nHost: gw\r\n\r\n")
    assert proto.scope[SCOPE_KEY] is proto.ticket
    authenticated(proto.scope)
    assert guard.pre_auth == {}
    await _settle(transport)


# -- the default limits (SF_MAX_REQUEST_LINE_BYTES, SF_MAX_HEADER_COUNT, SF_MAX_HEADER_BYTES) --
DEFAULTS = EdgeLimits.from_settings(GatewaySettings())


def _get(path: str = "/healthz", extra: bytes = b"") -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\nHost: gw\r\n" + extra + b"\r\n"


def _pieces(data: bytes, size: int = 65536):
    """``data`` as a socket hands it over: in reads of at most ``size`` bytes."""
    return [data[i:i + size] for i in range(0, len(data), size)]


def test_the_default_limits():
    assert (DEFAULTS.max_request_line_bytes, DEFAULTS.max_header_bytes, DEFAULTS.max_header_count) \
        == (8192, 32_768, 100)


@pytest.mark.parametrize("head,status,what", [
    (_get("/" + "a" * 9000), 414, b"target"),                                             # past 8 KiB of target
    (_get(extra=b"".join(b"X-H%d: 1\r\n" % i for i in range(150))), 431, b"header fields"),  # past 100 fields
    (_get(extra=b"".join(b"X-H%d: %s\r\n" % (i, b"b" * 500) for i in range(80))), 431, b"head"),  # past 32 KiB
], ids=["target", "count", "bytes"])
async def test_a_head_past_a_default_limit_is_refused_and_closed(head, status, what):
    proto, transport = _protocol(DEFAULTS)
    for piece in _pieces(head, 4096):
        proto.data_received(piece)
    assert _statuses(transport.written) == [status] and transport.eof
    response_head, _, body = transport.written.partition(b"\r\n\r\n")
    assert b"connection: close" in response_head.lower()
    error = orjson.loads(body)["error"]
    assert error["code"] == "invalid_request" and what in error["message"].encode()
    if proto._linger is not None:
        proto._linger.cancel()


async def test_a_head_just_within_every_default_limit_is_served_and_kept_alive():
    fits = _get("/healthz?" + "q" * 7000, extra=b"".join(b"X-H%d: %s\r\n" % (i, b"c" * 200) for i in range(98)))
    proto, transport = _protocol(DEFAULTS)
    for n in (1, 2):  # two requests on the one connection
        for piece in _pieces(fits, 4096):
            proto.data_received(piece)
        await _settle(transport, n)
        assert _statuses(transport.written) == [200] * n
    assert not transport.closed and not transport.eof


async def test_a_long_body_after_a_small_head_is_the_bodys_business():
    body = orjson.dumps({"prompt": "x" * 200_000})
    request = b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    proto, transport = _protocol(DEFAULTS)
    for piece in _pieces(request):
        proto.data_received(piece)
    await _settle(transport)
    assert _statuses(transport.written) == [200] and str(len(body)).encode() in transport.written
