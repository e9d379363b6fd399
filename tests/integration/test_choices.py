"""Several choices of one request (`n`, `best_of`) with the official `openai` SDK: each
choice streamed with its index, usage summed, the prompt prefilled once for all of
them, the best of `best_of` by log probability, and the same request giving the same
choices again."""

from __future__ import annotations

import re

import httpx
import openai
import orjson
import pytest
from websockets.sync.client import connect as ws_connect

from tests.support.ports import free_port


@pytest.fixture(scope="module")
def gw(module_fleet):
    gw = module_fleet.gateway()
    port = free_port()
    gw.extra["worker"] = module_fleet.worker(metrics_port=port)
    gw.extra["worker"].metrics_port = port
    return gw


def sdk(gw):
    return openai.OpenAI(base_url=gw.http + "/v1", api_key="unused", max_retries=0, timeout=60)


def shared_prefills(gw) -> float:
    text = httpx.get(gw.extra["worker"].metrics_url).text
    m = re.search(r'^streamfleet_worker_shared_prefills_total\{model="tiny-gpt"\} (\S+)$', text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def test_n_choices_differ_share_the_prefill_and_sum_the_usage(gw):
    client = sdk(gw)
    before = shared_prefills(gw)
    r = client.chat.completions.create(model="tiny-gpt", messages=[{"role": "user", "content": "Tell a story"}],
                                       max_tokens=16, n=4, seed=11, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) == 4
    one = client.chat.completions.create(model="tiny-gpt", messages=[{"role": "user", "content": "Tell a story"}],
                                         max_tokens=16, seed=11, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == one.usage.prompt_tokens and r.usage.completion_tokens == 4 * 16
    assert one.choices[0].message.content == texts[0]  # choice i runs seed + i
    assert shared_prefills(gw) - before == 3  # one prefill, three forks
    again = client.chat.completions.create(model="tiny-gpt", messages=[{"role": "user", "content": "Tell a story"}],
                                           max_tokens=16, n=4, seed=11, extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == texts


def test_n_choices_stream_with_their_index(gw):
    client = sdk(gw)
    whole = client.completions.create(model="tiny-gpt", prompt="Once upon a time", max_tokens=12, n=3, seed=5,
                                      extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model="tiny-gpt", prompt="Once upon a time", max_tokens=12, n=3, seed=5,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    texts = ["", "", ""]
    finishes = {}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == [c.text for c in whole.choices]
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].usage.completion_tokens == 36


def test_best_of_returns_the_most_likely(gw):
    client = sdk(gw)
    every = client.completions.create(model="tiny-gpt", prompt="The sea", max_tokens=10, n=5, seed=2, logprobs=0,
                                      extra_body={"ignore_eos": True})
    totals = [sum(c.logprobs.token_logprobs) for c in every.choices]
    best = client.completions.create(model="tiny-gpt", prompt="The sea", max_tokens=10, n=2, best_of=5, seed=2,
                                     extra_body={"ignore_eos": True})
    ranked = sorted(range(5), key=lambda i: -totals[i])[:2]
    assert [c.text for c in best.choices] == [every.choices[i].text for i in ranked]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == 50


def test_choice_limits_and_other_doors(gw):
    client = sdk(gw)
    for kwargs, param in (({"n": 17}, "n"), ({"n": 0}, "n"), ({"n": 3, "best_of": 2}, "best_of"),
                          ({"best_of": 3, "stream": True}, "best_of")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny-gpt", prompt="x", max_tokens=4, **kwargs)
        assert e.value.body["param"] == param, (kwargs, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-gpt", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       extra_body={"best_of": 2})
    assert e.value.body["param"] == "best_of"
    with ws_connect(gw.ws) as ws:  # the WebSocket multiplexes requests instead: n is refused by name
        ws.send(orjson.dumps({"type": "generate", "id": "a", "prompt": "x", "n": 2}).decode())
        err = orjson.loads(ws.recv(timeout=10))
    assert err["type"] == "error" and err["param"] == "n"
