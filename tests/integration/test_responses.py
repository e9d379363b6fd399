"""The Responses API (``/v1/responses``) driven by the official `openai` SDK, unchanged,
against real gateways and a tiny-gpt worker: string and item inputs, instructions,
max_output_tokens, structured outputs, function calls and their results, stored
responses continued on another gateway, GET and DELETE, tenants kept apart, the SDK's
stream helper, and bad input refused by name."""

from __future__ import annotations

import json
import socket
import time

import httpx
import jsonschema
import openai
import pytest

from streamfleet.devkit.structured import SCHEMA
from tests.support.keys import add_key

TIERS = '{"big": {"requests_per_minute": 6000, "burst": 500, "max_streams": null}}'
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER,
        "strict": True}
#: deterministic sampling: the same request gives the same text on every door
SAME = {"temperature": 0.7, "extra_body": {"seed": 11}}


@pytest.fixture(scope="module")
def fleet_up(module_fleets):
    """Two gateways with auth on, one with auth off, on one fleet (one tiny-gpt worker),
    and two tenants' keys."""
    fleet = module_fleets()
    a = fleet.gateway(auth_enabled="true", tiers=TIERS)
    b = fleet.gateway(auth_enabled="true", tiers=TIERS)
    open_gw = fleet.gateway(tiers=TIERS)
    fleet.worker()
    keys = [add_key(fleet, name, "big", tiers=TIERS) for name in ("alice", "bob")]
    return {"a": a, "b": b, "open": open_gw, "alice": keys[0], "bob": keys[1]}


def sdk(gw, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.http + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def alice(fleet_up):
    return sdk(fleet_up["a"], fleet_up["alice"])


@pytest.fixture(scope="module")
def alice_b(fleet_up):
    """Alice on the other gateway."""
    return sdk(fleet_up["b"], fleet_up["alice"])


def test_string_input_cut_by_max_output_tokens_is_incomplete(alice):
    r = alice.responses.create(model="tiny-gpt", input="Once upon a time", max_output_tokens=8,
                               extra_body={"ignore_eos": True, "seed": 1})
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny-gpt"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 8 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + 8
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "incomplete"
    assert item.content[0].type == "output_text" and r.output_text == item.content[0].text != ""
    assert r.max_output_tokens == 8 and r.store is True and r.tools == [] and r.tool_choice == "auto"


def test_items_and_instructions_give_what_chat_completions_gives(alice):
    items = [{"role": "user", "content": "Hello"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi there."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Tell me a story"}]}]
    r = alice.responses.create(model="tiny-gpt", input=items, instructions="You are terse.", max_output_tokens=12,
                               metadata={"case": "items"}, **SAME)
    chat = alice.chat.completions.create(
        model="tiny-gpt", max_tokens=12, messages=[{"role": "system", "content": "You are terse."},
                                                   {"role": "user", "content": "Hello"},
                                                   {"role": "assistant", "content": "Hi there."},
                                                   {"role": "user", "content": "Tell me a story"}], **SAME)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.instructions == "You are terse." and r.metadata == {"case": "items"} and r.temperature == 0.7


def test_a_json_schema_gives_parseable_json(alice):
    for seed in range(3):
        r = alice.responses.create(model="tiny-gpt", input="Describe a person as JSON.", max_output_tokens=200,
                                   text={"format": {"type": "json_schema", "name": "person", "schema": SCHEMA,
                                                    "strict": True}}, extra_body={"seed": seed})
        assert r.status == "completed", r.output_text
        jsonschema.validate(json.loads(r.output_text), SCHEMA)
        assert r.text.format.type == "json_schema" and r.text.format.name == "person"


def test_a_forced_call_and_its_result_continue_on_another_gateway(alice, alice_b):
    r = alice.responses.create(model="tiny-gpt", input="What is the weather in Paris?", tools=[TOOL],
                               tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=80,
                               extra_body={"seed": 4})
    assert r.status == "completed"
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert r.tools[0].name == "get_weather" and r.tool_choice.name == "get_weather"
    # the result goes back on the other gateway, continuing the stored conversation
    r2 = alice_b.responses.create(model="tiny-gpt", previous_response_id=r.id, max_output_tokens=10,
                                  input=[{"type": "function_call_output", "call_id": call.call_id,
                                          "output": "sunny, 21 C"}], tools=[TOOL], tool_choice="none", **SAME)
    assert r2.previous_response_id == r.id and r2.output[0].type == "message"
    # what the chat door gives for the same history: the call, then its result
    chat = alice.chat.completions.create(
        model="tiny-gpt", max_tokens=10, tool_choice="none",
        tools=[{"type": "function", "function": {"name": "get_weather", "description": TOOL["description"],
                                                 "parameters": WEATHER}}],
        messages=[{"role": "user", "content": "What is the weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": call.call_id, "type": "function",
                       "function": {"name": "get_weather", "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}], **SAME)
    assert r2.output_text == chat.choices[0].message.content
    assert r2.usage.input_tokens == chat.usage.prompt_tokens


def test_previous_response_id_continues_on_another_gateway_without_the_instructions(alice, alice_b):
    first = alice.responses.create(model="tiny-gpt", input="Once upon a time", instructions="Speak French.",
                                   max_output_tokens=6, **SAME)
    then = alice_b.responses.create(model="tiny-gpt", previous_response_id=first.id, input="And then?",
                                    max_output_tokens=6, **SAME)
    assert then.instructions is None and then.previous_response_id == first.id
    # the conversation so far, without the first request's instructions (as OpenAI documents)
    chat = alice.chat.completions.create(model="tiny-gpt", max_tokens=6, messages=[
        {"role": "user", "content": "Once upon a time"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"}], **SAME)
    assert then.output_text == chat.choices[0].message.content
    assert then.usage.input_tokens == chat.usage.prompt_tokens
    # a third turn carries both earlier ones
    third = alice.responses.create(model="tiny-gpt", previous_response_id=then.id, input="Go on.",
                                   max_output_tokens=4, **SAME)
    assert third.usage.input_tokens > then.usage.input_tokens + then.usage.output_tokens


def test_get_and_delete(alice, alice_b):
    r = alice.responses.create(model="tiny-gpt", input="Hello", max_output_tokens=5, metadata={"k": "v"})
    got = alice_b.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    alice_b.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as info:
        alice.responses.create(model="tiny-gpt", previous_response_id=r.id, input="more", max_output_tokens=2)
    assert info.value.param == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        alice.responses.delete(r.id)
    unstored = alice.responses.create(model="tiny-gpt", input="Hello", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve("resp_not-an-id")


def test_another_tenants_response_does_not_exist(fleet_up, alice):
    bob = sdk(fleet_up["b"], fleet_up["bob"])
    anonymous = sdk(fleet_up["open"])
    r = alice.responses.create(model="tiny-gpt", input="A secret", max_output_tokens=3)
    for other in (bob, anonymous):
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.delete(r.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.create(model="tiny-gpt", previous_response_id=r.id, input="x", max_output_tokens=2)
    assert alice.responses.retrieve(r.id).id == r.id  # still there
    # and a response stored with auth off belongs to auth off only
    mine = anonymous.responses.create(model="tiny-gpt", input="Open", max_output_tokens=3)
    assert anonymous.responses.retrieve(mine.id).id == mine.id
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(mine.id)
    with pytest.raises(openai.AuthenticationError):
        sdk(fleet_up["a"]).responses.retrieve(r.id)  # no key at all


def test_the_sdks_stream_helper(alice):
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}}
    with alice.responses.stream(model="tiny-gpt", input="Describe a person as JSON.", max_output_tokens=200,
                                text=fmt, extra_body={"seed": 7}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text and final.status == "completed"
    jsonschema.validate(json.loads(text), SCHEMA)
    assert alice.responses.retrieve(final.id).output_text == text  # stored before the last event went out
    # the same request not streamed gives the same response
    again = alice.responses.create(model="tiny-gpt", input="Describe a person as JSON.", max_output_tokens=200,
                                   text=fmt, extra_body={"seed": 7})
    assert again.output_text == text and again.usage == final.usage


def test_streamed_calls_and_cut_short_streams(alice):
    events = list(alice.responses.create(model="tiny-gpt", input="Weather?", tools=[TOOL], tool_choice="required",
                                         parallel_tool_calls=False, max_output_tokens=80, stream=True,
                                         extra_body={"seed": 2}))
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == events[-3].arguments == events[-1].response.output[0].arguments
    jsonschema.validate(json.loads(args), WEATHER)
    cut = list(alice.responses.create(model="tiny-gpt", input="Once upon a time", max_output_tokens=4, stream=True,
                                      extra_body={"ignore_eos": True}))
    assert cut[-1].type == "response.incomplete"
    assert cut[-1].response.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 256}, "max_output_tokens"),  # past tiny-gpt's context of 256 with the prompt
    ({"temperature": 9}, "temperature"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]}, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}}, "text.format"),
    ({"max_tokens": 5}, "max_tokens"),
])
def test_bad_input_is_refused_naming_the_field(fleet_up, body, param):
    r = httpx.post(fleet_up["a"].http + "/v1/responses", timeout=60,
                   headers={"Authorization": f"Bearer {fleet_up['alice']}"},
                   json={"model": "tiny-gpt", "input": "hi", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_the_sdk_sees_a_refusal_as_a_bad_request(alice):
    with pytest.raises(openai.BadRequestError) as info:
        alice.responses.create(model="tiny-gpt", input="hi", tools=[{"type": "web_search"}])
    assert info.value.param == "tools" and "web_search" in info.value.message


@pytest.fixture(scope="module")
def slow_gw(module_fleets):
    """A gateway and a tiny-gpt worker on the echo engine at 20 ms a step (auth off)."""
    fleet = module_fleets()
    gw = fleet.gateway()
    fleet.worker(backend="echo", echo_delay_ms=20)
    return gw


def _pending(rds, lane: str, want: int, timeout: float) -> float:
    t0 = time.monotonic()
    while rds.xpending(lane, "workers")["pending"] != want and time.monotonic() - t0 < timeout:
        time.sleep(0.005)
    assert rds.xpending(lane, "workers")["pending"] == want
    return time.monotonic() - t0


def test_a_client_that_leaves_cancels_its_response(slow_gw, rds):
    lane = f"{slow_gw.prefix}:{{tiny-gpt}}:tasks:normal"
    body = {"model": "tiny-gpt", "input": "Once upon a time", "max_output_tokens": 200, "ignore_eos": True}
    with httpx.stream("POST", slow_gw.http + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line == "event: response.output_text.delta":
                break
        assert rds.xpending(lane, "workers")["pending"] == 1
    assert _pending(rds, lane, 0, 5) < 2.0  # the worker let the sequence go
    raw = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", slow_gw.port))
    sock.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)
    _pending(rds, lane, 1, 10)
    sock.close()
    assert _pending(rds, lane, 0, 5) < 2.0
