"""Tool calls through the fleet with the official `openai` SDK: forced calls whose
arguments always validate (the demo model knows nothing of tools), streamed deltas,
"auto" read back out of the text, "none", tool results in the next request's history,
and the WebSocket's done frame."""

from __future__ import annotations

import json

import jsonschema
import openai
import orjson
import pytest
from websockets.sync.client import connect as ws_connect

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima"]},
                                            "unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit"], "additionalProperties": False}
ALARM = {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                          "label": {"type": "string", "maxLength": 12}},
         "required": ["hour"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM}}]
SCHEMAS = {"get_weather": WEATHER, "set_alarm": ALARM}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def gw(module_fleet):
    gw = module_fleet.gateway()
    module_fleet.worker()
    return gw


def sdk(gw):
    return openai.OpenAI(base_url=gw.http + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(client, **kw):
    return client.chat.completions.create(model="tiny-gpt", messages=kw.pop("messages", ASK), max_tokens=120,
                                          temperature=1.0, tools=TOOLS, **kw)


def test_a_forced_call_always_has_valid_arguments(gw):
    client = sdk(gw)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(20):
        r = chat(client, seed=seed, tool_choice=named)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    names = set()
    for seed in range(12):  # "required": one of the tools, its own arguments
        (call,) = chat(client, seed=seed, tool_choice="required").choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        names.add(call.function.name)
    assert names == {"get_weather", "set_alarm"}


def test_a_streamed_call_comes_as_deltas(gw):
    client = sdk(gw)
    whole = chat(client, seed=5, tool_choice="required").choices[0].message.tool_calls[0]
    chunks = list(chat(client, seed=5, tool_choice="required", stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    first, rest = deltas[0], deltas[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == whole.function.name and first.function.arguments == ""
    assert len(rest) >= 2 and all(d.index == 0 and d.function.name is None for d in rest)
    assert "".join(d.function.arguments for d in rest) == whole.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


def test_auto_reads_a_call_out_of_the_text_and_none_never_calls(gw):
    client = sdk(gw)
    r = chat(client, seed=1, tool_choice="auto")  # the demo model answers in words
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    # a completion that is a call of an offered tool is one (here made so by a schema)
    shape = {"type": "object", "properties": {"name": {"const": "set_alarm"}, "arguments": ALARM},
             "required": ["name", "arguments"], "additionalProperties": False}
    r = chat(client, seed=2, tool_choice="auto", extra_body={"guided_json": shape})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "set_alarm" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), ALARM)
    chunks = list(chat(client, seed=2, tool_choice="auto", stream=True, extra_body={"guided_json": shape}))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "set_alarm"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    # streamed text that is not a call is text
    chunks = list(chat(client, seed=1, tool_choice="auto", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        chat(client, seed=1, tool_choice="auto").choices[0].message.content
    r = chat(client, seed=2, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


def test_tool_results_go_back_in_the_history(gw):
    client = sdk(gw)
    call = chat(client, seed=3, tool_choice="required").choices[0].message.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    r = chat(client, seed=3, messages=history, tool_choice="none")
    assert r.choices[0].message.content and r.usage.prompt_tokens > 30
    with pytest.raises(openai.BadRequestError) as e:  # a tool result must say which call it answers
        chat(client, messages=ASK + [{"role": "tool", "content": "x"}])
    assert e.value.body["param"] == "messages"


@pytest.mark.parametrize("fields,param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tools_are_refused_by_name(gw, fields, param):
    body = {"model": "tiny-gpt", "messages": ASK, "max_tokens": 4, "tools": TOOLS, **fields}
    with pytest.raises(openai.BadRequestError) as e:
        sdk(gw).chat.completions.create(**{k: v for k, v in body.items() if k in ("model", "messages", "max_tokens")},
                                        extra_body={k: v for k, v in body.items()
                                                    if k not in ("model", "messages", "max_tokens")})
    assert e.value.body["param"] == param, e.value.body


def test_tools_need_a_chat_and_the_websocket_reports_the_call(gw):
    with pytest.raises(openai.BadRequestError) as e:
        sdk(gw).completions.create(model="tiny-gpt", prompt="x", max_tokens=4, extra_body={"tools": TOOLS})
    assert e.value.body["param"] == "tools"
    with ws_connect(gw.ws) as ws:
        ws.send(orjson.dumps({"type": "generate", "id": "t", "messages": ASK, "max_tokens": 120, "seed": 4,
                              "tools": TOOLS, "tool_choice": "required"}).decode())
        frames = []
        while not frames or frames[-1]["type"] not in ("done", "error"):
            frames.append(orjson.loads(ws.recv(timeout=60)))
    done = frames[-1]
    assert done["finish_reason"] == "tool_calls", done
    (call,) = done["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    # the token frames carry the call's text as it was generated
    text = "".join(f["text"] for f in frames if f["type"] == "token")
    assert json.loads(text) == {"name": call["function"]["name"], "arguments": json.loads(call["function"]["arguments"])}
