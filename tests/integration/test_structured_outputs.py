"""Structured outputs through the fleet with the official `openai` SDK: JSON schemas,
JSON objects, regexes, choices and grammars, enforced by grammar-constrained decoding on
the demo model (whose weights know nothing of JSON)."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import orjson
import pytest
from websockets.sync.client import connect as ws_connect

from streamfleet.devkit.structured import SCHEMA  # the benchmark's schema: what is measured is what is tested
from tests.support.grpcclient import sync_channel

FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def gw(module_fleet):
    gw = module_fleet.gateway()
    module_fleet.worker()
    return gw


def sdk(gw, cls=openai.OpenAI):
    return cls(base_url=gw.http + "/v1", api_key="unused", max_retries=0, timeout=120)


async def test_a_json_schema_is_met_100_times_out_of_100(gw):
    client = sdk(gw, openai.AsyncOpenAI)
    sem = asyncio.Semaphore(32)

    async def one(seed: int):
        async with sem:
            return await client.chat.completions.create(model="tiny-gpt", messages=MESSAGES, max_tokens=200,
                                                        temperature=1.0, seed=seed, response_format=FORMAT)

    replies = await asyncio.gather(*(one(1000 + i) for i in range(100)))
    outputs = set()
    for r in replies:
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
        outputs.add(text)
    assert len(outputs) > 50  # sampled, not one canned answer


def test_json_object_regex_choice_and_grammar(gw):
    client = sdk(gw)
    # any JSON object: nothing bounds its strings, so some run out of tokens (and say so);
    # every one that ends is an object
    ended = 0
    for seed in range(16):
        r = client.chat.completions.create(model="tiny-gpt", messages=MESSAGES, max_tokens=200, temperature=0.8,
                                           seed=seed, response_format={"type": "json_object"})
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
            ended += 1
        else:
            assert r.choices[0].finish_reason == "length"
    assert ended >= 1, ended
    r = client.completions.create(model="tiny-gpt", prompt="Call me at", max_tokens=30, temperature=1.0, seed=4,
                                  extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    seen = set()
    for seed in range(8):
        r = client.completions.create(model="tiny-gpt", prompt="The answer is", max_tokens=10, temperature=1.0,
                                      seed=seed, extra_body={"guided_choice": ["yes", "no", "maybe later"]})
        seen.add(r.choices[0].text)
    assert seen <= {"yes", "no", "maybe later"} and len(seen) >= 2
    lark = 'start: "(" num (" + " num)* ")"\nnum: /[1-9][0-9]?/'
    r = client.completions.create(model="tiny-gpt", prompt="Sum:", max_tokens=60, temperature=1.0, seed=5,
                                  extra_body={"guided_grammar": lark})
    assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", r.choices[0].text), r.choices[0].text


def test_streamed_constrained_output_parses_and_the_websocket_takes_it_too(gw):
    client = sdk(gw)
    chunks = list(client.chat.completions.create(model="tiny-gpt", messages=MESSAGES, max_tokens=200,
                                                 temperature=1.0, seed=9, response_format=FORMAT, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    with ws_connect(gw.ws) as ws:
        ws.send(orjson.dumps({"type": "generate", "id": "a", "prompt": "JSON:", "max_tokens": 200, "seed": 9,
                              "response_format": FORMAT}).decode())
        frames = []
        while not frames or frames[-1]["type"] not in ("done", "error"):
            frames.append(orjson.loads(ws.recv(timeout=60)))
    assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == "stop", frames[-1]
    jsonschema.validate(json.loads("".join(f["text"] for f in frames if f["type"] == "token")), SCHEMA)


async def test_same_seed_same_tokens_constrained_alone_or_batched(gw):
    """A constrained sequence with penalties gives the same tokens alone and batched with
    unconstrained ones (its mask and processing depend on its own tokens only)."""
    client = sdk(gw, openai.AsyncOpenAI)
    ask = {"model": "tiny-gpt", "messages": MESSAGES, "max_tokens": 200, "temperature": 1.0, "seed": 21,
           "response_format": FORMAT, "frequency_penalty": 0.5, "extra_body": {"min_p": 0.02}}
    alone = (await client.chat.completions.create(**ask)).choices[0].message.content
    others = [client.completions.create(model="tiny-gpt", prompt=f"Story {i}", max_tokens=60, temperature=1.0,
                                        seed=i, extra_body={"ignore_eos": True}) for i in range(8)]
    got = await asyncio.gather(client.chat.completions.create(**ask), *others, client.chat.completions.create(**ask))
    assert got[0].choices[0].message.content == alone == got[-1].choices[0].message.content


def test_a_budget_too_small_ends_with_length(gw):
    """max_tokens is still the limit: a constrained output cut short says so."""
    r = sdk(gw).chat.completions.create(model="tiny-gpt", messages=MESSAGES, max_tokens=5, seed=1,
                                        response_format=FORMAT)
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": "not an object"}}, "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"guided_json": {"type": "object", "description": "x" * 70_000}}, "guided_json"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
])
def test_bad_constraints_are_refused_by_name(gw, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        sdk(gw).chat.completions.create(model="tiny-gpt", messages=MESSAGES, max_tokens=4, extra_body=fields)
    assert e.value.body["param"] == param and e.value.body["code"] == "invalid_request", e.value.body


def test_grpc_takes_a_schema_and_refuses_a_bad_one(gw):
    import grpc

    from streamfleet.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc

    with sync_channel(gw.grpc) as ch:
        stub = pb_grpc.InferenceStub(ch)
        events = list(stub.Generate(pb.GenerateRequest(prompt="JSON:", max_tokens=200, seed=4,
                                                       json_schema=json.dumps(SCHEMA)), timeout=60))
        text = "".join(e.token.text for e in events if e.WhichOneof("event") == "token")
        jsonschema.validate(json.loads(text), SCHEMA)
        assert events[-1].done.finish_reason == "stop"
        choice = list(stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=10, choice=["left", "right"]),
                                    timeout=60))
        assert "".join(e.token.text for e in choice if e.WhichOneof("event") == "token") in ("left", "right")
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=10, regex="(bad"), timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "guided_regex" in e.value.details()
