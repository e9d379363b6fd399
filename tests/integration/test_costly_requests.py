"""One tenant cannot stall the fleet with what a request asks for (docs/security.md): a
constraint too costly to enforce is refused by name in the gateway, or ends only its own
request in the worker; admission (key, rate) comes before any costly work; anything
nested too deep is a 400 on every door; a request of several choices refused takes
nothing from its key's rate limit."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest

from tests.support.grpcclient import aio_channel
from tests.support.keys import add_key
from tests.support.wsclient import Client

TIERS = ('{"victim": {"requests_per_minute": 6000, "burst": 100, "max_streams": null, "max_lane": "normal"},'
         ' "scant": {"requests_per_minute": 1, "burst": 3, "max_streams": null, "max_lane": "normal"}}')
HOSTILE = "((a{50}){50}){50}"
ANCHORED = f"^{HOSTILE}$"  # a schema's pattern matches anywhere unless anchored (JSON Schema)
#: the issue's three forms of one catastrophic regex
ATTACKS = {
    "guided_regex": {"guided_regex": HOSTILE},
    "schema_pattern": {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": ANCHORED}}, "required": ["a"]}}}},
    "tool_parameter": {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": ANCHORED}}, "required": ["a"]}}}],
        "tool_choice": "required"},
}


def _deep(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


@pytest.fixture(scope="module")
def tenants(module_fleet):
    gw = module_fleet.gateway(auth_enabled="true", tiers=TIERS)
    module_fleet.worker()
    return gw, {name: add_key(module_fleet, name, name, TIERS) for name in ("victim", "scant")}, module_fleet


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def test_a_catastrophic_regex_is_refused_by_name_while_another_tenant_streams(tenants):
    gw, keys, fleet = tenants
    attacker = add_key(fleet, "attacker", "victim", TIERS)  # a valid key with room to attack
    async with httpx.AsyncClient(base_url=gw.http, timeout=60) as http:
        victim = asyncio.ensure_future(http.post("/v1/completions", headers=_auth(keys["victim"]), json={
            "model": "tiny-gpt", "prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True}))
        for name, fields in ATTACKS.items():
            r = await http.post("/v1/chat/completions", headers=_auth(attacker), json={
                "model": "tiny-gpt", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, **fields})
            assert r.status_code == 400, (name, r.text)
            err = r.json()["error"]
            assert err["code"] == "invalid_request" and "too costly" in err["message"], (name, err)
            assert "SF_GRAMMAR_" in err["message"] and "<" not in err["message"], err
        done = await victim
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 40


async def test_a_limit_broken_deep_in_the_output_ends_only_that_request(tenants):
    """Past the gateway's trial (a few tokens), the worker stops the sequence whose
    constraint breaks a limit, with a clear error; the batch goes on."""
    gw, keys, _ = tenants
    async with httpx.AsyncClient(base_url=gw.http, timeout=60) as http:
        victim = asyncio.ensure_future(http.post("/v1/completions", headers=_auth(keys["victim"]), json={
            "model": "tiny-gpt", "prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True}))
        r = await http.post("/v1/completions", headers=_auth(keys["victim"]), json={
            "model": "tiny-gpt", "prompt": "x", "max_tokens": 100, "guided_regex": "b{30}" + HOSTILE})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "invalid_request" and "too costly" in r.json()["error"]["message"]
        done = await victim
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 40


async def test_admission_comes_before_the_grammar(tenants):
    """A key out of its rate limit is refused (429) before its constraint is compiled: a
    hostile one gets the same 429, not the 400 its compile would give."""
    gw, _, fleet = tenants
    key = add_key(fleet, "spent", "scant", TIERS)
    async with httpx.AsyncClient(base_url=gw.http, timeout=60) as http:
        for _ in range(3):
            r = await http.post("/v1/completions", headers=_auth(key),
                                json={"model": "tiny-gpt", "prompt": "x", "max_tokens": 1})
            assert r.status_code == 200, r.text
        r = await http.post("/v1/completions", headers=_auth(key),
                            json={"model": "tiny-gpt", "prompt": "x", "max_tokens": 5, "guided_regex": HOSTILE})
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited", r.text


async def test_a_key_out_of_its_rate_limit_is_refused_without_a_round_trip(tenants):
    """Once a gateway saw a key's bucket empty, it refuses that key's requests until the
    next one is due without asking Redis (or reading the body): the bucket in Redis is
    not touched by the flood."""
    from streamfleet.shared.redis import sync_client

    gw, _, fleet = tenants
    key = add_key(fleet, "flood", "scant", TIERS)
    bucket = f"{fleet.prefix}:rl:{key.split('-')[1]}"
    r = sync_client(fleet.redis_url)
    async with httpx.AsyncClient(base_url=gw.http, timeout=60) as http:
        for expect in (200, 200, 200, 429):
            got = await http.post("/v1/completions", headers=_auth(key),
                                  json={"model": "tiny-gpt", "prompt": "x", "max_tokens": 1})
            assert got.status_code == expect, got.text
        seen = r.hgetall(bucket)
        for _ in range(20):
            got = await http.post("/v1/completions", headers=_auth(key), content=b"{not even json")
            assert got.status_code == 429 and got.json()["error"]["code"] == "rate_limited", got.text
            assert int(got.headers["retry-after"]) >= 1
    assert r.hgetall(bucket) == seen
    r.close()


async def test_a_refused_request_of_several_choices_takes_nothing(tenants):
    gw, _, fleet = tenants
    key = add_key(fleet, "choices", "scant", TIERS)  # 3 requests, then 1 a minute
    body = {"model": "tiny-gpt", "prompt": "x", "max_tokens": 2, "temperature": 1.0}
    async with httpx.AsyncClient(base_url=gw.http, timeout=60) as http:
        r = await http.post("/v1/completions", headers=_auth(key), json={**body, "n": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text  # past the burst: never
        r = await http.post("/v1/completions", headers=_auth(key), json={**body, "n": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
        r = await http.post("/v1/completions", headers=_auth(key), json={**body, "n": 2})
        assert r.status_code == 429, r.text  # one left: all or nothing
        r = await http.post("/v1/completions", headers=_auth(key), json=body)
        assert r.status_code == 200, r.text  # ... and the one is still there


async def test_nesting_past_the_limit_is_a_400_on_every_door(tenants):
    gw, keys, _ = tenants
    deep = _deep(300)
    async with httpx.AsyncClient(base_url=gw.http, timeout=60) as http:
        for fields in ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": deep}}},
                       {"guided_json": deep},
                       {"tools": [{"type": "function", "function": {"name": "f", "parameters": deep}}]}):
            r = await http.post("/v1/chat/completions", headers=_auth(keys["victim"]), json={
                "model": "tiny-gpt", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields})
            assert r.status_code == 400, r.text
            assert "SF_GRAMMAR_MAX_DEPTH" in r.json()["error"]["message"] and r.json()["error"]["param"] == \
                next(iter(fields))

    ws = await Client.connect(gw.ws + "?api_key=" + keys["victim"])
    # (orjson writes at most 254 levels: the standard library writes these 300)
    await ws.send(json.dumps({"type": "generate", "id": "deep", "prompt": "hi", "max_tokens": 4, "guided_json": deep}))
    bad = await ws.next_other()
    assert bad["type"] == "error" and bad["code"] == "invalid_request" and bad["param"] == "guided_json", bad
    good = await ws.generate("after", "hi", max_tokens=4)  # the session lives on
    assert good.end["type"] == "done"
    await ws.close()

    from streamfleet.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc

    async with aio_channel(gw.grpc) as ch:
        stub = pb_grpc.InferenceStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            async for _ in stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=4, json_schema=json.dumps(deep)),
                                         metadata=(("authorization", "Bearer " + keys["victim"]),), timeout=30):
                pass
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "SF_GRAMMAR_MAX_DEPTH" in e.value.details()
