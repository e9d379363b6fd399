"""API keys, tiers and shared rate limits through real gateway processes."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import openai
import orjson
import pytest
import websockets

from tests.support.keys import TIERS, add_key
from tests.support.wait import until_async
from tests.support.wsclient import Client

pytestmark = pytest.mark.slow  # gateways with keys and shared budgets started per test, both brokers


async def test_keys_are_required_and_checked(fleet):
    gw = fleet.gateway(auth_enabled="true", tiers=TIERS, key_cache_s=1)  # the revocation below waits it out
    fleet.worker(backend="echo")
    key = add_key(fleet, "alice", "free")
    # HTTP: missing and wrong keys get 401 in OpenAI's shape
    async with httpx.AsyncClient() as http:
        r = await http.post(gw.http + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        assert "Authorization: Bearer" in r.json()["error"]["message"]
        r = await http.post(gw.http + "/v1/completions", json={"prompt": "hi"},
                            headers={"Authorization": "Bearer sf-000000000000-nope"})
        assert r.status_code == 401
    client = openai.AsyncOpenAI(base_url=gw.http + "/v1", api_key=key, max_retries=0)
    c = await client.completions.create(model="tiny-gpt", prompt="hi", max_tokens=3, extra_body={"ignore_eos": True})
    assert c.usage.completion_tokens == 3
    # the free tier may not use the high lane
    with pytest.raises(openai.PermissionDeniedError) as e:
        await client.completions.create(model="tiny-gpt", prompt="hi", max_tokens=3,
                                        extra_headers={"X-Priority": "high"})
    assert e.value.body["code"] == "forbidden"
    await client.close()
    # WebSocket: no key → error frame and close 1008; ?api_key= works for browsers
    ws = await websockets.connect(gw.ws)
    assert orjson.loads(await ws.recv())["code"] == "unauthorized"
    with pytest.raises(websockets.ConnectionClosed) as e:
        await ws.recv()
    assert e.value.rcvd.code == 1008
    ok = await Client.connect(gw.ws + "?api_key=" + key)
    res = await ok.generate("a", max_tokens=2, ignore_eos=True)
    assert res.end["type"] == "done"
    await ok.close()
    # `streamfleet client` takes the key from --api-key or SF_API_KEY, on every door
    cli = [sys.executable, "-m", "streamfleet", "client", "hi", "--url", gw.http, "--max-tokens", "2"]
    for transport in ("ws", "sse", "grpc"):
        door = ["--transport", transport] + (["--grpc-target", gw.grpc] if transport == "grpc" else [])
        run = await asyncio.to_thread(subprocess.run, cli + door, env={**fleet.env(), "SF_API_KEY": key},
                                      capture_output=True, text=True, timeout=60)
        assert run.returncode == 0 and "tokens" in run.stderr, (transport, run.stderr)
        denied = await asyncio.to_thread(subprocess.run, cli + door + ["--api-key", "sf-000000000000-nope"],
                                         env=fleet.env(), capture_output=True, text=True, timeout=60)
        assert denied.returncode == 1 and "unauthorized" in denied.stderr.lower(), (transport, denied.stderr)
    # revoked keys stop working (within the gateway's key cache TTL, key_cache_s=1 here)
    out = subprocess.run([sys.executable, "-m", "streamfleet", "keys", "revoke", "alice"], env=fleet.env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    async def refused() -> bool:
        async with httpx.AsyncClient() as http:
            r = await http.post(gw.http + "/v1/completions", json={"prompt": "hi"},
                                headers={"Authorization": f"Bearer {key}"})
            return r.status_code == 401

    await until_async(refused, "the revoked key refused (within the 1 s key cache)", timeout=5)


@pytest.mark.both_brokers
async def test_two_gateways_share_one_budget_per_key(fleet):
    gws = [fleet.gateway(auth_enabled="true", tiers=TIERS) for _ in range(2)]
    fleet.worker(backend="echo")
    key = add_key(fleet, "bob", "test")
    statuses = []
    async with httpx.AsyncClient(timeout=30) as http:
        async def one(i):
            gw = gws[i % 2]
            r = await http.post(gw.http + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
            if r.status_code == 429:
                assert r.json()["error"]["code"] == "rate_limited"
                assert int(r.headers["retry-after"]) >= 1
            return r.status_code

        statuses = await asyncio.gather(*(one(i) for i in range(16)))
    assert statuses.count(200) == 6  # the burst, exactly, over both gateways
    assert statuses.count(429) == 10
    # and on the WebSocket the refusal carries retry_after_ms
    c = await Client.connect(gws[0].ws + "?api_key=" + key)
    res = await c.generate("x", max_tokens=2)
    assert res.end["code"] == "rate_limited" and res.end["retry_after_ms"] > 0
    await c.close()


@pytest.mark.both_brokers
async def test_concurrent_stream_cap(fleet):
    gw = fleet.gateway(auth_enabled="true", tiers=TIERS)
    fleet.worker(backend="echo", echo_delay_ms=20)
    key = add_key(fleet, "carol", "solo")
    c = await Client.connect(gw.ws + "?api_key=" + key)
    first = c.start("one", max_tokens=30, ignore_eos=True)
    while not c.results["one"].accepted:
        await asyncio.sleep(0.01)
    second = await c.generate("two", max_tokens=2)
    assert second.end["code"] == "too_many_requests" and second.end["status"] == 429
    assert (await asyncio.wait_for(first, 30)).end["type"] == "done"
    third = await c.generate("three", max_tokens=2, ignore_eos=True)  # the slot was released
    assert third.end["type"] == "done"
    await c.close()
