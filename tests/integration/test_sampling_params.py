"""Logits processing and log probabilities through the fleet, driven by the official
`openai` SDK (and the WebSocket and gRPC doors): each parameter is checked against what
it must do to the tokens, which the log probabilities let a client see."""

from __future__ import annotations

import asyncio
import math
from collections import Counter

import openai
import orjson
import pytest
from websockets.sync.client import connect as ws_connect

from streamfleet.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc
from tests.support.grpcclient import sync_channel

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def gw(module_fleet):
    gw = module_fleet.gateway(grpc=True)
    module_fleet.worker()
    return gw


def sdk(gw, cls=openai.OpenAI):
    return cls(base_url=gw.http + "/v1", api_key="unused", max_retries=0, timeout=60)


def complete(client, **kw):
    args = {"model": "tiny-gpt", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "seed": 7,
            "extra_body": {"ignore_eos": True}}
    extra = kw.pop("extra_body", {})
    args.update(kw)
    args["extra_body"] = {**args["extra_body"], **extra}
    return client.completions.create(**args)


def chat_tokens(client, **kw):
    """The chat completion and its tokens (``(token, logprob, top)``) from the logprobs."""
    args = {"model": "tiny-gpt", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24,
            "temperature": 0, "seed": 7, "logprobs": True, "top_logprobs": 20, "extra_body": {"ignore_eos": True}}
    extra = kw.pop("extra_body", {})
    args.update(kw)
    args["extra_body"] = {**args["extra_body"], **extra}
    return client.chat.completions.create(**args)


def test_chat_logprobs_describe_every_token(gw):
    client = sdk(gw)
    r = chat_tokens(client, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 24
    # the tokens' bytes are the text (but for EOS, generated past with ignore_eos, which is
    # a special token the text leaves out), and greedy picks each position's most likely token
    assert b"".join(bytes(c.bytes) for c in content if c.token != "<|endoftext|>").decode() \
        == r.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 5 and c.logprob <= 0
        lps = [t.logprob for t in c.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert c.token == c.top_logprobs[0].token and c.logprob == pytest.approx(lps[0], abs=1e-5)
    # the probabilities are a distribution: the 20 best never sum past 1
    r20 = chat_tokens(client, max_tokens=4)
    for c in r20.choices[0].logprobs.content:
        assert sum(math.exp(t.logprob) for t in c.top_logprobs) <= 1.0 + 1e-4
    # streamed: the same tokens and log probabilities, chunk by chunk
    chunks = list(client.chat.completions.create(
        model="tiny-gpt", messages=[{"role": "user", "content": PROMPT}], max_tokens=24, temperature=0, seed=7,
        logprobs=True, top_logprobs=5, stream=True, extra_body={"ignore_eos": True}))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    # (to float32 rounding: a batch's shape changes the engine's summation order)
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)
    # not asked: none
    plain = client.chat.completions.create(model="tiny-gpt", messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=4, seed=7)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_in_the_legacy_shape(gw):
    client = sdk(gw)
    r = complete(client, logprobs=3, max_tokens=10)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    assert "".join(t for t in lp.tokens if t != "<|endoftext|>") == r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # the 3 most likely, and the sampled token among them (greedy: it is the first)
        assert len(top) == 3 and max(top.values()) == pytest.approx(val, abs=1e-5) and top[tok] == val
    # logprobs: 0 is the sampled token's alone, as OpenAI gives it (up to logprobs + 1)
    zero = complete(client, logprobs=0, max_tokens=3).choices[0].logprobs
    assert len(zero.token_logprobs) == 3
    assert zero.top_logprobs == [{t: v} for t, v in zip(zero.tokens, zero.token_logprobs)]
    # sampled, the chosen token may lie outside the top k: it is there too
    hot = complete(client, logprobs=1, max_tokens=20, temperature=1.5, seed=11).choices[0].logprobs
    for tok, val, top in zip(hot.tokens, hot.token_logprobs, hot.top_logprobs):
        assert top[tok] == val and 1 <= len(top) <= 2


def test_frequency_and_presence_penalties_change_the_greedy_choice_as_defined(gw):
    """Greedy with penalties picks, at each position, the token whose log probability
    minus its penalty (frequency * count so far + presence if seen) is highest: checked
    against every alternative the top-20 list shows."""
    client = sdk(gw)
    plain = [c.token for c in chat_tokens(client, max_tokens=40).choices[0].logprobs.content]
    for fp, pp in ((1.5, 0.0), (0.0, 1.5), (0.7, 0.7)):
        content = chat_tokens(client, max_tokens=40, frequency_penalty=fp, presence_penalty=pp).choices[0]\
            .logprobs.content
        seen: Counter = Counter()
        for c in content:
            def score(tok, lp, fp=fp, pp=pp, seen=seen):
                return lp - fp * seen[tok] - (pp if seen[tok] else 0.0)
            best = max(score(t.token, t.logprob) for t in c.top_logprobs)
            assert score(c.token, c.logprob) >= best - 1e-4, (fp, pp, c.token)
            seen[c.token] += 1
        assert [c.token for c in content] != plain  # the greedy loop of the demo model is broken up
    # and the repetition it stops: fewer repeats than without
    rep = chat_tokens(client, max_tokens=40, frequency_penalty=2.0).choices[0].logprobs.content
    assert len({c.token for c in rep}) > len(set(plain))


def test_repetition_penalty_logit_bias_and_min_p(gw):
    client = sdk(gw)
    plain = chat_tokens(client, max_tokens=40).choices[0].logprobs.content
    rep = chat_tokens(client, max_tokens=40, extra_body={"repetition_penalty": 5.0}).choices[0].logprobs.content
    assert len({c.token for c in rep}) > len({c.token for c in plain})
    # logit_bias: +100 makes one token every token, even sampled at temperature 1
    greedy = ws_tokens(gw)
    tid, text = greedy[3]["logprobs"]["id"], greedy[3]["logprobs"]["token"]
    forced = chat_tokens(client, max_tokens=10, temperature=1.0, top_logprobs=0, logit_bias={str(tid): 100})
    assert {c.token for c in forced.choices[0].logprobs.content} == {text}
    # -100 bans the greedy first token
    first = greedy[0]["logprobs"]
    banned = ws_tokens(gw, max_tokens=5, logit_bias={str(first["id"]): -100})
    assert banned[0]["logprobs"]["id"] != first["id"]
    # min_p: every sampled token is within min_p of the best, on the tempered distribution
    temp, min_p = 1.5, 0.3
    floor = temp * math.log(min_p)
    for seed in range(6):
        content = chat_tokens(client, max_tokens=30, temperature=temp, top_logprobs=1, seed=seed,
                              extra_body={"min_p": min_p}).choices[0].logprobs.content
        assert all(c.logprob - c.top_logprobs[0].logprob >= floor - 1e-4 for c in content)
    # (without it the same sampling goes below that floor: the check can fail)
    below = 0
    for seed in range(6):
        content = chat_tokens(client, max_tokens=30, temperature=temp, top_logprobs=1, seed=seed)\
            .choices[0].logprobs.content
        below += sum(c.logprob - c.top_logprobs[0].logprob < floor for c in content)
    assert below > 0


def ws_tokens(gw, **fields) -> list[dict]:
    """The token frames of a WebSocket request (greedy, with log probabilities: they
    carry the token ids)."""
    with ws_connect(gw.ws) as ws:
        ws.send(orjson.dumps({"type": "generate", "id": "a", "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                              "seed": 7, "ignore_eos": True, "logprobs": True, **fields}).decode())
        frames = []
        while not frames or frames[-1]["type"] not in ("done", "error"):
            frames.append(orjson.loads(ws.recv(timeout=30)))
    assert frames[-1]["type"] == "done", frames[-1]
    return [f for f in frames if f["type"] == "token"]


def test_stop_token_ids_and_min_tokens(gw):
    client = sdk(gw)
    tokens = ws_tokens(gw, top_logprobs=2)  # the WebSocket's token frames carry the ids
    assert len(tokens) == 12 and all(len(f["logprobs"]["top"]) == 2 for f in tokens)
    assert all(f["logprobs"]["id"] == f["logprobs"]["top"][0]["id"] for f in tokens)
    ids = [f["logprobs"]["id"] for f in tokens]
    # the first time the 4th token appears, the completion ends there (it is not output)
    stop = ids[3]
    cut = ids.index(stop)
    r = complete(client, max_tokens=12, extra_body={"stop_token_ids": [stop]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == cut
    # min_tokens holds it off: the stop token is never drawn before that many tokens
    r = complete(client, max_tokens=12, logprobs=0, extra_body={"stop_token_ids": [stop], "min_tokens": 8})
    assert r.usage.completion_tokens >= 8


async def test_same_seed_same_tokens_alone_or_batched(gw):
    """Penalties, bias and min_p are per row: a request's tokens do not depend on what
    shares its batch."""
    client = sdk(gw, openai.AsyncOpenAI)
    ask = {"model": "tiny-gpt", "prompt": PROMPT, "max_tokens": 32, "temperature": 0.9, "seed": 11,
           "frequency_penalty": 0.8, "presence_penalty": 0.3, "logit_bias": {"5": -3, "17": 2},
           "extra_body": {"ignore_eos": True, "repetition_penalty": 1.3, "min_p": 0.05}}
    alone = (await client.completions.create(**ask)).choices[0].text
    others = [client.completions.create(model="tiny-gpt", prompt=f"{PROMPT} {i}", max_tokens=40, temperature=1.0,
                                        seed=i, extra_body={"ignore_eos": True}) for i in range(10)]
    batched = await asyncio.gather(client.completions.create(**ask), *others, client.completions.create(**ask))
    assert batched[0].choices[0].text == alone == batched[-1].choices[0].text


def test_grpc_carries_the_parameters_and_logprobs(gw):
    with sync_channel(gw.grpc) as ch:
        stub = pb_grpc.InferenceStub(ch)
        events = list(stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=6, temperature=0, seed=7,
                                                       ignore_eos=True, logprobs=True, top_logprobs=3,
                                                       frequency_penalty=1.0, logit_bias={5: -1.0}), timeout=30))
    tokens = [e.token for e in events if e.WhichOneof("event") == "token"]
    assert len(tokens) == 6
    for t in tokens:
        assert len(t.logprob.top) == 3 and t.logprob.logprob <= 0 and t.logprob.bytes


@pytest.mark.parametrize("fields,param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": "high"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": [5, 1]}, "logit_bias"),
    ({"min_p": 1.5}, "min_p"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
    ({"min_tokens": 100, "max_tokens": 10}, "min_tokens"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": 2}, "logprobs"),
])
def test_bad_values_are_refused_by_name(gw, fields, param):
    client = sdk(gw)
    body = {"max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-gpt", messages=[{"role": "user", "content": "x"}],
                                       extra_body=body)
    assert e.value.body["param"] == param, e.value.body
    # the WebSocket says the same
    with ws_connect(gw.ws) as ws:
        ws.send(orjson.dumps({"type": "generate", "id": "a", "prompt": "x", **body}).decode())
        err = orjson.loads(ws.recv(timeout=10))
    assert err["type"] == "error" and err["param"] == param, err
