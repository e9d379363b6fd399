"""The edge before auth (docs/security.md): what a gateway holds for a client it does not
know yet is bounded — the request head's size, header count and arrival time, the
connections open in all and per address, and on the gRPC port its metadata, connections,
handshake and idle time — and a client past a bound gets a documented answer at once
rather than a hang. Real gateway processes, raw sockets."""

# Moved to unit tests (what the edge protocol decides for a head, over a fake transport with
# the default limits; one live refusal stays). Removed -> replaced by:
# - test_request_line_and_header_count_limits, the 150 header fields (431) and the 40 KB
#   head of small headers (431) -> tests/unit/test_edge.py::
#   test_a_head_past_a_default_limit_is_refused_and_closed[count] and [bytes]
# - test_request_line_and_header_count_limits, a head just within every limit served twice
#   on one connection -> tests/unit/test_edge.py::
#   test_a_head_just_within_every_default_limit_is_served_and_kept_alive

from __future__ import annotations

import asyncio
import collections
import os
import socket
import struct
import threading
import time

import grpc
import orjson
import psutil
import pytest
import websockets

from streamfleet.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc
from tests.support.fleet import FleetFactory
from tests.support.keys import add_key
from tests.support.wait import until

#: the HTTP/2 client preface and an empty SETTINGS frame: a connection that opens no call
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def _connect(port: int, timeout: float = 10.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def _read_all(sock: socket.socket, timeout: float) -> tuple[float, bytes, bool]:
    """Read until EOF or ``timeout``: (seconds taken, bytes read, whether EOF came)."""
    sock.settimeout(timeout)
    start = time.monotonic()
    buf = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return time.monotonic() - start, buf, True
            buf += chunk
    except TimeoutError:
        return time.monotonic() - start, buf, False
    except ConnectionResetError:
        return time.monotonic() - start, buf, True


def _exchange(port: int, data: bytes, timeout: float = 10.0) -> tuple[float, bytes, bool]:
    with _connect(port) as sock:
        sock.sendall(data)
        return _read_all(sock, timeout)


def _status(response: bytes) -> int:
    assert response.startswith(b"HTTP/1.1 "), response[:200]
    return int(response.split(b" ", 2)[1])


def _error_code(response: bytes) -> str:
    head, _, body = response.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower(), head
    return orjson.loads(body)["error"]["code"]


def _h2_frame_types(data: bytes) -> list[int]:
    """The types of the whole HTTP/2 frames in ``data`` (SETTINGS 4, PING 6, GOAWAY 7...)."""
    types = []
    while len(data) >= 9:
        length = struct.unpack("!I", b"\x00" + data[:3])[0]
        types.append(data[3])
        data = data[9 + length:]
    return types


def _get(path: str = "/healthz", extra: bytes = b"") -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\nHost: gw\r\n" + extra + b"\r\n"


def _until_status(port: int, status: int, what: str) -> None:
    """Ask (``Connection: close``) until the answer is ``status``: the gateway has seen the
    connections opened or closed before."""
    until(lambda: _status(_exchange(port, _get(extra=b"Connection: close\r\n"))[1]) == status, what)


class _Victim:
    """A client on its own keep-alive connection asking ``/healthz`` in a loop: its
    latencies, and whether every answer came."""

    def __init__(self, port: int) -> None:
        self.sock = _connect(port, timeout=30)
        self.latencies: list[float] = []
        self.failed: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                t = time.monotonic()
                self.sock.sendall(_get())
                buf = b""
                while not buf.endswith(b"}"):
                    chunk = self.sock.recv(4096)
                    assert chunk, "the victim's connection closed"
                    buf += chunk
                assert _status(buf) == 200, buf
                self.latencies.append(time.monotonic() - t)
                time.sleep(0.01)
        except BaseException as exc:  # reported by stop()
            self.failed = exc

    def __enter__(self) -> _Victim:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)
        self.sock.close()
        assert self.failed is None, self.failed
        assert self.latencies, "the victim got no answer"


@pytest.fixture(scope="module")
def edge(redis_server, tiny_spec, tmp_path_factory):
    """A gateway with auth on (nothing an attacker sends here authenticates) and a short
    header timeout; the default head limits."""
    factory = FleetFactory(redis_server.url, f"sfedge{os.getpid()}", tmp_path_factory.mktemp("edge"))
    gw = factory.gateway(auth_enabled="true", header_timeout_s=1.0, grpc_port=0)
    yield gw
    factory.close()


def test_a_huge_header_gets_431_at_once_and_costs_the_others_nothing(edge):
    """32 MiB of one header, unauthenticated: httptools alone joins its pieces for seconds
    of CPU (64 MiB: 5 s, every other client blocked) and then answers 401. The edge reads
    32 KiB of it, answers 431 and closes; a client on another connection is served
    throughout."""
    gateway = psutil.Process(edge.popen.pid)
    cpu_before = sum(gateway.cpu_times()[:2])
    with _Victim(edge.port) as victim:
        until(lambda: len(victim.latencies) >= 3, "the victim's first answers")
        sock = _connect(edge.port, timeout=30)
        sent_at: list[float] = []

        def attack() -> None:
            try:
                sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nX-Big: ")
                sent_at.append(time.monotonic())  # from here on the head grows past the limit
                chunk = b"a" * (1 << 20)
                for _ in range(32):
                    sock.sendall(chunk)
                sock.sendall(b"\r\n\r\n")
            except OSError:
                pass  # the gateway stopped reading: what it had to say was said

        sender = threading.Thread(target=attack, daemon=True)
        sender.start()
        _took, response, eof = _read_all(sock, timeout=20)
        answered = time.monotonic()
        sender.join(20)
        sock.close()
        seen = len(victim.latencies)
        until(lambda: len(victim.latencies) >= seen + 3, "the victim's answers after the attack")
    assert _status(response) == 431 and _error_code(response) == "invalid_request", response[:300]
    assert eof
    assert answered - sent_at[0] < 1.0, f"431 came {answered - sent_at[0]:.2f} s after the header began"
    cpu = sum(gateway.cpu_times()[:2]) - cpu_before
    assert cpu < 1.0, f"the attack cost the gateway {cpu:.2f} s of CPU"
    assert max(victim.latencies) < 1.0, max(victim.latencies)
    assert edge.alive()


def test_request_line_and_header_count_limits(edge):
    # a target past SF_MAX_REQUEST_LINE_BYTES (8 KiB): 414, the connection closed (the
    # other limits, and a head just within them: tests/unit/test_edge.py)
    _, response, eof = _exchange(edge.port, _get("/" + "a" * 9000))
    assert _status(response) == 414 and _error_code(response) == "invalid_request" and eof, response[:300]
    # a long body after a small head is the body's business (413 past SF_MAX_FRAME_BYTES), not the head's
    body = orjson.dumps({"prompt": "x" * 200_000})
    _, response, _ = _exchange(edge.port, b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n"
                               b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    assert _status(response) == 401, response[:300]  # auth is on: the head was read whole


@pytest.mark.slow
def test_a_head_that_does_not_arrive_in_time_is_closed(edge):
    """SF_HEADER_TIMEOUT_S (1 s here): half a request line gets 408 and a close; a
    connection that sends nothing is closed; a kept-alive connection that drips its next
    head byte by byte is closed too (each byte would reset uvicorn's keep-alive timer)."""
    _, response, eof = _exchange(edge.port, b"GET /heal", timeout=10)
    assert eof and _status(response) == 408 and _error_code(response) == "timeout", response

    with _connect(edge.port) as sock:
        took, response, eof = _read_all(sock, timeout=10)
    assert eof and response == b"" and 0.8 < took < 5, (took, response)

    with _connect(edge.port) as sock:
        sock.sendall(_get())
        buf = b""
        while not buf.endswith(b"}"):
            buf += sock.recv(65536)
        assert _status(buf) == 200
        start = time.monotonic()
        closed = None
        for byte in b"GET /healthz HTTP/1.1\r\n":
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed = time.monotonic() - start
                break
            time.sleep(0.2)  # the drip's pace: a byte every 0.2 s, the header timeout is 1 s
        if closed is None:
            took, response, eof = _read_all(sock, timeout=10)
            assert eof and _status(response) == 408, response
            closed = time.monotonic() - start
    assert closed < 4, closed


def test_connections_past_the_per_address_cap_are_refused(fleet):
    """SF_MAX_CONNECTIONS_PER_ADDRESS (3 here): a fourth connection from the address gets
    429 at once; an authenticated WebSocket no longer counts; a closed connection frees
    its place."""
    gw = fleet.gateway(auth_enabled="true", max_connections_per_address=3, grpc_port=0)
    key = add_key(fleet, "edge", "free")

    async def scenario() -> None:
        ws = await websockets.connect(gw.ws, additional_headers={"Authorization": f"Bearer {key}"})
        await ws.send('{"type":"ping"}')
        assert orjson.loads(await ws.recv())["type"] == "pong"
        held = [_connect(gw.port) for _ in range(3)]  # idle, unauthenticated: the address's 3
        await asyncio.to_thread(_until_status, gw.port, 429, "the gateway to count the three held")
        took, response, eof = await asyncio.to_thread(_exchange, gw.port, _get())
        assert _status(response) == 429 and _error_code(response) == "too_many_requests", response
        assert b"retry-after: 1" in response.lower() and eof and took < 1.0, (took, response)
        with pytest.raises(websockets.InvalidStatus) as refused:  # a WebSocket past the cap too
            await websockets.connect(gw.ws, additional_headers={"Authorization": f"Bearer {key}"})
        assert refused.value.response.status_code == 429
        held.pop().close()
        await asyncio.to_thread(_until_status, gw.port, 200, "the closed connection's place")
        await ws.send('{"type":"ping"}')  # the authenticated connection was never in question
        assert orjson.loads(await ws.recv())["type"] == "pong"
        await ws.close()
        for sock in held:
            sock.close()

    asyncio.run(scenario())


def test_connections_past_the_gateway_cap_are_refused_not_hung(fleet):
    """SF_MAX_OPEN_CONNECTIONS (4 here) counts every connection on the HTTP port, idle
    ones and WebSockets alike: the fifth gets 503 and Retry-After at once, plain HTTP or
    a WebSocket handshake."""
    gw = fleet.gateway(max_open_connections=4, grpc_port=0)

    async def scenario() -> None:
        sockets = [await websockets.connect(gw.ws) for _ in range(2)]
        held = [_connect(gw.port) for _ in range(2)]
        await asyncio.to_thread(_until_status, gw.port, 503, "the gateway to count the four open")
        took, response, eof = await asyncio.to_thread(_exchange, gw.port, _get())
        assert _status(response) == 503 and _error_code(response) == "overloaded", response
        assert b"retry-after: 1" in response.lower() and eof and took < 1.0, (took, response)
        with pytest.raises(websockets.InvalidStatus) as refused:
            await websockets.connect(gw.ws, open_timeout=5)
        assert refused.value.response.status_code == 503
        await sockets.pop().close()
        await asyncio.to_thread(_until_status, gw.port, 200, "the closed WebSocket's place")
        await sockets[0].send('{"type":"ping"}')
        assert orjson.loads(await sockets[0].recv())["type"] == "pong"
        await sockets[0].close()
        for sock in held:
            sock.close()

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def grpc_factory(redis_server, tiny_spec, tmp_path_factory):
    factory = FleetFactory(redis_server.url, f"sfgedge{os.getpid()}", tmp_path_factory.mktemp("gedge"))
    factory.worker(backend="echo")
    yield factory
    factory.close()


@pytest.fixture(scope="module")
def grpc_edge(grpc_factory):
    """A gateway (with the echo worker) whose gRPC port has short handshake and idle limits."""
    return grpc_factory.gateway(grpc_max_connections=4, grpc_max_connection_idle_s=1.0, header_timeout_s=1.0)


@pytest.fixture(scope="module")
def grpc_capped(grpc_factory):
    """A gateway whose gRPC port takes at most 4 connections, with handshake and idle limits
    long enough that the held connections stay counted however slow the machine is."""
    return grpc_factory.gateway(grpc_max_connections=4, grpc_max_connection_idle_s=60.0, header_timeout_s=30.0)


@pytest.mark.slow
async def test_more_calls_than_the_stream_limit_on_one_channel_all_complete(grpc_edge):
    """300 concurrent calls on one channel against SF_GRPC_MAX_CONCURRENT_STREAMS (256):
    the client queues the rest until streams end. None is reset (issue 36, item 9: about 40
    were, RST_STREAM REFUSED_STREAM, seen as UNAVAILABLE)."""
    async with grpc.aio.insecure_channel(grpc_edge.grpc) as channel:
        await asyncio.wait_for(channel.channel_ready(), 30)
        stub = pb_grpc.InferenceStub(channel)

        async def call() -> str:
            try:
                tokens = 0
                async for ev in stub.Generate(pb.GenerateRequest(prompt="Once upon a time", max_tokens=8,
                                                                 ignore_eos=True), timeout=120):
                    tokens += ev.WhichOneof("event") == "token"
                return "OK" if tokens == 8 else f"{tokens} tokens"
            except grpc.aio.AioRpcError as exc:
                return f"{exc.code().name}: {exc.details()}"

        outcomes = collections.Counter(await asyncio.gather(*(call() for _ in range(300))))
    assert outcomes == {"OK": 300}, outcomes


async def test_grpc_metadata_connections_handshake_and_idle_are_bounded(grpc_edge):
    # metadata past SF_GRPC_MAX_METADATA_BYTES (16 KiB): refused before the handler runs
    async with grpc.aio.insecure_channel(grpc_edge.grpc) as channel:
        stub = pb_grpc.InferenceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ListModels(pb.ListModelsRequest(), metadata=[("x-big", "a" * 20_000)], timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        assert (await stub.ListModels(pb.ListModelsRequest(), metadata=[("x-ok", "a" * 8000)], timeout=10)).models

    # a TCP connection that never says HTTP/2: closed after the handshake timeout (1 s here)
    with _connect(grpc_edge.grpc_port) as sock:
        took, _, eof = await asyncio.to_thread(_read_all, sock, 10)
    assert eof and took < 5, took
    # an HTTP/2 connection that opens no call: closed after SF_GRPC_MAX_CONNECTION_IDLE_S (1 s)
    with _connect(grpc_edge.grpc_port) as sock:
        sock.sendall(H2_PREFACE)
        took, data, eof = await asyncio.to_thread(_read_all, sock, 10)
    assert eof and took < 5, took
    assert 7 in _h2_frame_types(data), data  # told why: GOAWAY



@pytest.mark.slow
async def test_grpc_connections_past_the_cap_are_closed_at_once(grpc_capped):
    # SF_GRPC_MAX_CONNECTIONS (4): a fifth connection is closed at once, without a handshake
    held = [_connect(grpc_capped.grpc_port) for _ in range(4)]
    try:
        for sock in held:
            sock.sendall(H2_PREFACE)
        for sock in held:  # the server's SETTINGS: it took the connection, and counts it
            sock.settimeout(20)
            assert sock.recv(65536)
        with _connect(grpc_capped.grpc_port) as sock:
            took, data, eof = await asyncio.to_thread(_read_all, sock, 20)
        assert eof and data == b"" and took < 10, (took, data)  # the handshake timeout is 30 s
    finally:
        for sock in held:
            sock.close()
    async with grpc.aio.insecure_channel(grpc_capped.grpc) as channel:  # room again, once the server saw the closes
        assert (await pb_grpc.InferenceStub(channel).ListModels(pb.ListModelsRequest(), timeout=20,
                                                                wait_for_ready=True)).models
