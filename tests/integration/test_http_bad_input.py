"""Bad input at the gateway's edge: malformed HTTP bodies, clients that leave mid-body,
invalid or oversized WebSocket frames, and readiness while pub/sub is down. Each gets a
4xx (or a close code) and a quiet log, never a 500 or a traceback, and the gateway and
its keep-alive connections carry on."""

# Moved to unit tests (the decision is pure; what stays here is the door's own parsing, one
# live case per stage, and what needs the process). Removed -> replaced by:
# - test_malformed_body_is_4xx_with_an_openai_error, 40 of the 46 cases of stream flags,
#   prompt, messages and other fields (and the 64-bit seed) -> tests/unit/
#   test_openai_mapping.py::test_a_bad_body_is_a_4xx_openai_error_with_its_code (BAD_BODIES:
#   all 46, the same bytes, X-Priority and codes, through stream_flags, choice_counts,
#   request_payload and Validator.check in the door's order; 6 stay here, one per stage)
# - test_malformed_body_is_4xx_with_an_openai_error, the 16 cases of a body that is not an
#   object -> test_not_an_object_gets_the_same_code_on_every_transport (here: the same 8
#   bodies on both endpoints, now checking the whole OpenAI error body) and
#   tests/unit/test_protocol.py::test_json_that_is_not_an_object_is_an_invalid_frame
# - test_frame_limit_counts_utf8_bytes (a gateway of its own) ->
#   tests/unit/test_protocol.py::test_frame_limit_counts_utf8_bytes_not_characters and
#   tests/unit/test_session.py::test_the_frame_limit_is_the_gateways_setting (the message's
#   byte count, the same text in ASCII reaching validation); the setting reaching a live
#   gateway: tests/integration/test_protection.py::test_frame_limits_and_invalid_utf8

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from pathlib import Path

import httpx
import orjson
import pytest
import redis
from websockets.sync.client import connect

from streamfleet.launcher import EmbeddedRedis
from tests.support.fleet import FleetFactory
from tests.support.rawws import RawWebSocket
from tests.support.wait import until
from tests.support.wsclient import Client

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"

#: valid JSON that is not an object: the WebSocket answers these with ``invalid_frame``
NOT_OBJECTS = [b"[]", b"0", b"null", b"true", b'"x"', b"1e308", b'[{"prompt":"x"}]', b'[{"messages":[]}]']


def _j(v: object) -> bytes:
    return orjson.dumps(v)


#: (endpoint, raw body, extra headers, expected code): what the door itself decides (a body
#: that is not JSON, a bad Last-Event-ID, in the door's order), and one live case of each
#: stage the rest goes through (stream flags, choice counts, mapping, validation, the
#: X-Priority header); every other bad body is in tests/unit/test_openai_mapping.py
#: (BAD_BODIES), a body that is not an object in test_not_an_object_gets_the_same_code_...
MALFORMED = [
    # not JSON at all
    (COMPLETIONS, b"", {}, "invalid_json"),
    (COMPLETIONS, b"{", {}, "invalid_json"),
    (CHAT, b"\xff\xfe", {}, "invalid_json"),
    (COMPLETIONS, b'{"prompt": "\xc3\x28"}', {}, "invalid_json"),
    (COMPLETIONS, b"[" * 5000 + b"]" * 5000, {}, "invalid_json"),
    # one of each stage after the parse
    (COMPLETIONS, _j({"prompt": "x", "stream": "yes"}), {}, "invalid_type"),
    (COMPLETIONS, _j({"prompt": "x", "n": 17}), {}, "out_of_range"),
    (COMPLETIONS, _j({"prompt": ["a", 1]}), {}, "invalid_type"),
    (CHAT, _j({"messages": []}), {}, "invalid_type"),
    (COMPLETIONS, _j({"prompt": "x", "model": "../tiny-gpt"}), {}, "model_not_found"),
    (COMPLETIONS, _j({"prompt": "x"}), {"X-Priority": "urgent"}, "out_of_range"),
    # a reconnecting SSE client (Last-Event-ID) with a bad body or header
    (COMPLETIONS, b"[]", {"Last-Event-ID": "abc:3"}, "invalid_frame"),
    (CHAT, b'"x"', {"Last-Event-ID": "abc:3"}, "invalid_frame"),
    (COMPLETIONS, _j({"prompt": "x", "stream": "yes"}), {"Last-Event-ID": "abc:3"}, "invalid_type"),
    (COMPLETIONS, _j({"prompt": "x"}), {"Last-Event-ID": "abc:3"}, "invalid_request"),
    (COMPLETIONS, _j({"prompt": "x", "stream": True}), {"Last-Event-ID": "no-colon"}, "invalid_request"),
    (COMPLETIONS, _j({"prompt": "x", "stream": True, "model": 5}), {"Last-Event-ID": "a/b:1"}, "invalid_request"),
]


@pytest.fixture(scope="module")
def edge(redis_server, tiny_spec, tmp_path_factory):
    """One gateway (and an echo worker) shared by the tests that only need answers."""
    factory = FleetFactory(redis_server.url, f"sfbad{os.getpid()}", tmp_path_factory.mktemp("edge"))
    gw = factory.gateway()
    factory.worker(backend="echo")
    yield gw
    factory.close()


def _assert_openai_error(r: httpx.Response, code: str) -> None:
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == code, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]


@pytest.mark.parametrize("path,body,headers,code", MALFORMED,
                         ids=[f"{i}-{'chat' if p == CHAT else 'cmpl'}-{b[:24]!r}"
                              for i, (p, b, _h, _c) in enumerate(MALFORMED)])
def test_malformed_body_is_4xx_with_an_openai_error(edge, path, body, headers, code):
    r = httpx.post(edge.http + path, content=body, timeout=30,
                   headers={"Content-Type": "application/json", **headers})
    _assert_openai_error(r, code)
    assert edge.alive()


def test_not_an_object_gets_the_same_code_on_every_transport(edge):
    with connect(edge.ws) as ws:
        for body in NOT_OBJECTS:
            ws.send(body.decode())
            frame = orjson.loads(ws.recv(timeout=10))
            assert frame["type"] == "error" and frame["code"] == "invalid_frame", (body, frame)
    with httpx.Client(base_url=edge.http, timeout=30) as http:
        for body in NOT_OBJECTS:
            for path in (COMPLETIONS, CHAT):
                r = http.post(path, content=body, headers={"Content-Type": "application/json"})
                assert r.status_code == 400, (path, body, r.status_code, r.text)
                _assert_openai_error(r, "invalid_frame")
    assert edge.alive()


def _local_port(r: httpx.Response) -> int:
    return r.extensions["network_stream"].get_extra_info("client_addr")[1]


def test_bad_body_keeps_the_keepalive_connection(edge):
    with httpx.Client(base_url=edge.http, timeout=30, limits=httpx.Limits(max_connections=1)) as http:
        bad = http.post(COMPLETIONS, content=b"[]", headers={"Content-Type": "application/json"})
        # the next request on the pool must not meet a connection the server dropped
        good = http.post(COMPLETIONS, json={"prompt": "Once upon a time", "max_tokens": 3, "ignore_eos": True})
        assert good.status_code == 200, good.text
        assert bad.status_code == 400 and bad.headers.get("connection", "").lower() != "close", bad.text
        assert good.json()["usage"]["completion_tokens"] == 3
        assert _local_port(good) == _local_port(bad)  # the same pooled connection served both


def _read_response(sock: socket.socket, buf: bytes = b"") -> tuple[int, bytes, bytes]:
    """One HTTP/1.1 response with a Content-Length: (status, body, bytes left over)."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response; got {buf!r}")
        buf += chunk
    head, rest = buf.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                  if line.lower().startswith(b"content-length:"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed mid-body")
        rest += chunk
    return int(head.split(b" ")[1]), rest[:length], rest[length:]


def test_bad_body_then_good_request_on_one_raw_socket(edge):
    """Without a pool in between: the second request goes on the very socket of the first."""
    host = f"127.0.0.1:{edge.port}"
    with socket.create_connection(("127.0.0.1", edge.port), timeout=30) as sock:
        for body in NOT_OBJECTS[:3]:
            sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            status, payload, left = _read_response(sock)
            assert status == 400 and orjson.loads(payload)["error"]["code"] == "invalid_frame", payload
            assert not left
        sock.sendall(f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        status, payload, _ = _read_response(sock)
        assert status == 200 and orjson.loads(payload)["status"] == "ok"


def _assert_quiet(log: str) -> None:
    assert "Traceback" not in log, log
    assert "unhandled error" not in log, log
    assert "Exception in ASGI application" not in log, log


def test_client_that_leaves_mid_body_is_not_an_error(fleet):
    gw = fleet.gateway()
    for path in (COMPLETIONS, CHAT):
        with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{gw.port}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: 100000\r\n\r\n".encode() + b'{"prompt": "' + b"x" * 2000)
            time.sleep(0.2)  # the handler is waiting in request.body() when the socket goes
    r = httpx.get(gw.http + "/healthz", timeout=10)
    assert r.status_code == 200
    # a real clock window: a (wrongly) logged traceback would reach the log file in this
    # time; nothing marks that it will not come
    time.sleep(0.5)
    assert gw.alive()
    _assert_quiet(gw.log(None))


def test_invalid_utf8_text_frame_closes_1007_quietly(fleet):
    gw = fleet.gateway()
    raw = RawWebSocket("127.0.0.1", gw.port)
    raw.send_frame(0x1, b"\xff\xfe")
    assert raw.wait_close()[0] == 1007
    raw.close()
    raw = RawWebSocket("127.0.0.1", gw.port)  # a new connection works
    raw.send_frame(0x1, b'{"type":"ping"}')
    assert orjson.loads(raw.recv_frame()[1])["type"] == "pong"
    raw.close()
    assert httpx.get(gw.http + "/healthz", timeout=10).status_code == 200
    time.sleep(0.3)  # a real clock window, as above: time for a (wrongly) logged traceback
    _assert_quiet(gw.log(None))


@pytest.mark.slow
async def test_readyz_waits_for_the_pubsub_connection(own_redis, tiny_spec, tmp_path):
    """Redis restarts: /readyz must not say ready before this gateway's pub/sub
    connection is back, since no WebSocket or HTTP request can get its events until then."""
    prefix = "sfready"
    fleet = FleetFactory(own_redis.url, prefix, tmp_path)
    restarted = None
    try:
        gw = fleet.gateway()
        w = fleet.worker(backend="echo")
        workers_key = f"{prefix}:workers:tiny-gpt"
        with redis.Redis.from_url(own_redis.url) as r:
            heartbeats = r.hgetall(workers_key)
        assert heartbeats
        async with httpx.AsyncClient(base_url=gw.http, timeout=15) as http:
            assert (await http.get("/readyz")).status_code == 200

            own_redis.proc.terminate()
            own_redis.proc.wait(10)
            # down long enough for the gateway's pub/sub reconnect backoff to reach its 2 s cap
            t_end = time.monotonic() + 5
            while time.monotonic() < t_end:
                r = await http.get("/readyz")
                assert r.status_code == 503, r.text
                await asyncio.sleep(0.25)  # the pace of the checks through the 5 s clock window

            restarted = EmbeddedRedis(port=own_redis.port, binary=own_redis.binary).start()
            # the worker's heartbeat is back at once (as a worker that reconnects first would
            # write it), so Redis and the worker check pass while the gateway's pub/sub
            # connection still waits out its backoff
            with redis.Redis.from_url(own_redis.url) as r:
                now = time.time()
                r.hset(workers_key, mapping={wid: orjson.dumps({**orjson.loads(blob), "heartbeat": now})
                                             for wid, blob in heartbeats.items()})
            deadline = time.monotonic() + 30
            reasons = []
            while True:
                r = await http.get("/readyz")
                if r.status_code == 200:
                    break
                reasons.append(r.json().get("reason"))
                assert time.monotonic() < deadline, gw.log() + w.log()
                await asyncio.sleep(0.02)
            # ready means ready: a request sent at once gets its events
            c = await Client.connect(gw.ws)
            try:
                res = await c.generate("after", "Once upon a time", max_tokens=3, ignore_eos=True, timeout=15)
            except ConnectionError as exc:
                raise AssertionError(f"/readyz said 200 but the WebSocket was closed; 503 reasons {set(reasons)}") \
                    from exc
            finally:
                await c.close()
            assert res.end["type"] == "done", (res.end, set(reasons))
            h = await http.post(COMPLETIONS, json={"prompt": "Once upon a time", "max_tokens": 3, "ignore_eos": True})
            assert h.status_code == 200, h.text
    finally:
        fleet.close()
        if restarted is not None:
            restarted.stop()


@pytest.mark.slow
async def test_readyz_is_503_while_pubsub_is_refused(own_redis, tiny_spec, tmp_path):
    """Redis up and answering, workers live, but this gateway's pub/sub connection cannot
    come back (here: an ACL that denies every channel, so SUBSCRIBE fails): not ready,
    whatever PING says; ready again once the subscription is back."""
    fleet = FleetFactory(own_redis.url, "sfacl", tmp_path)
    try:
        gw = fleet.gateway()
        w = fleet.worker(backend="echo")
        async with httpx.AsyncClient(base_url=gw.http, timeout=15) as http:
            assert (await http.get("/readyz")).status_code == 200
            with redis.Redis.from_url(own_redis.url) as r:
                # no channel allowed any more; commands and keys as before
                r.execute_command("ACL", "SETUSER", "default", "resetchannels")
                r.execute_command("ACL", "LOG", "RESET")
                for client in r.client_list():
                    if client["name"].startswith("sf-gateway-") and client["name"].endswith("-pubsub"):
                        r.client_kill_filter(_id=client["id"])
                deadline = time.monotonic() + 10
                while (ready := await http.get("/readyz")).status_code == 200:
                    assert time.monotonic() < deadline, "/readyz stays 200 while pub/sub is down"
                    await asyncio.sleep(0.05)
                assert ready.status_code == 503 and ready.json()["reason"] == "pub/sub connection down", ready.text
                # it stays down while the ACL refuses the subscription: the gateway tried again, refused
                until(lambda: any(e.get("reason") == "channel" for e in r.acl_log()),
                      "the gateway's subscription refused by the ACL")
                ready = await http.get("/readyz")
                assert ready.status_code == 503 and ready.json()["reason"] == "pub/sub connection down", ready.text
                assert r.ping()  # Redis itself answers all along
                r.execute_command("ACL", "SETUSER", "default", "allchannels")
            deadline = time.monotonic() + 15
            while (await http.get("/readyz")).status_code != 200:
                assert time.monotonic() < deadline, gw.log() + w.log()
                await asyncio.sleep(0.02)
            c = await Client.connect(gw.ws)
            try:
                res = await c.generate("after", "Once upon a time", max_tokens=3, ignore_eos=True, timeout=15)
            finally:
                await c.close()
            assert res.end["type"] == "done", res.end
    finally:
        fleet.close()


def test_gateway_raises_its_open_files_limit(fleet, tmp_path):
    """A container's soft limit of 1024 would stop a gateway at ~1,000 sockets: the
    gateway raises it to the hard limit at start-up and logs both."""
    import resource
    import subprocess
    import sys

    from tests.support.fleet import REPO

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard <= 1024:
        pytest.skip(f"the hard limit here is {hard}: not a container's soft/hard pair")
    port_file = tmp_path / "gw.port"
    log_path = tmp_path / "gw.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamfleet", "gateway", "--port", "0", "--port-file", str(port_file)],
            env=fleet.env(metrics_port=0, grpc_port=0), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            # the gateway starts under a container's low soft limit: set in the child, before exec
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard)))  # noqa: PLW1509
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        soft_now = next(line.split()[3] for line in limits.splitlines() if line.startswith("Max open files"))
        assert soft_now == str(hard), limits
        line = next(json.loads(x) for x in log_path.read_text().splitlines() if '"open files limit"' in x)
        assert (line["raised_from"], line["soft"], line["hard"]) == (1024, hard, hard), line
    finally:
        proc.terminate()
        proc.wait(15)
