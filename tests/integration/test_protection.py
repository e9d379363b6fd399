"""Connection protection and backpressure, against a live gateway."""

# Moved to unit tests (the origin rule is one pure decision, gateway/edge/origin.py; what stays
# here is one live case of each outcome per door, with the request's real Host and scheme).
# Removed -> replaced by:
# - test_websockets_same_origin_only_by_default: the origins of another port, an https page,
#   another name for the host, "null" -> tests/unit/test_origin.py::
#   test_empty_list_refuses_every_other_origin (the same four origins against a ws request);
#   the "*" gateway's WebSocket -> tests/unit/test_origin.py::test_star_allows_any_origin
# - test_http_posts_follow_the_origin_rule: the chat endpoint same-origin and refused, a GET
#   from another origin, the listed gateway's other cases (another origin, its own origin,
#   no Origin) and the "*" gateway -> tests/unit/test_origin.py::
#   test_an_http_request_that_can_change_something_follows_the_origin_rule (refused before
#   the app reads the body: also test_the_guard_answers_403_before_the_app_or_the_body_is_touched,
#   and one live case stays)
# The "*" gateway of the shared fixture went with them.

from __future__ import annotations

import asyncio
import struct
import time
from types import SimpleNamespace

import httpx
import orjson
import pytest
import websockets

from streamfleet.shared.schema import Task
from tests.support.metrics import value
from tests.support.rawws import RawWebSocket
from tests.support.wait import until, until_async
from tests.support.wsclient import Client


@pytest.fixture(scope="module")
def shared(module_fleets):
    """Gateways that differ only in their origin and compression settings, with one echo
    worker, shared by the module's tests that only connect and send requests: ``plain``
    (defaults: same origin only), ``listed`` (SF_ALLOWED_ORIGINS=http://good.example) and
    ``squeezed`` (SF_WS_COMPRESSION on)."""
    fleet = module_fleets()
    gws = SimpleNamespace(plain=fleet.gateway(), listed=fleet.gateway(allowed_origins="http://good.example"),
                          squeezed=fleet.gateway(ws_compression="true"))
    fleet.worker(backend="echo")
    return gws


@pytest.mark.slow
@pytest.mark.both_brokers
async def test_backpressure_refuses_at_threshold_and_accepted_work_completes(fleet, rds, key_prefix):
    # capacity 10 → refusals from a backlog of 8; offered: 30 = 3x the lane's capacity
    gw = fleet.gateway(lane_capacity='{"normal": 10, "high": 10}')
    fleet.worker(backend="echo", echo_delay_ms=100, max_batch=2)
    c = await Client.connect(gw.ws)
    futs = [c.start(f"r{i}", "Once upon a time", max_tokens=4, ignore_eos=True) for i in range(30)]
    results = await asyncio.wait_for(asyncio.gather(*futs), 120)
    accepted = [r for r in results if r.accepted]
    refused = [r for r in results if not r.accepted]
    assert len(accepted) == 8, [r.end for r in results]
    assert sorted(r.accepted["queue_depth"] for r in accepted) == list(range(1, 9))
    for r in refused:
        assert r.end["code"] == "overloaded" and r.end["status"] == 429 and r.end["retry_after_ms"] > 0
    for r in accepted:  # accepted work is never dropped
        assert r.end["type"] == "done" and len(r.tokens) == 4
    await c.close()
    # a task leaves its lane just after its last event (the worker's next round trip)
    lane, t0 = f"{key_prefix}:{{tiny-gpt}}:tasks:normal", time.monotonic()
    while rds.xlen(lane) and time.monotonic() - t0 < 10:
        await asyncio.sleep(0.05)
    assert rds.xlen(lane) == 0


@pytest.mark.slow
async def test_http_overload_is_429_with_retry_after(fleet):
    import httpx

    gw = fleet.gateway(lane_capacity='{"normal": 2, "high": 2}')  # no worker: the backlog stays
    async with httpx.AsyncClient(timeout=30) as http:
        codes = []
        for _ in range(3):
            r = await http.post(gw.http + "/v1/completions", json={"prompt": "hi", "stream": True, "timeout": 1},
                                headers={"Accept": "text/event-stream"})
            codes.append(r.status_code)
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "overloaded"
    assert codes.count(429) == 2  # threshold 80% of 2 → 1 accepted


@pytest.mark.slow
async def test_queue_deadline_expired_task_is_not_run(fleet, rds):
    gw = fleet.gateway()
    c = await Client.connect(gw.ws)
    fut = c.start("late", "Once upon a time", max_tokens=4, timeout=0.3)
    lane = f"{fleet.prefix}:{{tiny-gpt}}:tasks:normal"
    [(_, fields)] = await until_async(lambda: rds.xrange(lane), "the task in the lane")
    deadline = Task.decode(fields[b"task"]).deadline
    assert deadline is not None
    await until_async(lambda: time.time() > deadline + 0.1, "the task's deadline to pass", timeout=5)
    fleet.worker()  # reads the task after its deadline
    res = await asyncio.wait_for(fut, 30)
    assert res.end["type"] == "error" and res.end["code"] == "timeout", res.end
    assert res.tokens == []
    await c.close()


async def test_connection_cap_per_gateway(fleet):
    gw = fleet.gateway(max_connections=2)
    a = await websockets.connect(gw.ws)
    b = await websockets.connect(gw.ws)
    c = await websockets.connect(gw.ws)
    err = orjson.loads(await c.recv())
    assert err["type"] == "error" and err["code"] == "overloaded"
    with pytest.raises(websockets.ConnectionClosed) as e:
        await c.recv()
    assert e.value.rcvd.code == 1013
    await a.close()
    await until_async(lambda: value(httpx.get(gw.metrics_url, timeout=5).text, "streamfleet_active_connections") == 1,
                      "the closed connection's slot given back")
    d = await websockets.connect(gw.ws)  # a slot came free
    await d.send('{"type":"ping"}')
    assert orjson.loads(await d.recv())["type"] == "pong"
    for w in (b, d):
        await w.close()


async def test_idle_connection_is_closed(fleet):
    gw = fleet.gateway(ws_idle_timeout_s=0.5)
    ws = await websockets.connect(gw.ws)
    t0 = time.monotonic()
    with pytest.raises(websockets.ConnectionClosed) as e:
        await asyncio.wait_for(ws.recv(), 10)
    assert e.value.rcvd.code == 1000 and "idle" in e.value.rcvd.reason
    assert 0.4 < time.monotonic() - t0 < 5


@pytest.mark.slow
async def test_connection_busy_is_not_idle_and_max_age_closes(fleet):
    gw = fleet.gateway(ws_idle_timeout_s=0.5, ws_max_age_s=2.5, ws_max_age_grace_s=5)
    fleet.worker(backend="echo", echo_delay_ms=50)
    c = await Client.connect(gw.ws)
    res = await c.generate("long", max_tokens=20, ignore_eos=True)  # ~1 s, longer than the idle limit
    assert res.end["type"] == "done" and len(res.tokens) == 20
    t0 = time.monotonic()
    await asyncio.wait_for(c.reader, 10)
    code = c.ws.close_code
    assert code in (1000, 1001)
    assert time.monotonic() - t0 < 6


async def test_max_age_closes_with_1001(fleet):
    gw = fleet.gateway(ws_idle_timeout_s=30, ws_max_age_s=0.5)
    ws = await websockets.connect(gw.ws)
    with pytest.raises(websockets.ConnectionClosed) as e:
        await asyncio.wait_for(ws.recv(), 10)
    assert e.value.rcvd.code == 1001 and "age" in e.value.rcvd.reason


async def test_origin_allowlist(shared):
    gw = shared.listed
    bad = await websockets.connect(gw.ws, origin="http://evil.example")
    assert orjson.loads(await bad.recv())["code"] == "forbidden"
    with pytest.raises(websockets.ConnectionClosed) as e:
        await bad.recv()
    assert e.value.rcvd.code == 1008
    good = await websockets.connect(gw.ws, origin="http://good.example")
    await good.send('{"type":"ping"}')
    assert orjson.loads(await good.recv())["type"] == "pong"
    await good.close()


async def _ws_origin_outcome(url: str, origin: str | None) -> str:
    """"pong" when a WebSocket opened with this Origin is served, else the error code."""
    ws = await websockets.connect(url, **({"origin": origin} if origin is not None else {}))
    try:
        try:
            await ws.send('{"type":"ping"}')
        except websockets.ConnectionClosed:
            pass  # refused: the error frame that came first is still read below
        frame = orjson.loads(await ws.recv())
        if frame["type"] == "pong":
            return "pong"
        with pytest.raises(websockets.ConnectionClosed) as e:
            await ws.recv()
        assert e.value.rcvd.code == 1008
        return frame["code"]
    finally:
        await ws.close()


async def test_websockets_same_origin_only_by_default(shared):
    """SF_ALLOWED_ORIGINS empty: a browser page may open a WebSocket only to the gateway
    that served it; clients without an Origin header are not concerned."""
    gw = shared.plain
    assert await _ws_origin_outcome(gw.ws, None) == "pong"
    # the handshake's own Host and scheme make the page that served it the same origin
    assert await _ws_origin_outcome(gw.ws, f"http://127.0.0.1:{gw.port}") == "pong"
    assert await _ws_origin_outcome(gw.ws, "http://evil.example") == "forbidden"


async def test_http_posts_follow_the_origin_rule(shared):
    import httpx

    gw = shared.plain
    body = {"prompt": "hi", "max_tokens": 2, "ignore_eos": True}

    async with httpx.AsyncClient(timeout=30) as http:
        async def post(origin: str | None, g=gw) -> httpx.Response:
            headers = {"Origin": origin} if origin is not None else {}
            return await http.post(g.http + "/v1/completions", json=body, headers=headers)

        same = f"http://127.0.0.1:{gw.port}"
        assert (await post(None)).status_code == 200
        assert (await post(same)).status_code == 200  # the request's own Host and scheme
        r = await post("http://evil.example")
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert err["code"] == "forbidden" and "evil.example" in err["message"], err
        # refused before the body is read or anything is enqueued
        r = await http.post(gw.http + "/v1/completions", content=b"{not json", headers={"Origin": "http://evil.example"})
        assert r.status_code == 403
        # a streamed answer passes the guard unbuffered
        async with http.stream("POST", gw.http + "/v1/completions", json={**body, "stream": True},
                               headers={"Origin": same}) as r:
            assert r.status_code == 200
            assert "data: [DONE]" in "".join([chunk async for chunk in r.aiter_text()])
        # SF_ALLOWED_ORIGINS reaches the guard: a listed origin the default would refuse
        assert (await post("http://good.example", shared.listed)).status_code == 200


def test_unanswered_pings_close_the_connection(fleet):
    gw = fleet.gateway(ws_ping_interval_s=0.3, ws_ping_timeout_s=0.3)
    raw = RawWebSocket("127.0.0.1", gw.port)
    assert raw.status == 101
    t0 = time.monotonic()
    code, _reason = raw.wait_close()  # never answers the server's pings
    assert time.monotonic() - t0 < 5
    assert code in (None, 1011)
    raw.close()


def test_frame_limits_and_invalid_utf8(fleet):
    gw = fleet.gateway(max_frame_bytes=1000)
    raw = RawWebSocket("127.0.0.1", gw.port)
    raw.send_frame(0x1, orjson.dumps({"type": "generate", "id": "big", "prompt": "x" * 1500}))
    op, payload = raw.recv_frame()
    assert op == 0x1 and orjson.loads(payload)["code"] == "frame_too_large"
    raw.send_frame(0x2, b"\xff\xfe binary")
    op, payload = raw.recv_frame()
    assert orjson.loads(payload)["code"] == "binary_frame"
    raw.send_frame(0x1, b'{"type":"ping"}')
    assert orjson.loads(raw.recv_frame()[1])["type"] == "pong"
    # beyond the transport limit (4x the frame limit) the connection closes with 1009
    raw.send_frame(0x1, b'"' + b"y" * 5000 + b'"')
    assert raw.wait_close()[0] == 1009
    raw.close()
    # invalid UTF-8 in a text frame breaks RFC 6455: closed with 1007, the gateway lives on
    raw = RawWebSocket("127.0.0.1", gw.port)
    raw.send_frame(0x1, b'{"type":"ping","x":"\xc3\x28"}')
    assert raw.wait_close()[0] == 1007
    raw.close()
    raw = RawWebSocket("127.0.0.1", gw.port)
    raw.send_frame(0x1, b'{"type":"ping"}')
    assert orjson.loads(raw.recv_frame()[1])["type"] == "pong"
    raw.close()


@pytest.mark.slow
def test_a_client_that_stops_reading_is_let_go(fleet, rds, key_prefix):
    """A client that never reads: the socket buffers fill, the gateway's writes block
    (backpressure, nothing piles up without bound in the socket layer), the keepalive
    ping goes unanswered, and the gateway drops the connection: its slot on the gateway
    and its requests' slots on the worker are freed, no task stays pending."""
    import socket

    import httpx

    gw = fleet.gateway(ws_ping_interval_s=0.5, ws_ping_timeout_s=0.5, ws_resume_grace_s=0.5)
    fleet.worker(backend="echo", echo_delay_ms=50, max_batch=16)  # 150 tokens: 7.5 s each
    raw = RawWebSocket("127.0.0.1", gw.port)
    raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    for i in range(8):
        raw.send_frame(0x1, orjson.dumps({"type": "generate", "id": f"r{i}", "prompt": "flood " * 50,
                                          "max_tokens": 150, "ignore_eos": True}))
    lane = f"{key_prefix}:{{tiny-gpt}}:tasks:normal"

    def gauge() -> float:
        text = httpx.get(gw.metrics_url, timeout=5).text
        line = next(ln for ln in text.splitlines() if ln.startswith("streamfleet_active_connections "))
        return float(line.split()[1])

    deadline = time.monotonic() + 5
    while rds.xpending(lane, "workers")["pending"] == 0:  # the requests are running
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert gauge() == 1
    # never read a byte: within ping interval + timeout (+ resume grace) all is let go
    until(lambda: gauge() == 0 and rds.xpending(lane, "workers")["pending"] == 0,
          lambda: str((gauge(), rds.xpending(lane, "workers"), gw.log()[-2000:])), timeout=20)
    raw.close()


async def test_per_message_deflate_is_declined_unless_enabled_then_small(shared):
    """Browsers offer per-message deflate; a gateway declines it by default (a token frame
    is ~55 bytes, the zlib state ~17 KiB per connection) and accepts it with 512-byte
    windows when SF_WS_COMPRESSION is on (docs/operations.md, "Idle connections")."""
    plain, squeezed = shared.plain, shared.squeezed
    for gw, agreed in ((plain, False), (squeezed, True)):
        async with websockets.connect(gw.ws, compression="deflate") as ws:
            ext = ws.response.headers.get("Sec-WebSocket-Extensions") or ""
            assert ("permessage-deflate" in ext) is agreed, ext
            if agreed:
                assert "server_max_window_bits=9" in ext and "client_max_window_bits=9" in ext, ext
            await ws.send(orjson.dumps({"type": "generate", "id": "a", "prompt": "Once upon a time",
                                        "max_tokens": 24, "ignore_eos": True}).decode())
            frames = []
            while not frames or frames[-1]["type"] not in ("done", "error"):
                frames.append(orjson.loads(await asyncio.wait_for(ws.recv(), 30)))
            assert frames[-1]["type"] == "done" and sum(f["type"] == "token" for f in frames) == 24, frames[-1]


def test_frames_written_straight_to_the_socket_are_whole_unmasked_text_frames(shared):
    """A JSON frame goes straight to the socket (``LeanWebSocketProtocol.send_text_frame``,
    gateway/server.py): each is one final, unmasked text frame whose length takes the
    7-bit form below 126 bytes and the 16-bit form from 126 on (RFC 6455 §5.2), and
    carries one whole JSON document."""
    raw = RawWebSocket("127.0.0.1", shared.plain.port)
    raw.send_frame(0x1, orjson.dumps({"type": "generate", "id": "a", "prompt": "Once upon a time", "max_tokens": 8,
                                      "ignore_eos": True, "logprobs": True, "top_logprobs": 5}))
    raw.send_frame(0x1, orjson.dumps({"type": "generate", "id": "b", "prompt": "Once", "max_tokens": 8,
                                      "ignore_eos": True}))
    forms, frames, done = set(), [], 0
    while done < 2:
        b0, b1 = raw._read(2)
        assert b0 == 0x81 and not b1 & 0x80, (b0, b1)  # FIN + text; a server never masks
        n = b1 & 0x7F
        if n == 126:
            (n,) = struct.unpack("!H", raw._read(2))
            assert n >= 126
            forms.add("16-bit")
        else:
            assert n < 126
            forms.add("7-bit")
        frames.append(orjson.loads(raw._read(n)))
        done += frames[-1]["type"] in ("done", "error")
    assert [f["type"] for f in frames if f["type"] in ("done", "error")] == ["done", "done"], frames[-3:]
    assert sum(f["type"] == "token" for f in frames) == 16 and forms == {"7-bit", "16-bit"}
    raw.close()
