"""``/v1/completions`` with ``echo`` (and ``logprobs``: the prompt's log probabilities),
through a real gateway and a real tiny-gpt worker, with the `openai` SDK and raw HTTP:
the prompt's text and tokens come before the completion's, the first prompt token's log
probability is null, streamed in the first chunks, ``max_tokens`` 0 gives the prompt
alone, the completion is the one the request gets without echo, and bad input is 4xx."""

from __future__ import annotations

import httpx
import openai
import orjson
import pytest
from websockets.sync.client import connect as ws_connect

#: about 100 tiny-gpt tokens (blocks of 32 in the prefix cache; chunks of 32 in the worker)
PROMPT = ("Once upon a time there was a little fox who lived in the deep green forest near the river, "
          "and every morning she walked to the water to drink and to look at the fish that swam "
          "between the stones, wondering where they went at night. One day an old heron told her "
          "that the fish slept under the roots of the willow, and the fox laughed, because she had "
          "seen them there herself, long ago, when the summer was dry.")


@pytest.fixture(scope="module")
def gw(module_fleets):
    """A gateway and a tiny-gpt worker that feeds prompts in chunks of 32 tokens (with its
    prefix cache on, as by default)."""
    fleet = module_fleets()
    gateway = fleet.gateway()
    fleet.worker(max_step_tokens=32)
    return gateway


def sdk(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.http + "/v1", api_key="unused", max_retries=0, timeout=60)


ARGS = dict(model="tiny-gpt", temperature=0, seed=1, extra_body={"ignore_eos": True})


def check_prompt_logprobs(lp, text: str, n: int) -> None:
    """A prompt's ``n`` tokens' log probabilities as OpenAI's legacy API shows them."""
    assert len(lp.tokens) >= n and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:n])
    assert all(lp.tokens[i] in lp.top_logprobs[i] and len(lp.top_logprobs[i]) <= 2 for i in range(1, n))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    end = lp.text_offset[n] if len(lp.tokens) > n else len(text)
    assert "".join(lp.tokens[:n]) == text[:end]  # (an ASCII prompt: its tokens are its text)
    assert all(text.startswith(lp.tokens[i], lp.text_offset[i]) for i in range(n))


def test_the_sdks_echo_of_a_prompt_alone(gw):
    client = sdk(gw)
    r = client.completions.create(prompt=PROMPT, echo=True, logprobs=1, max_tokens=0, **ARGS)
    c = r.choices[0]
    assert c.text == PROMPT and c.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens > 90
    assert len(c.logprobs.tokens) == r.usage.prompt_tokens
    check_prompt_logprobs(c.logprobs, PROMPT, r.usage.prompt_tokens)
    # without logprobs: the text alone
    r = client.completions.create(prompt=PROMPT, echo=True, max_tokens=0, **ARGS)
    assert r.choices[0].text == PROMPT and r.choices[0].logprobs is None and r.usage.completion_tokens == 0


def test_echo_puts_the_prompt_before_the_completion_it_does_not_change(gw):
    client = sdk(gw)
    plain = client.completions.create(prompt=PROMPT, max_tokens=8, logprobs=1, **ARGS)
    again = client.completions.create(prompt=PROMPT, max_tokens=8, logprobs=1, **ARGS)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the prefix cache is on
    echoed = client.completions.create(prompt=PROMPT, max_tokens=8, logprobs=1, echo=True, **ARGS)
    n = echoed.usage.prompt_tokens
    # computed whole: nothing from the cache (a cached position has no logits)
    assert echoed.usage.prompt_tokens_details.cached_tokens == 0
    c, p = echoed.choices[0], plain.choices[0]
    assert c.text == PROMPT + p.text and c.finish_reason == p.finish_reason == "length"
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens == 8
    lp = c.logprobs
    check_prompt_logprobs(lp, c.text, n)
    assert lp.tokens[n:] == p.logprobs.tokens and lp.token_logprobs[n:] == p.logprobs.token_logprobs
    assert lp.top_logprobs[n:] == p.logprobs.top_logprobs
    assert lp.text_offset[n:] == [o + len(PROMPT) for o in p.logprobs.text_offset]
    alone = client.completions.create(prompt=PROMPT, echo=True, logprobs=1, max_tokens=0, **ARGS)
    assert alone.choices[0].logprobs.token_logprobs == lp.token_logprobs[:n]
    # echo without logprobs: the text, no log probabilities
    bare = client.completions.create(prompt=PROMPT, max_tokens=8, echo=True, **ARGS)
    assert bare.choices[0].text == PROMPT + p.text and bare.choices[0].logprobs is None


def sse(gw, body: dict) -> list[tuple[str | None, dict]]:
    """The ``(id, chunk)`` of each data line of a streamed request (``[DONE]`` left out)."""
    out, eid = [], None
    with httpx.stream("POST", gw.http + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("id: "):
                eid = line[4:]
            elif line.startswith("data: ") and line != "data: [DONE]":
                out.append((eid, orjson.loads(line[6:])))
                eid = None
    return out


def test_streamed_the_prompt_comes_first_in_chunks(gw):
    body = {"model": "tiny-gpt", "prompt": PROMPT, "max_tokens": 8, "logprobs": 2, "echo": True, "temperature": 0,
            "ignore_eos": True}
    whole = httpx.post(gw.http + "/v1/completions", json=body, timeout=60).json()
    n = whole["usage"]["prompt_tokens"]
    chunks = sse(gw, body)
    texts = "".join(ch["choices"][0]["text"] for _, ch in chunks)
    assert texts == whole["choices"][0]["text"]
    merged = {k: [] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    tokens_seen, prompt_chunks = 0, 0
    for eid, ch in chunks:
        lp = ch["choices"][0]["logprobs"]
        if lp is None:
            continue
        if tokens_seen < n:  # a chunk of the prompt: no id (a resume continues from a token)
            assert eid is None
            prompt_chunks += 1
        for k in merged:
            merged[k] += lp[k]
        tokens_seen += len(lp["tokens"])
    assert prompt_chunks >= 3  # chunk by chunk, as the worker computes them (32 tokens each)
    assert merged == {k: whole["choices"][0]["logprobs"][k] for k in merged}
    assert merged["token_logprobs"][0] is None and merged["top_logprobs"][0] is None
    assert chunks[-1][1]["choices"][0]["finish_reason"] == "length"
    # the prompt alone, streamed; and without logprobs the prompt's text in the first chunk
    alone = sse(gw, {**body, "max_tokens": 0})
    assert "".join(ch["choices"][0]["text"] for _, ch in alone) == PROMPT
    assert alone[-1][1]["choices"][0]["finish_reason"] == "length"
    bare = sse(gw, {**body, "logprobs": None})
    assert bare[0][1]["choices"][0]["text"] == PROMPT and bare[0][0] is None
    assert "".join(ch["choices"][0]["text"] for _, ch in bare) == whole["choices"][0]["text"]


def test_every_choice_echoes_its_own_prompt(gw):
    client = sdk(gw)
    one = client.completions.create(prompt=PROMPT, max_tokens=5, logprobs=0, echo=True, **ARGS)
    n = one.usage.prompt_tokens
    many = client.completions.create(prompt=PROMPT, max_tokens=5, logprobs=0, echo=True, n=2,
                                     **{**ARGS, "temperature": 0.9})
    assert [c.index for c in many.choices] == [0, 1]
    for c in many.choices:
        assert c.text.startswith(PROMPT)
        assert c.logprobs.token_logprobs[:n] == one.choices[0].logprobs.token_logprobs[:n]
        assert c.logprobs.text_offset[n:][:1] == [len(PROMPT)]
    best = client.completions.create(prompt=PROMPT, max_tokens=5, logprobs=0, echo=True, n=1, best_of=2,
                                     **{**ARGS, "temperature": 0.9})
    assert best.choices[0].text.startswith(PROMPT)
    assert best.choices[0].logprobs.token_logprobs[:n] == one.choices[0].logprobs.token_logprobs[:n]
    # several prompts: each choice its own
    two = client.completions.create(prompt=["The cat sat", "A dog ran far away"], max_tokens=0, echo=True,
                                    logprobs=1, **ARGS)
    assert [c.text for c in two.choices] == ["The cat sat", "A dog ran far away"]
    assert [len(c.logprobs.tokens) for c in two.choices] == [
        client.completions.create(prompt=p, max_tokens=0, echo=True, logprobs=1, **ARGS).usage.prompt_tokens
        for p in ("The cat sat", "A dog ran far away")]
    # streamed, n = 2: each choice's prompt before its completion, in its own chunks
    texts, firsts = {0: "", 1: ""}, {}
    for ch in client.completions.create(prompt=PROMPT, max_tokens=5, logprobs=0, echo=True, n=2, stream=True,
                                        **{**ARGS, "temperature": 0.9}):
        for c in ch.choices:
            texts[c.index] += c.text
            if c.logprobs is not None and c.index not in firsts:
                firsts[c.index] = c.logprobs.token_logprobs[0]
    assert all(t.startswith(PROMPT) and len(t) > len(PROMPT) for t in texts.values())
    assert firsts == {0: None, 1: None}


def test_bad_echo_input_is_4xx(gw):
    client = sdk(gw)
    cases = [
        ({"echo": "yes"}, "invalid_type", "echo"),
        ({"echo": 1}, "invalid_type", "echo"),
        ({"max_tokens": 0}, "out_of_range", "max_tokens"),  # without echo: as before
        ({"echo": True, "max_tokens": -1}, "out_of_range", "max_tokens"),
        ({"echo": True, "logprobs": 21}, "out_of_range", "logprobs"),
        ({"echo": True, "logprobs": True}, "invalid_type", "logprobs"),
        ({"echo": True, "logprobs": 1, "prompt": "word " * 300}, "context_length_exceeded", "prompt"),
    ]
    for fields, code, param in cases:
        r = httpx.post(gw.http + "/v1/completions", json={"model": "tiny-gpt", "prompt": "hi", **fields}, timeout=30)
        assert r.status_code == 400, (fields, r.text)
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == (code, param), (fields, r.text)
    with pytest.raises(openai.BadRequestError) as e:  # a completions parameter: chat refuses it, as before
        client.chat.completions.create(model="tiny-gpt", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       extra_body={"echo": True})
    assert e.value.body["param"] == "echo"
    with ws_connect(gw.ws) as ws:  # and so does the WebSocket
        ws.send(orjson.dumps({"type": "generate", "id": "a", "prompt": "x", "max_tokens": 2, "echo": True}).decode())
        err = orjson.loads(ws.recv(timeout=10))
        assert err["type"] == "error" and err["param"] == "echo", err
