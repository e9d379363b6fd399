"""The OpenAI-compatible facade, driven by the official `openai` SDK and by raw HTTP."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import openai
import orjson
import pytest
from websockets.sync.client import connect as ws_connect

from streamfleet.shared.errors import OPENAI_CODE
from tests.support.wait import until
from tests.support.wsclient import Client


@pytest.fixture(scope="module")
def fleet_up(module_fleets):
    """A gateway and a tiny-gpt worker, shared by the module's tests that only send requests."""
    fleet = module_fleets()
    gw = fleet.gateway()
    fleet.worker()
    return gw


@pytest.fixture(scope="module")
def slow_fleet(module_fleets):
    """A worker on the echo engine at 20 ms a step: generations last long enough to
    observe them mid-way, whatever the machine's speed. Shared by the module's tests, each
    of which leaves no request pending behind it; its lanes are under ``slow_fleet.prefix``."""
    fleet = module_fleets()
    gw = fleet.gateway()
    fleet.worker(backend="echo", echo_delay_ms=20)
    return gw


def sdk(gw, cls=openai.OpenAI):
    return cls(base_url=gw.http + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_sdk_sync_completions_and_chat(fleet_up):
    client = sdk(fleet_up)
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-gpt"] and models.data[0].created > 1_600_000_000
    one = client.models.retrieve("tiny-gpt")  # GET /v1/models/{id}
    assert (one.id, one.object, one.created, one.owned_by) == ("tiny-gpt", "model", models.data[0].created,
                                                              "streamfleet")
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"

    c = client.completions.create(model="tiny-gpt", prompt="Once upon a time", max_tokens=12, temperature=0,
                                  seed=1, extra_body={"ignore_eos": True})
    assert c.object == "text_completion" and c.choices[0].finish_reason == "length"
    assert c.usage.completion_tokens == 12 and c.usage.prompt_tokens > 0
    assert c.usage.total_tokens == c.usage.prompt_tokens + 12
    text = c.choices[0].text

    # the same request streamed gives the same text, chunk by chunk
    chunks = list(client.completions.create(model="tiny-gpt", prompt="Once upon a time", max_tokens=12,
                                            temperature=0, seed=1, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
    assert chunks[-1].usage.completion_tokens == 12
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"

    chat = client.chat.completions.create(model="tiny-gpt", messages=[{"role": "user", "content": "hi"}],
                                          max_completion_tokens=8, seed=3, extra_body={"ignore_eos": True})
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 8
    streamed = client.chat.completions.create(model="tiny-gpt", messages=[{"role": "user", "content": "hi"}],
                                              max_completion_tokens=8, seed=3, stream=True,
                                              extra_body={"ignore_eos": True})
    deltas = [ch.choices[0].delta for ch in streamed]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == chat.choices[0].message.content


async def test_sdk_async_streaming_with_priority_header(fleet_up):
    client = sdk(fleet_up, openai.AsyncOpenAI)

    async def one(i):
        stream = await client.chat.completions.create(
            model="tiny-gpt", messages=[{"role": "user", "content": f"story {i}"}], max_tokens=10, stream=True,
            extra_headers={"X-Priority": "high" if i % 2 else "normal"}, extra_body={"ignore_eos": True})
        return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

    texts = await asyncio.gather(*(one(i) for i in range(6)))
    assert all(texts)
    await client.close()


@pytest.mark.slow
def test_parameters_streamfleet_does_not_implement_are_refused_by_name(fleet, rds, key_prefix):
    """Never silently wrong: a request that asks for tools, stored completions or anything
    else streamfleet does not implement gets 400 naming the parameter, on the OpenAI door
    and the WebSocket alike, and nothing is queued; the same fields at their defaults are
    served. SF_REFUSE_UNSUPPORTED=false serves them without, logging a warning."""
    gw = fleet.gateway()
    fleet.worker(backend="echo")
    client = sdk(gw)
    chat = {"model": "tiny-gpt", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    refused = [
        ("store", {"store": True}),
        ("functions", {"functions": [{"name": "f", "parameters": {"type": "object"}}]}),  # the pre-tools API
        ("prediction", {"prediction": {"type": "content", "content": "x"}}),
    ]
    for param, fields in refused:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**chat, **fields)
        assert e.value.body["param"] == param and e.value.body["code"] == "invalid_request", e.value.body
        assert "not supported" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # completions serve it (tests/integration/test_echo.py)
        client.chat.completions.create(**chat, extra_body={"echo": True})
    assert e.value.body["param"] == "echo"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-gpt", prompt="x", max_tokens=4, suffix="and so on")
    assert e.value.body["param"] == "suffix"
    # the defaults ask for nothing: served
    r = client.chat.completions.create(**chat, presence_penalty=0, frequency_penalty=0.0, logprobs=False,
                                       logit_bias={}, response_format={"type": "text"}, tools=[])
    assert r.choices[0].finish_reason in ("stop", "length")
    # the WebSocket generate frame takes the same rule
    with ws_connect(gw.ws) as ws:
        ws.send(orjson.dumps({"type": "generate", "id": "a", "prompt": "x", "max_tokens": 4,
                              "suffix": "and so on"}).decode())
        err = orjson.loads(ws.recv(timeout=10))
        assert err["type"] == "error" and err["id"] == "a" and err["param"] == "suffix", err
    lane = f"{key_prefix}:{{tiny-gpt}}:tasks:normal"
    assert rds.xinfo_stream(lane)["entries-added"] == 1  # only the request with defaults

    lenient = fleet.gateway(refuse_unsupported=False)
    r = sdk(lenient).chat.completions.create(**chat, store=True)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert "unsupported parameters ignored" in lenient.log() and "store" in lenient.log()


def test_sdk_errors(fleet_up):
    client = sdk(fleet_up)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x")
    assert e.value.body["code"] == "model_not_found"  # OpenAI's word for it
    with pytest.raises(openai.BadRequestError) as e:  # tiny-gpt's context is 256 tokens
        client.chat.completions.create(model="tiny-gpt", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=250, response_format={"type": "json_object"})
    assert (e.value.body["code"], e.value.body["param"]) == ("context_length_exceeded", "max_tokens")
    assert "has a context of 256 tokens" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # for streams only, as OpenAI documents it
        client.completions.create(model="tiny-gpt", prompt="x", stream_options={"include_usage": True})
    assert e.value.body["param"] == "stream_options"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-gpt", prompt="x", n=17)
    assert e.value.body["code"] == "out_of_range" and e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-gpt", messages=[{"role": "user", "content": "x"}],
                                       temperature=7)
    assert e.value.body["code"] == "out_of_range" and e.value.body["param"] == "temperature"
    r = httpx.post(fleet_up.http + "/v1/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.get(fleet_up.http + "/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()


BAD = [
    ({"prompt": "hi", "max_tokens": 0}, "out_of_range"),
    ({"prompt": "hi", "max_tokens": "many"}, "invalid_type"),
    ({"prompt": "hi", "top_p": 0}, "out_of_range"),
    ({"prompt": "hi", "stop": [3]}, "invalid_type"),
    ({"prompt": "hi", "model": "nope"}, "unknown_model"),
    ({"prompt": ""}, "invalid_request"),
    ({"prompt": "word " * 2000}, "prompt_too_long"),
    ({"prompt": "hi", "priority": "urgent"}, "out_of_range"),
    ({"prompt": 5}, "invalid_type"),
]


async def test_same_bad_input_same_code_on_both_protocols(fleet_up):
    c = await Client.connect(fleet_up.ws)
    async with httpx.AsyncClient() as http:
        for body, code in BAD:
            await c.send({"type": "generate", "id": "x", **body})
            ws_err = await c.next_other()
            r = await http.post(fleet_up.http + "/v1/completions", json=body)
            # the same code, in OpenAI's words on its door where it has its own
            assert ws_err["code"] == code and r.json()["error"]["code"] == OPENAI_CODE.get(code, code), \
                (body, ws_err, r.text)
            assert ws_err["status"] == r.status_code
    await c.close()


def test_sse_headers_and_first_token_before_last_is_generated(slow_fleet, rds):
    lane = f"{slow_fleet.prefix}:{{tiny-gpt}}:tasks:normal"
    body = {"model": "tiny-gpt", "prompt": "Once upon a time", "max_tokens": 200, "stream": True,
            "ignore_eos": True, "seed": 9}
    with httpx.stream("POST", slow_fleet.http + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        assert r.headers["x-accel-buffering"] == "no"
        assert "content-encoding" not in r.headers
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                first = orjson.loads(line[6:])
                break
        # the first chunk is here while the worker is still generating the rest
        assert first["choices"][0]["text"] is not None
        assert rds.xpending(lane, "workers")["pending"] == 1
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert orjson.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    _wait_pending(rds, lane, 0, 10)  # acked: the module's next test sees only its own request


def test_echo_with_logprobs_on_an_engine_that_cannot_is_refused_by_name(slow_fleet):
    """The echo engine gives no prompt logits: its worker refuses the prompt's log
    probabilities with 400 naming it (the model's engine.toml says onnxruntime, so the
    gateway cannot know), never an approximation; echo without logprobs is served."""
    client = sdk(slow_fleet)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-gpt", prompt="Once upon a time", echo=True, logprobs=1, max_tokens=2)
    assert e.value.body["code"] == "invalid_request" and "EchoEngine" in e.value.body["message"]
    r = client.completions.create(model="tiny-gpt", prompt="Once upon a time", echo=True, max_tokens=2)
    assert r.choices[0].text.startswith("Once upon a time") and r.usage.completion_tokens == 2


def test_sse_keepalive_comment(fleet):
    gw = fleet.gateway(sse_keepalive_s=0.3)  # no worker: the request waits in the lane
    with httpx.stream("POST", gw.http + "/v1/completions", json={"prompt": "hi", "stream": True},
                      timeout=30) as r:
        assert r.status_code == 200
        seen = []
        for line in r.iter_lines():
            seen.append(line)
            if line.startswith(": keepalive"):
                break
    assert ": keepalive" in seen


def _wait_pending(rds, lane: str, want: int, timeout: float) -> float:
    t0 = time.monotonic()
    until(lambda: rds.xpending(lane, "workers")["pending"] == want, lambda: str(rds.xpending(lane, "workers")),
          timeout=timeout, interval=0.005)
    return time.monotonic() - t0


def test_sse_disconnect_cancels_and_frees_the_slot(slow_fleet, rds):
    lane = f"{slow_fleet.prefix}:{{tiny-gpt}}:tasks:normal"
    body = {"prompt": "Once upon a time", "max_tokens": 240, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", slow_fleet.http + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
        assert rds.xpending(lane, "workers")["pending"] == 1
    # the client went away mid-generation: the worker lets the sequence go and acks the task
    assert _wait_pending(rds, lane, 0, 5) < 2.0


def test_unstreamed_disconnect_cancels_and_frees_the_slot(slow_fleet, rds):
    lane = f"{slow_fleet.prefix}:{{tiny-gpt}}:tasks:normal"
    body = orjson.dumps({"prompt": "Once upon a time", "max_tokens": 240, "ignore_eos": True})
    sock = socket.create_connection(("127.0.0.1", slow_fleet.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    _wait_pending(rds, lane, 1, 10)
    sock.close()
    assert _wait_pending(rds, lane, 0, 5) < 2.0


def test_prompt_lists_and_token_id_prompts(fleet_up):
    """As OpenAI serves them (LangChain's legacy OpenAI.batch sends such lists): one choice
    set per prompt, prompt p's choice j at index p * n + j, each prompt counted once."""
    client = sdk(fleet_up)
    args = dict(model="tiny-gpt", max_tokens=5, temperature=0, seed=3, extra_body={"ignore_eos": True})
    one = {p: client.completions.create(prompt=p, **args) for p in ("Once upon a time", "The cat")}
    many = client.completions.create(prompt=["Once upon a time", "The cat"], n=2, **args)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert [c.text for c in many.choices[:2]] == [one["Once upon a time"].choices[0].text] * 2
    assert [c.text for c in many.choices[2:]] == [one["The cat"].choices[0].text] * 2
    assert many.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in one.values())
    assert many.usage.completion_tokens == 20
    # token ids: the same prompt as its text gives the same completion
    ids = httpx.post(fleet_up.http + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 1,
                                                              "logprobs": 0}).json()
    assert ids["usage"]["prompt_tokens"] == one["Once upon a time"].usage.prompt_tokens
    from streamfleet.shared.modelrepo import ModelRepository, load_tokenizer

    tok = load_tokenizer(ModelRepository().get("tiny-gpt"))
    prompt_ids = tok.encode("Once upon a time")
    by_ids = client.completions.create(prompt=prompt_ids, **args)
    assert by_ids.choices[0].text == one["Once upon a time"].choices[0].text
    both = client.completions.create(prompt=[prompt_ids, tok.encode("The cat")], **args)
    assert [c.text for c in both.choices] == [one[p].choices[0].text for p in ("Once upon a time", "The cat")]
    # streamed: each chunk names its choice
    chunks = list(client.completions.create(prompt=["Once upon a time", "The cat"], stream=True, **args))
    texts = {0: "", 1: ""}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.text
    assert texts == {0: one["Once upon a time"].choices[0].text, 1: one["The cat"].choices[0].text}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt=["fine", [10**9]], **args)
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt=["fine", ""], **args)
    assert e.value.body["message"].startswith("prompt 1: ") and e.value.body["param"] == "prompt"
