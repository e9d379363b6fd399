"""Tenants stay apart: a request belongs to its API key; another key can neither read nor
cancel it, and an unauthenticated body is refused before it is read."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time

import httpx
import orjson
import pytest
import websockets

from tests.support.keys import TIERS, add_key
from tests.support.wait import until_async
from tests.support.wsclient import Client

PROMPT = "Once upon a time there was a fleet"


@pytest.mark.slow
async def test_another_key_cannot_resume_replay_or_cancel_a_request(fleet):
    a_gw = fleet.gateway(auth_enabled="true", tiers=TIERS)
    b_gw = fleet.gateway(auth_enabled="true", tiers=TIERS)
    fleet.worker(backend="echo", echo_delay_ms=20)
    key_a, key_b = add_key(fleet, "tenant-a", "free"), add_key(fleet, "tenant-b", "free")
    a = await Client.connect(a_gw.ws + "?api_key=" + key_a)
    fut = a.start("r", PROMPT, max_tokens=80, ignore_eos=True)
    while a.results["r"].accepted is None or len(a.results["r"].tokens) < 3:
        await asyncio.sleep(0.005)
    rid = a.results["r"].accepted["request_id"]

    b = await Client.connect(b_gw.ws + "?api_key=" + key_b)
    stolen = await asyncio.wait_for(b.resume("steal", rid, 0), 10)
    assert stolen.end["code"] == "unknown_request" and stolen.end["status"] == 404 and not stolen.tokens
    await b.send({"type": "cancel", "id": "steal"})  # nothing of A's to cancel from here
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.post(b_gw.http + "/v1/completions", json={"prompt": "x", "stream": True},
                            headers={"Authorization": f"Bearer {key_b}", "Last-Event-ID": f"{rid}:0"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_request"
    res = await asyncio.wait_for(fut, 30)
    assert res.end["type"] == "done" and res.end["finish_reason"] == "length"
    assert res.indices == list(range(80))

    # the owner's own key resumes it on the other gateway, as always
    mine = await Client.connect(b_gw.ws + "?api_key=" + key_a)
    again = await asyncio.wait_for(mine.resume("mine", rid, 70), 10)
    assert again.end["type"] == "done" and again.indices == list(range(70, 80))
    for c in (a, b, mine):
        await c.close()


def _raw_post(port: int, headers: str, body: bytes = b"") -> tuple[bytes, float]:
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(headers.encode() + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return data, time.monotonic() - t0


async def test_bodies_are_refused_before_they_are_read(fleet):
    gw = fleet.gateway(auth_enabled="true", tiers=TIERS, max_frame_bytes=100_000)
    key = add_key(fleet, "tenant-a", "free")
    # no key, 400 MiB announced and never sent: 401 at once
    head = ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: 419430400\r\n\r\n")
    data, took = await asyncio.to_thread(_raw_post, gw.port, head)
    assert data.startswith(b"HTTP/1.1 401"), data[:200]
    assert took < 5
    # a key, but more than the limit announced: 413 at once
    head = ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {key}\r\nContent-Length: 419430400\r\n\r\n")
    data, _ = await asyncio.to_thread(_raw_post, gw.port, head)
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
    # chunked, no length announced: reading stops at the limit
    async def chunks():
        for _ in range(100):
            yield b" " * 10_000
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.post(gw.http + "/v1/completions", content=chunks(),
                            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "frame_too_large"
        assert (await http.get(gw.http + "/healthz")).status_code == 200
    assert "Traceback" not in gw.log(tail=None)


# -- every resource bounded per key, and ownership with auth off -----------------------------

#: "one": a single stream and two connections; "slow": a bucket of 3, refilled once a
#: minute; "ceil": max_tokens and timeout ceilings
TENANT_TIERS = ('{"one": {"requests_per_minute": 600, "burst": 50, "max_streams": 1, "max_connections": 2},'
                ' "slow": {"requests_per_minute": 1, "burst": 3, "max_streams": null},'
                ' "ceil": {"requests_per_minute": 600, "burst": 50, "max_streams": null, "max_tokens": 8,'
                '          "max_timeout_s": 5}}')


def _key(fleet, name: str, tier: str) -> str:
    return add_key(fleet, name, tier, tiers=TENANT_TIERS)


def _key_id(key: str) -> str:
    return key.split("-")[1]


async def _started(client: Client, cid: str, tokens: int = 3) -> dict:
    while client.results[cid].accepted is None or len(client.results[cid].tokens) < tokens:
        if client.results[cid].end is not None:
            raise AssertionError(f"ended early: {client.results[cid].end}")
        await asyncio.sleep(0.005)
    return client.results[cid].accepted


async def _closed(ws) -> tuple[list[dict], int]:
    """Frames until the server closes the socket, and the close code."""
    frames = []
    try:
        while True:
            frames.append(orjson.loads(await asyncio.wait_for(ws.recv(), 15)))
    except websockets.ConnectionClosed as exc:
        return frames, exc.rcvd.code if exc.rcvd else None


@pytest.mark.slow
async def test_with_auth_off_only_the_resume_token_resumes(fleet):
    a_gw, b_gw = fleet.gateway(), fleet.gateway()
    fleet.worker(backend="echo", echo_delay_ms=20)
    a = await Client.connect(a_gw.ws)
    fut = a.start("r", PROMPT, max_tokens=60, ignore_eos=True)
    acc = await _started(a, "r")
    rid, token = acc["request_id"], acc["resume_token"]
    assert len(token) == 32

    b = await Client.connect(b_gw.ws)
    no = await asyncio.wait_for(b.resume("no", rid, 0, resume_token=None), 10)
    assert no.end["code"] == "missing_field" and no.end["param"] == "resume_token" and not no.tokens
    wrong = await asyncio.wait_for(b.resume("wrong", rid, 0, resume_token="0" * 32), 10)
    assert wrong.end["code"] == "unknown_request" and not wrong.tokens
    async with httpx.AsyncClient(timeout=10) as http:
        body = {"prompt": "x", "stream": True}
        r = await http.post(b_gw.http + "/v1/completions", json=body, headers={"Last-Event-ID": f"{rid}:0"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "resume_token"
        r = await http.post(b_gw.http + "/v1/completions", json=body,
                            headers={"Last-Event-ID": f"{rid}:{'0' * 32}:0"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_request"
        r = await http.post(b_gw.http + "/v1/completions", json=body, headers={"Last-Event-ID": f"{rid}:{token}:49"})
        assert r.status_code == 200 and r.text.count(f"id: {rid}:{token}:") == 10  # 50..59, ids carry the token
    res = await asyncio.wait_for(fut, 30)
    assert res.end["type"] == "done" and res.indices == list(range(60))
    right = await asyncio.wait_for(b.resume("right", rid, 50), 10)
    assert right.end["type"] == "done" and right.indices == list(range(50, 60))
    for c in (a, b):
        await c.close()


@pytest.mark.slow
async def test_resumes_are_charged_to_the_rate_limit(fleet):
    gw = fleet.gateway(auth_enabled="true", tiers=TENANT_TIERS)
    fleet.worker(backend="echo")
    key = _key(fleet, "slow-tenant", "slow")
    c = await Client.connect(gw.ws + "?api_key=" + key)
    res = await c.generate("r", PROMPT, max_tokens=4, ignore_eos=True)  # token 1 of 3
    rid = res.accepted["request_id"]
    for i in range(2):  # tokens 2 and 3
        again = await asyncio.wait_for(c.resume(f"again-{i}", rid, 0), 10)
        assert again.end["type"] == "done" and again.indices == list(range(4))
    refused = await asyncio.wait_for(c.resume("again-3", rid, 0), 10)
    assert refused.end["code"] == "rate_limited" and refused.end["status"] == 429 and not refused.tokens
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.post(gw.http + "/v1/completions", json={"prompt": "x", "stream": True},
                            headers={"Authorization": f"Bearer {key}", "Last-Event-ID": f"{rid}:0"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited"
    await c.close()


@pytest.mark.slow
async def test_a_stream_slot_is_held_until_the_request_really_ends(fleet, rds):
    gw = fleet.gateway(auth_enabled="true", tiers=TENANT_TIERS, ws_resume_grace_s=3)
    fleet.worker(backend="echo", echo_delay_ms=20)
    key = _key(fleet, "one-stream", "one")
    slots = f"{fleet.prefix}:streams:{_key_id(key)}"
    url = gw.ws + "?api_key=" + key

    # the connection drops while its request runs: the request runs on through the resume
    # grace, and keeps the key's only slot
    ws = await websockets.connect(url)
    await ws.send(orjson.dumps({"type": "generate", "id": "r", "prompt": PROMPT, "max_tokens": 150,
                                "ignore_eos": True}).decode())
    accepted = orjson.loads(await ws.recv())
    assert accepted["type"] == "accepted" and "resume_token" not in accepted  # the key owns it
    for _ in range(5):
        assert orjson.loads(await ws.recv())["type"] == "token"
    ws.transport.abort()
    c = await Client.connect(url)
    conns = f"{fleet.prefix}:conns:{_key_id(key)}"
    await until_async(lambda: rds.zcard(conns) == 1, "the gateway to see the dropped connection", timeout=15)
    refused = await c.generate("more", PROMPT, max_tokens=2, timeout=10)
    assert refused.end["code"] == "too_many_requests", refused.end
    # the resume takes no second slot: the slot moves with the request
    back = await asyncio.wait_for(c.resume("back", accepted["request_id"], 5), 30)
    assert back.end["type"] == "done" and back.indices == list(range(5, 150))
    ok = await c.generate("after", PROMPT, max_tokens=2, ignore_eos=True, timeout=10)
    assert ok.end["type"] == "done"

    # dropped and never resumed: the worker stops it after the grace and gives the slot back
    ws = await websockets.connect(url)
    await ws.send(orjson.dumps({"type": "generate", "id": "r2", "prompt": PROMPT, "max_tokens": 150,
                                "ignore_eos": True}).decode())
    assert orjson.loads(await ws.recv())["type"] == "accepted"
    ws.transport.abort()
    await until_async(lambda: rds.zcard(conns) == 1, "the gateway to see the dropped connection", timeout=15)
    assert rds.zcard(slots) == 1
    refused = await c.generate("more2", PROMPT, max_tokens=2, timeout=10)
    assert refused.end["code"] == "too_many_requests"
    await until_async(lambda: not rds.zcard(slots), "the slot given back after the grace", timeout=15)
    ok = await c.generate("after2", PROMPT, max_tokens=2, ignore_eos=True, timeout=10)
    assert ok.end["type"] == "done"
    await c.close()


@pytest.mark.slow
async def test_revoking_a_key_ends_its_open_connections_and_streams(fleet):
    a_gw = fleet.gateway(auth_enabled="true", tiers=TENANT_TIERS, key_cache_s=1)
    b_gw = fleet.gateway(auth_enabled="true", tiers=TENANT_TIERS, key_cache_s=1)
    fleet.worker(backend="echo", echo_delay_ms=20)
    key = _key(fleet, "to-revoke", "ceil")
    other = _key(fleet, "stays", "ceil")
    ws = await websockets.connect(a_gw.ws + "?api_key=" + key)
    await ws.send(orjson.dumps({"type": "generate", "id": "r", "prompt": PROMPT, "max_tokens": 8,
                                "ignore_eos": True, "stop": []}).decode())
    idle = await websockets.connect(b_gw.ws + "?api_key=" + key)
    kept = await Client.connect(b_gw.ws + "?api_key=" + other)
    accepted = orjson.loads(await asyncio.wait_for(ws.recv(), 15))  # the request runs
    assert accepted["type"] == "accepted", accepted

    out = subprocess.run([sys.executable, "-m", "streamfleet", "keys", "revoke", "to-revoke"],
                         env=fleet.env(tiers=TENANT_TIERS), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    t0 = time.monotonic()
    (frames, code), (idle_frames, idle_code) = await asyncio.gather(_closed(ws), _closed(idle))
    assert time.monotonic() - t0 < 5
    assert code == 1008 and idle_code == 1008
    assert any(f.get("code") == "unauthorized" and "revoked" in f["message"] for f in frames)
    assert any(f.get("code") == "unauthorized" for f in idle_frames)
    # and the key opens nothing new; the other tenant carries on
    r = await http_post(b_gw, key)
    assert r.status_code == 401
    res = await kept.generate("k", PROMPT, max_tokens=3, ignore_eos=True)
    assert res.end["type"] == "done"
    await kept.close()


async def http_post(gw, key: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as http:
        return await http.post(gw.http + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                               headers={"Authorization": f"Bearer {key}"})


@pytest.mark.slow
async def test_revoking_a_key_ends_its_sse_stream(fleet):
    gw = fleet.gateway(auth_enabled="true", tiers=TENANT_TIERS, key_cache_s=1)
    fleet.worker(backend="echo", echo_delay_ms=50)
    key = _key(fleet, "to-revoke", "one")
    lines: list[str] = []
    async with httpx.AsyncClient(timeout=30) as http, http.stream(
            "POST", gw.http + "/v1/completions",
            json={"prompt": PROMPT, "stream": True, "max_tokens": 240, "ignore_eos": True},
            headers={"Authorization": f"Bearer {key}"}) as r:
        async for line in r.aiter_lines():
            lines.append(line)
            if len(lines) == 10:
                out = await asyncio.to_thread(
                    subprocess.run, [sys.executable, "-m", "streamfleet", "keys", "revoke", "to-revoke"],
                    env=fleet.env(tiers=TENANT_TIERS), capture_output=True, text=True, timeout=60)
                assert out.returncode == 0, out.stderr
    text = "\n".join(lines)
    assert "revoked" in text and [line for line in lines if line][-1] == "data: [DONE]"
    assert text.count("data: {") < 200  # ended well before its 240 tokens


@pytest.mark.slow
async def test_connections_per_key_are_capped_across_gateways(fleet, rds):
    a_gw = fleet.gateway(auth_enabled="true", tiers=TENANT_TIERS)
    b_gw = fleet.gateway(auth_enabled="true", tiers=TENANT_TIERS)
    key, other = _key(fleet, "conn-a", "one"), _key(fleet, "conn-b", "one")
    first = await websockets.connect(a_gw.ws + "?api_key=" + key)
    second = await websockets.connect(b_gw.ws + "?api_key=" + key)
    third = await websockets.connect(a_gw.ws + "?api_key=" + key)
    frames, code = await _closed(third)
    assert code == 1013 and frames[0]["code"] == "too_many_requests" and "2 of 2" in frames[0]["message"]
    # another tenant is not affected
    theirs = [await websockets.connect(g.ws + "?api_key=" + other) for g in (a_gw, b_gw)]
    for ws in theirs:
        await ws.send('{"type": "ping"}')
        assert orjson.loads(await ws.recv()) == {"type": "pong"}
    # a closed connection gives its slot back
    await first.close()
    conns = f"{fleet.prefix}:conns:{_key_id(key)}"
    await until_async(lambda: rds.zcard(conns) == 1, "the closed connection's slot given back", timeout=15)
    fourth = await websockets.connect(a_gw.ws + "?api_key=" + key)
    await fourth.send('{"type": "ping"}')
    assert orjson.loads(await fourth.recv()) == {"type": "pong"}
    for ws in (second, fourth, *theirs):
        await ws.close()


@pytest.mark.slow
async def test_the_rate_limit_is_charged_before_the_prompt_is_tokenized(fleet):
    gw = fleet.gateway(auth_enabled="true", tiers=TENANT_TIERS)
    fleet.worker(backend="echo")
    key = _key(fleet, "slow-tenant", "slow")
    c = await Client.connect(gw.ws + "?api_key=" + key)
    for i in range(3):
        assert (await c.generate(f"r{i}", PROMPT, max_tokens=1)).end["type"] == "done"
    # longer than the model's context in tokens, within the character limit: a key that
    # is out of budget is refused for its budget, before anything tokenizes it
    huge = "word " * 19_000
    res = await c.generate("huge", huge, max_tokens=1, timeout=30)
    assert res.end["code"] == "rate_limited", res.end
    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.post(gw.http + "/v1/completions", json={"prompt": huge, "max_tokens": 1},
                            headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited"
    await c.close()


@pytest.mark.slow
async def test_tier_ceilings_on_max_tokens_and_timeout(fleet):
    gw = fleet.gateway(auth_enabled="true", tiers=TENANT_TIERS, default_max_tokens=64)
    fleet.worker(backend="echo")
    key = _key(fleet, "ceil-tenant", "ceil")
    c = await Client.connect(gw.ws + "?api_key=" + key)
    over = await c.generate("over", PROMPT, max_tokens=9)
    assert over.end["code"] == "out_of_range" and over.end["param"] == "max_tokens"
    assert "ceil tier (8)" in over.end["message"]
    late = await asyncio.wait_for(c.start("late", PROMPT, timeout=6), 10)  # the request's queue timeout
    assert late.end["code"] == "out_of_range" and late.end["param"] == "timeout"
    # a request that names no max_tokens gets the gateway's default lowered to the ceiling
    dflt = await c.generate("default", PROMPT, ignore_eos=True)
    assert dflt.end["type"] == "done" and dflt.end["usage"]["completion_tokens"] == 8
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.post(gw.http + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 100},
                            headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    await c.close()
    # every log line of the key's requests names it (never the key itself)
    lines = [orjson.loads(line) for line in gw.log(tail=None).splitlines() if line.startswith("{")]
    accepted = [line for line in lines if line.get("event") == "request accepted"]
    assert accepted and all(line.get("key_id") == _key_id(key) for line in accepted)
    assert key not in gw.log(tail=None)
