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
    return client.chat.completions.create(model="tiny-gpt", messages=kw.pop("messages", ASK),
                                          max_tokens=kw.pop("max_tokens", 120), temperature=1.0, tools=TOOLS, **kw)


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
    for seed in range(12):  # "required", one call: one of the tools, its own arguments
        r = chat(client, seed=seed, tool_choice="required", parallel_tool_calls=False)
        (call,) = r.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        names.add(call.function.name)
    assert names == {"get_weather", "set_alarm"}


def test_a_streamed_call_comes_as_deltas(gw):
    client = sdk(gw)
    whole = chat(client, seed=5, tool_choice="required", parallel_tool_calls=False).choices[0].message.tool_calls[0]
    chunks = list(chat(client, seed=5, tool_choice="required", parallel_tool_calls=False, stream=True))
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
    call = chat(client, seed=3, tool_choice="required", parallel_tool_calls=False).choices[0].message.tool_calls[0]
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
                              "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}).decode())
        frames = []
        while not frames or frames[-1]["type"] not in ("done", "error"):
            frames.append(orjson.loads(ws.recv(timeout=60)))
    done = frames[-1]
    assert done["finish_reason"] == "tool_calls", done
    (call,) = done["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    # the token frames carry the call's text as it was generated
    text = "".join(f["text"] for f in frames if f["type"] == "token")
    assert json.loads(text) == {"name": call["function"]["name"],
                                "arguments": json.loads(call["function"]["arguments"])}



#: two tools whose calls are short: an array of up to eight of them fits tiny-gpt's context
LIGHTS = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
          "additionalProperties": False}
PING = {"type": "object", "properties": {}, "additionalProperties": False}
SHORT = [{"type": "function", "function": {"name": "lights", "parameters": LIGHTS}},
         {"type": "function", "function": {"name": "ping", "parameters": PING}}]
SHORT_SCHEMAS = {"lights": LIGHTS, "ping": PING}


@pytest.fixture(scope="module")
def close_array(tiny_spec):
    """A ``logit_bias`` towards tiny-gpt's ``]``: its random weights would go on adding calls
    until its context is full, cutting the last short (``finish_reason: "length"``)."""
    from streamfleet.shared.modelrepo import load_tokenizer

    (bracket,) = load_tokenizer(tiny_spec).encode("]")
    return {str(bracket): 6}


def test_required_with_parallel_calls_gives_every_call_of_the_constrained_array(gw, close_array):
    """``parallel_tool_calls`` (the default) with "required": the output is an array of
    calls, each of an offered tool with valid arguments, as the SDK reads it, streamed (raw
    deltas and the stream helper) and not; ``parallel_tool_calls: false`` gives one call."""
    client = sdk(gw)

    def ask(**kw):
        return client.chat.completions.create(model="tiny-gpt", messages=ASK, max_tokens=120, temperature=1.0,
                                              tools=SHORT, tool_choice="required", logit_bias=close_array, **kw)

    several = 0
    for seed in range(6):
        r = ask(seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        calls = choice.message.tool_calls
        assert 1 <= len(calls) <= 8 and len({c.id for c in calls}) == len(calls)
        for c in calls:
            assert c.type == "function" and c.id.startswith("call_")
            jsonschema.validate(json.loads(c.function.arguments), SHORT_SCHEMAS[c.function.name])
        several += len(calls) > 1
        whole = [(c.function.name, c.function.arguments) for c in calls]
        assert [c.id for c in calls[1:]] == [f"{calls[0].id}_0_{k}" for k in range(1, len(calls))]
        # streamed: each call under its own index, its name first, then its arguments
        chunks = list(ask(seed=seed, stream=True))
        streamed: dict[int, list] = {}
        for d in (d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])):
            if d.id is not None:
                assert d.index == len(streamed) and d.function.arguments == ""
                streamed[d.index] = [d.id, d.function.name, ""]
            else:
                assert d.function.name is None
                streamed[d.index][2] += d.function.arguments
        assert [(name, args) for _, (_, name, args) in sorted(streamed.items())] == whole
        assert len({i for i, _, _ in streamed.values()}) == len(whole)
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
        # the SDK's stream helper puts the same calls together
        with client.chat.completions.stream(model="tiny-gpt", messages=ASK, max_tokens=120, temperature=1.0,
                                            seed=seed, tools=SHORT, tool_choice="required",
                                            logit_bias=close_array) as stream:
            final = stream.get_final_completion()
        msg = final.choices[0].message
        assert msg.content is None and final.choices[0].finish_reason == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == whole
    assert several, "no reply made more than one call"
    for seed in range(4):  # parallel_tool_calls false: exactly one call, streamed or not
        r = ask(seed=seed, parallel_tool_calls=False)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), SHORT_SCHEMAS[call.function.name])
        chunks = list(ask(seed=seed, parallel_tool_calls=False, stream=True))
        deltas = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
        assert {d.index for d in deltas} == {0} and sum(d.id is not None for d in deltas) == 1


def test_several_calls_and_their_results_go_back_in_the_history_and_the_websocket_reports_them(gw, close_array):
    client = sdk(gw)
    r = client.chat.completions.create(model="tiny-gpt", messages=ASK, max_tokens=120, seed=1, tools=SHORT,
                                       tool_choice="required", logit_bias=close_array)
    calls = r.choices[0].message.tool_calls
    assert len(calls) > 1
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]}] + [
        {"role": "tool", "tool_call_id": c.id, "content": f"done {k}"} for k, c in enumerate(calls)]
    one = ASK + [{"role": "assistant", "content": None, "tool_calls": [calls[0].model_dump()]},
                 {"role": "tool", "tool_call_id": calls[0].id, "content": "done 0"}]
    many = client.chat.completions.create(model="tiny-gpt", messages=history, max_tokens=4, tools=SHORT,
                                          tool_choice="none")
    first = client.chat.completions.create(model="tiny-gpt", messages=one, max_tokens=4, tools=SHORT,
                                           tool_choice="none")
    assert many.usage.prompt_tokens > first.usage.prompt_tokens  # every call was written into the prompt
    # the WebSocket's done frame has every call; its token frames, the array as generated
    for parallel, count in ((True, len(calls)), (False, 1)):
        with ws_connect(gw.ws) as ws:
            ws.send(orjson.dumps({"type": "generate", "id": "t", "messages": ASK, "max_tokens": 120, "seed": 1,
                                  "tools": SHORT, "tool_choice": "required", "logit_bias": close_array,
                                  "parallel_tool_calls": parallel}).decode())
            frames = []
            while not frames or frames[-1]["type"] not in ("done", "error"):
                frames.append(orjson.loads(ws.recv(timeout=60)))
        done = frames[-1]
        assert done["finish_reason"] == "tool_calls", done
        assert len(done["tool_calls"]) == count and len({c["id"] for c in done["tool_calls"]}) == count
        text = json.loads("".join(f["text"] for f in frames if f["type"] == "token"))
        made = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                for c in done["tool_calls"]]
        assert text == (made if parallel else made[0])
        if parallel:
            assert [c["function"]["arguments"] for c in done["tool_calls"]] == [c.function.arguments for c in calls]


async def test_tools_on_grpc_generate_and_stream(gw):
    """The gRPC door takes tools as the other doors do (a Tool's parameters as JSON text,
    tool_choice a mode or a tool's name) and its Done carries the calls; the same request
    gives the same calls as the OpenAI door."""
    import grpc

    from streamfleet.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc
    from tests.support.grpcclient import aio_channel

    tools = [pb.Tool(name=t["function"]["name"], description=t["function"].get("description", ""),
                     parameters=orjson.dumps(t["function"]["parameters"]).decode()) for t in TOOLS]
    messages = [pb.ChatMessage(role=m["role"], content=m["content"]) for m in ASK]
    ask = dict(messages=messages, tools=tools, max_tokens=120, temperature=1.0, seed=3)
    ref = chat(sdk(gw), seed=3, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    async with aio_channel(gw.grpc) as ch:
        stub = pb_grpc.InferenceStub(ch)
        events = [ev async for ev in stub.Generate(pb.GenerateRequest(tool_choice="get_weather", **ask), timeout=60)]
        done = events[-1].done
        assert done.finish_reason == "tool_calls" and len(done.tool_calls) == 1
        call = done.tool_calls[0]
        assert (call.name, call.arguments) == (ref.choices[0].message.tool_calls[0].function.name,
                                               ref.choices[0].message.tool_calls[0].function.arguments)
        assert call.id == f"call_{done.request_id[:24]}"
        jsonschema.validate(json.loads(call.arguments), WEATHER)
        # "required", one call, on a Stream call
        stream = stub.Stream()
        await stream.write(pb.ClientFrame(id="t", generate=pb.GenerateRequest(tool_choice="required",
                                                                              parallel_tool_calls=False, **ask)))
        await stream.done_writing()
        frames = [f async for f in stream]
        (call,) = frames[-1].done.tool_calls
        assert frames[-1].done.finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        # the call and its result given back: the next turn runs
        history = messages + [pb.ChatMessage(role="assistant", tool_calls=[call]),
                              pb.ChatMessage(role="tool", tool_call_id=call.id, content='{"temp": 21}')]
        nxt = [ev async for ev in stub.Generate(pb.GenerateRequest(messages=history, tools=tools, tool_choice="none",
                                                                   max_tokens=5), timeout=60)]
        assert nxt[-1].done.finish_reason in ("stop", "length") and not nxt[-1].done.tool_calls
        for bad, param in ((pb.Tool(name="f", parameters="{not json"), "tools"),
                           (pb.Tool(name="bad name!", parameters="{}"), "tools")):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                [ev async for ev in stub.Generate(pb.GenerateRequest(messages=messages, tools=[bad]), timeout=60)]
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert dict(e.value.trailing_metadata())["streamfleet-error-param"] == param
