"""The default model, SmolLM2-135M-Instruct (a real Llama: 49152-token byte-level BPE
vocabulary, ChatML chat template, 4096-token context as served), through one fleet of
real processes: the OpenAI chat with its template, structured outputs, forced and `auto`
tool calls, `n`, log probabilities, WebSocket, gRPC, SSE resume, hot reload and the
takeover of a SIGKILLed worker's request from its log, all shown on it instead of on
the bigram toy. Greedy (temperature 0) wherever texts are compared; few tokens each.

Skipped where the model's GGUF file is not cached (`streamfleet serve` fetches it; the
suite never downloads it). The fleet serves a private model repository (version 1, and
version 2 for the reload: tests/support/smollm2.py)."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys

import httpx
import jsonschema
import openai
import orjson
import pytest

from streamfleet.shared.modelrepo import load_tokenizer
from streamfleet.shared.redis import sync_client
from streamfleet.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc
from tests.support.grpcclient import aio_channel
from tests.support.smollm2 import GGUF, MODEL, SPEC, private_repository
from tests.support.wsclient import Client

pytestmark = pytest.mark.slow  # the real SmolLM2 model served

if not GGUF.is_file():
    pytest.skip(f"{GGUF} is not cached (streamfleet serve fetches it)", allow_module_level=True)

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
#: a long greedy answer (no EOS within 64 tokens): room to interrupt it
STORY = [{"role": "user", "content": "Write a story about a dragon who learns to bake bread."}]
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
INVENT = [{"role": "user", "content": "Invent a fictional person. Reply in JSON with their name and age."}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    return private_repository(tmp_path_factory.mktemp("engines"))


@pytest.fixture(scope="module")
def gw(module_fleet, engines):
    """One gateway and one worker (2 threads) on smollm2-135m; SSE clients that drop keep
    their request 30 s for a Last-Event-ID reconnect."""
    gw = module_fleet.gateway(engines_dir=engines, models=MODEL, default_model=MODEL, sse_resume_grace_s=30)
    worker = module_fleet.worker(model=MODEL, engines_dir=engines, threads=2, wait=False)
    module_fleet.wait_worker(worker, MODEL, timeout=180)
    return gw


@pytest.fixture(scope="module")
def tok(engines):
    """The model's tokenizer (its folder built by ``engines``)."""
    return load_tokenizer(SPEC)


def sdk(gw, cls=openai.OpenAI):
    return cls(base_url=gw.http + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_with_the_chatml_template_ends_on_im_end(gw, tok):
    client = sdk(gw)
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = client.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=24, temperature=0)
    text, choice = r.choices[0].message.content, r.choices[0]
    assert "Paris" in text, text
    # ended by the model's ChatML EOS (<|im_end|>, id 2), which is not shown
    assert choice.finish_reason == "stop" and r.usage.completion_tokens < 24
    assert "<|im_end|>" not in text and "<|im_start|>" not in text
    # the prompt is the template's: the default system prompt, the user turn, the assistant's opening
    chatml = tok.apply_chat_template(CAPITAL, tokenize=False, add_generation_prompt=True)
    assert chatml.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert r.usage.prompt_tokens == 37 == len(tok.encode(chatml, add_special_tokens=False))
    # that text as a raw completion prompt is the same request: the same tokens, the same answer
    raw = client.completions.create(model=MODEL, prompt=chatml, max_tokens=24, temperature=0)
    assert raw.usage.prompt_tokens == 37 and raw.choices[0].text == text and raw.choices[0].finish_reason == "stop"
    # streamed, chunk by chunk, the same text, with the largest max_tokens the 4096 context
    # leaves beside the 37-token prompt (a larger one is refused, naming the context)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=4096 - 37, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    # a stop string (here "of Fr", across " of" and " France") ends the text before it
    stop = text[12:17]
    cut = client.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == text[:text.index(stop)]


async def test_a_json_schema_is_met_every_time_with_sensible_values(gw):
    client = sdk(gw, openai.AsyncOpenAI)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    greedy = await client.chat.completions.create(model=MODEL, messages=INVENT, max_tokens=40, temperature=0,
                                                  response_format=fmt)
    replies = [greedy] + list(await asyncio.gather(*(
        client.chat.completions.create(model=MODEL, messages=INVENT, max_tokens=40, temperature=0.7, seed=100 + i,
                                       response_format=fmt) for i in range(20))))  # batched on the worker
    people = []
    for r in replies:
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        person = json.loads(choice.message.content)
        jsonschema.validate(person, PERSON)
        people.append(person)
    # sensible: the greedy answer is a name, and so are most sampled ones (about 3 in 4 over
    # 100 seeds; the rest are nicknames, "Unknown", a name with a comma...)
    assert re.fullmatch(r"[A-Z][a-z]+(?: [A-Z][a-z]+)*", people[0]["name"]), people[0]
    names = [p["name"] for p in people]
    assert sum(bool(re.fullmatch(r"[A-Z][a-z]+(?:[ -][A-Z][a-z]+)*", n.strip())) for n in names) >= 11, names
    assert len(set(names)) >= 10, names  # sampled, not one canned answer
    ages = sorted(p["age"] for p in people)
    assert 10 <= ages[len(ages) // 2] <= 60, ages


def test_tool_calls_forced_and_auto(gw):
    client = sdk(gw)

    def chat(**kw):
        return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", ASK),
                                              max_tokens=kw.pop("max_tokens", 40), temperature=0, tools=TOOLS, **kw)

    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, temperature=0)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = chat(tool_choice=choice, parallel_tool_calls=False)  # one call (several would not fit in 40 tokens)
        # the tools reached the model: its template has no place for them, so a system message offers them
        assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 15
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (call,) = c.message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, WEATHER)
        assert args["city"] == "Paris", args
    # auto: the 135M model answers in words (it was not trained to call tools); either way
    # the reply is well formed: a call with valid arguments, or text
    r = chat(tool_choice="auto")
    c = r.choices[0]
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "get_weather"
        jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), WEATHER)
    else:
        assert c.message.content and c.finish_reason in ("stop", "length")
    # the call and its result go back in the history, written into the ChatML turns
    earlier = {"id": call.id, "type": "function",
               "function": {"name": "get_weather", "arguments": call.function.arguments}}
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [earlier]},
                     {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    r = chat(messages=history, tool_choice="none", max_tokens=24)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None
    bare = client.chat.completions.create(model=MODEL, messages=ASK + [{"role": "assistant", "content": ""}],
                                          max_tokens=1, temperature=0)
    # the call's text (~15 tokens) and the result (~10): a template without tool_calls would drop the call
    assert r.usage.prompt_tokens > bare.usage.prompt_tokens + 25


def test_n_choices_and_log_probabilities(gw):
    client = sdk(gw)
    haiku = [{"role": "user", "content": "Write a haiku about the sea."}]
    r = client.chat.completions.create(model=MODEL, messages=haiku, max_tokens=12, temperature=0.8, seed=7, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert all(texts) and len(set(texts)) >= 2, texts  # sampled apart
    assert 3 <= r.usage.completion_tokens <= 36  # one usage for the three

    g = client.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=12, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = g.choices[0].logprobs.content
    assert len(content) == g.usage.completion_tokens
    for e in content:
        tops = e.top_logprobs
        assert len(tops) == 3 and [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert tops[0].token == e.token and tops[0].logprob == pytest.approx(e.logprob)  # greedy: the top one
        assert e.logprob <= 0
    assert b"".join(bytes(e.bytes) for e in content).decode() == g.choices[0].message.content


async def test_websocket_and_grpc_take_messages(gw):
    c = await Client.connect(gw.ws)
    ws = await c.generate("cap", messages=CAPITAL, max_tokens=24, temperature=0, prompt=None)
    assert ws.end["type"] == "done" and ws.end["finish_reason"] == "stop", ws.end
    assert "Paris" in ws.text and ws.end["usage"]["prompt_tokens"] == 37
    assert ws.indices == list(range(len(ws.tokens)))
    # multi-byte UTF-8 over byte-level tokens: whole characters in every frame
    french = [{"role": "user", "content": "Écris une phrase en français avec des accents."}]
    fr = await c.generate("fr", messages=french, max_tokens=16, temperature=0, prompt=None)
    assert fr.end["type"] == "done", fr.end
    assert any(len(ch.encode()) > 1 for ch in fr.text), fr.text
    assert not any("\ufffd" in t["text"] for t in fr.tokens), fr.tokens
    await c.close()

    async with aio_channel(gw.grpc) as ch:
        message = pb.ChatMessage(role="user", content=CAPITAL[0]["content"])
        req = pb.GenerateRequest(max_tokens=24, temperature=0, messages=[message])
        events = [ev async for ev in pb_grpc.InferenceStub(ch).Generate(req)]
    assert events[0].HasField("accepted") and events[-1].HasField("done")
    text = "".join(ev.token.text for ev in events if ev.HasField("token"))
    done = events[-1].done
    assert text == ws.text and done.finish_reason == "stop" and done.usage.prompt_tokens == 37
    assert done.usage.completion_tokens == ws.end["usage"]["completion_tokens"]


def test_sse_resume_with_last_event_id(gw):
    body = {"model": MODEL, "messages": STORY, "max_tokens": 40, "temperature": 0}
    ref = httpx.post(gw.http + "/v1/chat/completions", json=body, timeout=120).json()
    ref = ref["choices"][0]["message"]["content"]
    first, last_id = [], None
    with httpx.stream("POST", gw.http + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("id: "):
                last_id = line[4:]
            elif line.startswith("data: {") and last_id:
                first.append(orjson.loads(line[6:])["choices"][0]["delta"].get("content") or "")
                if len(first) == 8:
                    break  # the client drops; the gateway keeps the request for the grace
    assert last_id.endswith(":7")
    rest, finish = [], None
    with httpx.stream("POST", gw.http + "/v1/chat/completions", json={**body, "stream": True},
                      headers={"Last-Event-ID": last_id}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = orjson.loads(line[6:])
                if chunk["choices"]:
                    rest.append(chunk["choices"][0]["delta"].get("content") or "")
                    finish = chunk["choices"][0]["finish_reason"] or finish
    assert "".join(first + rest) == ref and finish == "length"


async def test_hot_reload_to_version_2_serves_the_same_text(gw, module_fleet, engines):
    c = await Client.connect(gw.ws)
    before = await c.generate("before", messages=CAPITAL, max_tokens=24, temperature=0, prompt=None)
    assert before.end["model_version"] == "1"
    stop = asyncio.Event()
    results = []

    async def traffic(k: int) -> None:
        i = 0
        while not stop.is_set():
            results.append(await c.generate(f"t{k}-{i}", messages=CAPITAL, max_tokens=12, temperature=0,
                                            prompt=None, timeout=120))
            i += 1

    load = [asyncio.create_task(traffic(k)) for k in range(2)]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "streamfleet", "reload", MODEL, "--to", "2", "--timeout", "150",
        env=module_fleet.env(engines_dir=engines), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 180)
    assert proc.returncode == 0, err.decode()
    assert b"every live worker serves version 2" in out
    stop.set()
    await asyncio.gather(*load)
    after = await c.generate("after", messages=CAPITAL, max_tokens=24, temperature=0, prompt=None)
    await c.close()
    assert after.end["model_version"] == "2" and after.text == before.text
    assert results and all(r.end["type"] == "done" for r in results), [r.end for r in results]  # none dropped
    assert all(r.text == before.text[:len(r.text)] for r in results)
    worker = next(p for p in module_fleet.procs if p.name == "worker")
    assert "model reloaded" in worker.log(tail=None) and "old model version freed" in worker.log(tail=None)


@pytest.mark.slow
async def test_takeover_after_a_worker_sigkill_continues_from_the_log_with_identical_text(gw, module_fleet, engines):
    """A second worker joins; the one holding a greedy request is SIGKILLed mid-way; the
    survivor takes it over (heartbeats), replays the tokens the log holds, and the client
    gets the uninterrupted run's text, every index once. Last in the module: one of its
    workers is gone after it."""
    c = await Client.connect(gw.ws)
    params = dict(messages=STORY, max_tokens=48, temperature=0, prompt=None)
    ref = await c.generate("ref", **params)
    assert ref.end["finish_reason"] == "length", ref.end
    second = module_fleet.worker(model=MODEL, engines_dir=engines, threads=2, wait=False)
    module_fleet.wait_worker(second, MODEL, timeout=180)
    fut = c.start("r", **params)
    while len(c.results["r"].tokens) < 8:
        await asyncio.sleep(0.005)
        assert not fut.done(), c.results["r"].end
    rds = sync_client(module_fleet.redis_url)
    try:
        prefix = module_fleet.prefix
        # the shared lane, or the affinity stream of the worker holding the prompt (routing)
        lanes = sorted(rds.scan_iter(match=f"{prefix}:{{{MODEL}}}:tasks:normal*", _type="stream"))
        pending = [p for lane in lanes for p in rds.xpending_range(lane, "workers", "-", "+", 10)]
        info = orjson.loads(rds.hget(f"{prefix}:workers:{MODEL}", pending[0]["consumer"]))
    finally:
        rds.close()
    victim = next(p for p in module_fleet.procs if p.name == "worker" and p.popen.pid == info["pid"])
    victim.popen.send_signal(signal.SIGKILL)
    res = await asyncio.wait_for(fut, 90)
    await c.close()
    assert res.end["type"] == "done", res.end
    assert res.indices == list(range(48)) and res.text == ref.text
    survivor = next(p for p in module_fleet.procs if p.name == "worker" and p is not victim and p.alive())
    log = survivor.log(tail=None)
    assert "took over the tasks of a dead worker" in log
    replayed = [int(m) for m in re.findall(r'"replay_tokens":(\d+)', log)]
    assert replayed and replayed[-1] >= 8, replayed  # continued from the log, not regenerated


def test_prefix_cache_and_chunked_prefill_give_the_real_models_bits(engines):
    """On the real 4-bit graph, a conversation's turns started from the prefix cache and
    fed in chunks of 256 (a 1-token tail merged, as the worker core does) get every
    logit bit for bit as a prefill in one piece without the cache (docs/scheduling.md)."""
    import numpy as np

    from streamfleet.shared.modelrepo import ModelRepository
    from streamfleet.workers.engines import load_engine

    spec = ModelRepository(engines).get(MODEL)  # its GroupQueryAttention engine (attention = "gqa")
    ref = load_engine(spec, threads=2)
    on = load_engine(spec, threads=2, prefix_cache_mb=256, prefix_block=64)
    rng = np.random.default_rng(3)
    history = rng.integers(100, 40000, 700).tolist()
    for turn in range(3):
        history += rng.integers(100, 40000, 41).tolist()
        want = ref.prefill([("r", history)])[0]
        n = on.start([("o", history)])[0]
        rest = history[n:]
        cuts = list(range(0, len(rest), 256))
        if len(rest) - cuts[-1] == 1 and len(cuts) > 1:
            cuts.pop()
        for a, b in zip(cuts, [*cuts[1:], len(rest)]):
            got = on.extend([("o", rest[a:b])])[0]
        assert np.array_equal(want, got), f"turn {turn}"
        token = int(np.argmax(want))
        assert np.array_equal(ref.decode([("r", token)]), on.decode([("o", token)]))
        ref.release("r")
        on.release("o")
        history.append(token)
    assert on.prefix_cache.stats.cached_tokens >= 2 * 704
