"""Tenants stay apart: a request belongs to its API key; another key can neither read nor
cancel it, and an unauthenticated body is refused before it is read."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import orjson

from tests.integration.test_auth_limits import TIERS, add_key
from tests.integration.wsclient import Client

PROMPT = "Once upon a time there was a fleet"


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
