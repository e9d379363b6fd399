"""``POST /v1/embeddings`` through the lanes (gateway/doors/embeddings.py, workers/embedcore.py;
docs/openai.md, "Embeddings"): a fleet of one gateway and one embedding worker
serving a tiny random BERT (tests/support/tinybert.py) beside tiny-gpt, from a private
model repository. The official ``openai`` SDK (base64 by default, which it decodes
itself, and ``float``) and LangChain's ``OpenAIEmbeddings`` get the vectors
``OnnxEmbeddingEngine.embed`` gives in this process on the same folder, alone and
batched; token-id inputs; usage; every limit refused with a 400 naming it; and the text
endpoints refuse the embedding model by name. The WebSocket's ``embed`` frame gets the same
vectors in one ``embeddings`` frame, the same refusals as ``error`` frames, and can be
cancelled (not resumed) by its own connection only."""

from __future__ import annotations

import asyncio
import shutil
import time

import httpx
import numpy as np
import openai
import pytest
import redis

from streamfleet.shared.keys import GROUP, Keys
from streamfleet.shared.modelrepo import load_tokenizer
from streamfleet.shared.schema import DeadLetter, DoneEvent, EmbeddingEvent, EmbedTask, LogEntry
from streamfleet.workers.engines.embedding import OnnxEmbeddingEngine
from tests.support.keys import add_key
from tests.support.tinybert import tiny_embedding_model
from tests.support.wait import until
from tests.support.wsclient import Client

MODEL = "tiny-embed"
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a", "streams and lanes and workers",
         "hello world, again and again"]
MAX_FRAME = 200_000


@pytest.fixture(scope="module")
def embed_fleet(module_fleets, tiny_spec, tmp_path_factory):
    """The fleet (private engines dir: tiny-gpt and the tiny BERT) with a worker of the
    tiny BERT: the factory, its engines dir and the model's spec."""
    engines = tmp_path_factory.mktemp("embeddings") / "engines"
    engines.mkdir()
    shutil.copytree(tiny_spec.path, engines / tiny_spec.name, ignore=shutil.ignore_patterns("versions", "plans"))
    spec = tiny_embedding_model(engines, MODEL)
    fleet = module_fleets()
    fleet.worker(model=MODEL, engines_dir=engines)
    return fleet, engines, spec


@pytest.fixture(scope="module")
def parts(embed_fleet):
    """The fleet's gateway (auth off), and the model's engine and tokenizer in this process."""
    fleet, engines, spec = embed_fleet
    gw = fleet.gateway(engines_dir=engines, max_frame_bytes=MAX_FRAME)
    return gw, OnnxEmbeddingEngine(spec, threads=1), load_tokenizer(spec), spec


@pytest.fixture(scope="module")
def gw(parts):
    return parts[0]


def sdk(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.http + "/v1", api_key="unused", max_retries=0, timeout=60)


def _cos(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def _alone(engine, tok, texts) -> np.ndarray:
    return np.stack([engine.embed([tok.encode(t)])[0] for t in texts])


def test_the_sdk_gets_the_engines_vectors_in_base64_and_in_floats(parts):
    gw, engine, tok, spec = parts
    want = _alone(engine, tok, TEXTS)
    for fmt in ("base64", "float"):  # the SDK asks for base64 itself when none is named, and decodes it
        kw = {} if fmt == "base64" else {"encoding_format": "float"}
        res = sdk(gw).embeddings.create(model=MODEL, input=TEXTS, **kw)
        assert [d.index for d in res.data] == list(range(len(TEXTS))) and res.model == MODEL
        got = np.array([d.embedding for d in res.data])
        assert got.shape == (len(TEXTS), spec.dimensions)
        assert _cos(got, want).min() >= 0.99999, fmt
        tokens = sum(len(tok.encode(t)) for t in TEXTS)
        assert (res.usage.prompt_tokens, res.usage.total_tokens) == (tokens, tokens)
    one = sdk(gw).embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float")
    assert len(one.data) == 1 and _cos(one.data[0].embedding, want[1]) >= 0.99999


def test_base64_is_the_little_endian_float32_bytes(parts):
    gw, engine, tok, _spec = parts
    body = httpx.post(gw.http + "/v1/embeddings", json={"model": MODEL, "input": TEXTS[0],
                                                        "encoding_format": "base64", "user": "u1"}, timeout=60).json()
    import base64
    got = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
    assert _cos(got, engine.embed([tok.encode(TEXTS[0])])[0]) >= 0.99999


def test_token_id_inputs(parts):
    gw, engine, tok, _spec = parts
    ids = [tok.encode(t) for t in TEXTS[:3]]
    many = sdk(gw).embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert _cos([d.embedding for d in many.data], engine.embed(ids)).min() >= 0.99999
    assert many.usage.prompt_tokens == sum(map(len, ids))
    one = sdk(gw).embeddings.create(model=MODEL, input=ids[1], encoding_format="float")
    assert len(one.data) == 1 and _cos(one.data[0].embedding, engine.embed([ids[1]])[0]) >= 0.99999


def test_requests_side_by_side_are_batched_and_each_gets_its_own(parts):
    import concurrent.futures as cf

    gw, engine, tok, _spec = parts
    want = _alone(engine, tok, TEXTS)
    client = sdk(gw)
    with cf.ThreadPoolExecutor(len(TEXTS)) as pool:
        results = list(pool.map(lambda t: client.embeddings.create(model=MODEL, input=[t, TEXTS[0]]), TEXTS))
    for i, res in enumerate(results):
        assert _cos(res.data[0].embedding, want[i]) >= 0.99999 and _cos(res.data[1].embedding, want[0]) >= 0.99999


def _post(gw, body: dict | bytes):
    if isinstance(body, bytes):
        return httpx.post(gw.http + "/v1/embeddings", content=body, headers={"content-type": "application/json"},
                          timeout=60)
    return httpx.post(gw.http + "/v1/embeddings", json=body, timeout=60)


@pytest.mark.parametrize("body, status, words, param", [
    ({"model": MODEL, "input": []}, 400, "'input' is empty", "input"),
    ({"model": MODEL, "input": ""}, 400, "input 0 is an empty string", "input"),
    ({"model": MODEL, "input": ["a", ""]}, 400, "input 1 is an empty string", "input"),
    ({"model": MODEL, "input": [[5, 6], []]}, 400, "input 1 is an empty list", "input"),
    ({"model": MODEL, "input": ["a"] * 2049}, 400, "holds 2049 inputs; the limit is 2048", "input"),
    ({"model": MODEL, "input": [[5] * 10, [5] * 49]}, 400, "input 1 has 49 tokens, over the limit of model "
                                                          "'tiny-embed' (48 tokens", "input"),
    ({"model": MODEL, "input": ["a", "word " * 60]}, 400, "input 1 has 122 tokens, over the limit of model "
                                                        "'tiny-embed' (48 tokens", "input"),
    ({"model": MODEL, "input": [[5, 6], [5, 10**6]]}, 400, "input 1 holds token id 1000000, outside the "
                                                         "vocabulary", "input"),
    ({"model": MODEL, "input": [[5, -1]]}, 400, "input 0 holds token id -1", "input"),
    ({"model": MODEL, "input": [["a"]]}, 400, "input 0 must be a list of token ids", "input"),
    ({"model": MODEL, "input": 7}, 400, "'input' must be a string", "input"),
    ({"model": MODEL}, 400, "'input' is required", "input"),
    ({"input": "a"}, 400, "'model' is required", "model"),
    ({"model": MODEL, "input": "a", "dimensions": 16}, 400, "'dimensions' must be 32 for model 'tiny-embed'",
     "dimensions"),
    ({"model": MODEL, "input": "a", "encoding_format": "int8"}, 400, "'encoding_format' must be", "encoding_format"),
    ({"model": MODEL, "input": "a", "user": 5}, 400, "'user' must be a string", "user"),
    ({"model": MODEL, "input": "a", "nonsense": 1}, 400, "unrecognized request argument supplied: 'nonsense'",
     "nonsense"),
    ({"model": "tiny-gpt", "input": "a"}, 400, "model 'tiny-gpt' is a text model, not an embedding model", "model"),
    ({"model": "nope", "input": "a"}, 404, "nope", "model"),
])
def test_each_limit_is_refused_by_name(gw, body, status, words, param):
    r = _post(gw, body)
    err = r.json()["error"]
    assert r.status_code == status and words in err["message"] and err["param"] == param, err


def test_the_right_dimensions_are_accepted(parts):
    gw, _engine, _tok, spec = parts
    r = _post(gw, {"model": MODEL, "input": "a", "dimensions": spec.dimensions, "encoding_format": "float"})
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == spec.dimensions


def test_a_body_over_the_doors_limit_is_refused(gw):
    r = _post(gw, b'{"model": "tiny-embed", "input": "' + b"a " * MAX_FRAME + b'"}')
    assert r.status_code == 413 and f"exceeds the limit of {MAX_FRAME}" in r.json()["error"]["message"]


def test_the_sdk_sees_a_refusal_as_a_bad_request(gw):
    with pytest.raises(openai.BadRequestError, match="over the limit of model 'tiny-embed'"):
        sdk(gw).embeddings.create(model=MODEL, input=["word " * 60])


def test_text_endpoints_refuse_the_embedding_model_by_name(gw):
    for call in (lambda c: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}]),
                 lambda c: c.completions.create(model=MODEL, prompt="hi")):
        with pytest.raises(openai.BadRequestError, match="model 'tiny-embed' is an embedding model, not a text "
                                                         "model; post its inputs to /v1/embeddings"):
            call(sdk(gw))


def test_models_lists_the_embedding_model(gw):
    models = {m["id"]: m for m in httpx.get(gw.http + "/v1/models", timeout=30).json()["data"]}
    assert models[MODEL]["kind"] == "embedding" and models[MODEL]["workers"] == 1
    assert models[MODEL]["chat_template"] is None


def test_langchain(parts):
    from langchain_openai import OpenAIEmbeddings

    gw, engine, tok, _spec = parts
    emb = OpenAIEmbeddings(model=MODEL, base_url=gw.http + "/v1", api_key="x", check_embedding_ctx_length=False)
    docs = emb.embed_documents(TEXTS[:3])
    assert _cos(docs, _alone(engine, tok, TEXTS[:3])).min() >= 0.99999
    query = emb.embed_query(TEXTS[3])
    assert _cos(query, _alone(engine, tok, TEXTS[3:4])[0]) >= 0.99999


def _until(what, timeout: float = 20.0):
    return until(what, timeout=timeout)


def test_a_dead_consumers_task_is_taken_over_and_a_malformed_one_dead_lettered(module_fleets, parts, redis_server):
    """The worker's parts serve embedding tasks as text ones: a task a consumer that died
    took (it never acked it) is reclaimed (``SF_CLAIM_IDLE_MS``) and run, its events in the
    request log (the vectors as the engine gives them), the lane emptied by the ack; a task
    that cannot be read goes to the dead letters."""
    _gw, engine, tok, spec = parts
    fleet = module_fleets()
    fleet.worker(model=MODEL, engines_dir=spec.path.parent, claim_idle_ms=300)
    keys, r = Keys(fleet.prefix), redis.Redis.from_url(redis_server.url)
    lane = keys.lane(MODEL, "normal")
    ids = [tok.encode(t) for t in TEXTS[:2]]
    task = EmbedTask("taken1", MODEL, "normal", "nobody", "c", ids, time.time(), deadline=time.time() + 60)
    with r.pipeline(transaction=True) as pipe:  # taken by a consumer that never acks, before the worker sees it
        pipe.xadd(lane, {"task": task.encode()})
        pipe.xreadgroup(GROUP, "ghost", {lane: ">"}, count=1)
        pipe.execute()

    def ended():
        events = [LogEntry.decode(f).event for _, f in r.xrange(keys.log("taken1"))]
        return events if events and isinstance(events[-1], DoneEvent) else None

    events = _until(ended)
    vectors = np.stack([e.values() for e in events if isinstance(e, EmbeddingEvent)])
    assert _cos(vectors, engine.embed(ids)).min() >= 0.99999
    assert (events[-1].finish_reason, events[-1].prompt_tokens) == ("stop", sum(map(len, ids)))
    _until(lambda: r.xlen(lane) == 0)
    r.xadd(lane, {"task": b'{"kind": "embed", "request_id": "bad1", "inputs": [1, 2]}'})
    dead = _until(lambda: [DeadLetter.decode(f) for _, f in r.xrange(keys.dead(MODEL))])
    assert dead[0].request_id == "bad1" and "malformed task" in dead[0].reason
    r.close()


def test_grpc_embed_gives_the_same_vectors_and_refuses_by_name(parts):
    """``Inference.Embed``: the HTTP door's checks, admission and lanes over gRPC."""
    import grpc

    from streamfleet.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc
    from tests.support.grpcclient import sync_channel

    gw, engine, tok, spec = parts
    channel = sync_channel(gw.grpc)
    try:
        stub = pb_grpc.InferenceStub(channel)
        res = stub.Embed(pb.EmbedRequest(model=MODEL, texts=TEXTS), timeout=60)
        got = np.array([list(e.values) for e in res.embeddings])
        assert res.model == MODEL and got.shape == (len(TEXTS), spec.dimensions)
        assert _cos(got, _alone(engine, tok, TEXTS)).min() >= 0.99999
        assert res.usage.prompt_tokens == sum(len(tok.encode(t)) for t in TEXTS)
        ids = [tok.encode(t) for t in TEXTS[:2]]
        by_ids = stub.Embed(pb.EmbedRequest(model=MODEL, token_ids=[pb.TokenIds(ids=i) for i in ids],
                                            priority=pb.PRIORITY_HIGH), timeout=60)
        assert _cos([list(e.values) for e in by_ids.embeddings], engine.embed(ids)).min() >= 0.99999
        for req, words in ((pb.EmbedRequest(model=MODEL), "'input' is required"),
                           (pb.EmbedRequest(texts=["x"]), "'model' is required"),
                           (pb.EmbedRequest(model="tiny-gpt", texts=["x"]), "not an embedding model"),
                           (pb.EmbedRequest(model=MODEL, texts=["x"], token_ids=[pb.TokenIds(ids=[1])]), "not both"),
                           (pb.EmbedRequest(model=MODEL, texts=[""]), "input 0 is an empty string"),
                           (pb.EmbedRequest(model=MODEL, token_ids=[pb.TokenIds(ids=[1] * (spec.max_context + 1))]),
                            "over the limit")):
            with pytest.raises(grpc.RpcError) as err:
                stub.Embed(req, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details(), req
    finally:
        channel.close()


# -- the WebSocket's ``embed`` frame (docs/websocket.md, "Embeddings") ----------------------------
def _ws_vectors(frame: dict) -> np.ndarray:
    assert frame["type"] == "embeddings", frame
    assert [d["index"] for d in frame["data"]] == list(range(len(frame["data"])))
    return np.array([d["embedding"] for d in frame["data"]])


async def test_ws_embed_a_string_and_a_list_get_the_http_doors_vectors(parts):
    """Accepted, then one ``embeddings`` frame: the vectors the HTTP door gives, exactly,
    and the engine's own; usage as the HTTP door counts it."""
    gw, engine, tok, spec = parts
    http = httpx.post(gw.http + "/v1/embeddings", json={"model": MODEL, "input": TEXTS, "encoding_format": "float"},
                      timeout=60).json()
    c = await Client.connect(gw.ws)
    try:
        res = await c.embed("one", TEXTS[1], MODEL)
        assert res.accepted["request_id"] == res.end["request_id"] and res.accepted["queue_depth"] >= 0
        assert (res.end["id"], res.end["model"]) == ("one", MODEL) and res.tokens == []
        assert _cos(_ws_vectors(res.end), _alone(engine, tok, TEXTS[1:2])).min() >= 0.99999
        tokens = len(tok.encode(TEXTS[1]))
        assert res.end["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
        assert set(res.end["timing"]) == {"queue_ms", "total_ms"}
        many = await c.embed("many", TEXTS, MODEL, encoding_format="float", priority="high", user="u1")
        got = _ws_vectors(many.end)
        assert got.shape == (len(TEXTS), spec.dimensions)
        assert got.tolist() == [d["embedding"] for d in http["data"]]  # the HTTP door's numbers, exactly
        assert many.end["usage"] == http["usage"]
    finally:
        await c.close()


async def test_ws_embed_base64_and_token_ids(parts):
    import base64

    gw, engine, tok, _spec = parts
    ids = [tok.encode(t) for t in TEXTS[:3]]
    c = await Client.connect(gw.ws)
    try:
        b64 = await c.embed("b", TEXTS[:2], MODEL, encoding_format="base64")
        got = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in b64.end["data"]])
        assert _cos(got, _alone(engine, tok, TEXTS[:2])).min() >= 0.99999
        many, one = await asyncio.gather(c.embed("ids", ids, MODEL), c.embed("id", ids[1], MODEL))
        assert _cos(_ws_vectors(many.end), engine.embed(ids)).min() >= 0.99999
        assert many.end["usage"]["prompt_tokens"] == sum(map(len, ids))
        assert len(one.end["data"]) == 1 and _cos(_ws_vectors(one.end)[0], engine.embed([ids[1]])[0]) >= 0.99999
    finally:
        await c.close()


@pytest.mark.parametrize("fields, code, words, param", [
    ({"input": []}, "invalid_request", "'input' is empty", "input"),
    ({"input": ["a", ""]}, "invalid_request", "input 1 is an empty string", "input"),
    ({"input": ["a"] * 2049}, "invalid_request", "holds 2049 inputs; the limit is 2048", "input"),
    ({"input": [[5] * 10, [5] * 49]}, "prompt_too_long", "input 1 has 49 tokens, over the limit of model "
                                                         "'tiny-embed' (48 tokens", "input"),
    # over the context once tokenized (after admission, as on the HTTP door)
    ({"input": ["a", "word " * 60]}, "prompt_too_long", "input 1 has 122 tokens, over the limit of model "
                                                        "'tiny-embed' (48 tokens", "input"),
    ({"input": "a", "model": "tiny-gpt"}, "invalid_request", "model 'tiny-gpt' is a text model, not an embedding "
                                                             "model", "model"),
    ({"input": "a", "dimensions": 16}, "invalid_request", "'dimensions' must be 32", "dimensions"),
    ({"input": "a", "encoding_format": "int8"}, "out_of_range", "'encoding_format' must be", "encoding_format"),
])
async def test_ws_a_bad_embed_is_an_error_frame_naming_the_parameter(gw, fields, code, words, param):
    c = await Client.connect(gw.ws)
    try:
        res = await c.embed("bad", fields.pop("input"), fields.pop("model", MODEL), **fields)
        assert res.accepted is None, res.accepted
        err = res.end
        assert (err["type"], err["id"], err["code"], err["status"], err["param"]) == ("error", "bad", code, 400,
                                                                                      param), err
        assert words in err["message"], err
        ok = await c.embed("bad", "the id is free again and the connection open", MODEL)
        assert ok.end["type"] == "embeddings"
    finally:
        await c.close()


async def test_ws_a_generate_frame_refuses_the_embedding_model(gw):
    c = await Client.connect(gw.ws)
    try:
        res = await c.generate("g", "hi", model=MODEL)
        assert (res.end["type"], res.end["code"], res.end["param"]) == ("error", "invalid_request", "model")
        assert "model 'tiny-embed' is an embedding model, not a text model" in res.end["message"]
    finally:
        await c.close()


async def test_ws_an_id_is_reused_after_its_reply_and_taken_while_in_flight(parts):
    gw, engine, tok, _spec = parts
    c = await Client.connect(gw.ws)
    try:
        first = await c.embed("x", TEXTS[0], MODEL)
        again = await c.embed("x", TEXTS[2], MODEL)  # the reply freed the id
        assert first.end["request_id"] != again.end["request_id"]
        assert _cos(_ws_vectors(again.end)[0], _alone(engine, tok, TEXTS[2:3])[0]) >= 0.99999
        # 16 requests under 16 ids at once, each answered under its own
        results = await asyncio.gather(*(c.embed(f"p{i}", TEXTS[i % len(TEXTS)], MODEL) for i in range(16)))
        for i, res in enumerate(results):
            assert _cos(_ws_vectors(res.end)[0], _alone(engine, tok, [TEXTS[i % len(TEXTS)]])[0]) >= 0.99999
    finally:
        await c.close()


@pytest.fixture(scope="module")
def idle_gw(module_fleets, parts):
    """A gateway on the same models with no embedding worker behind it (and no check for
    one): an embeddings request waits in its lane until it is cancelled."""
    spec = parts[3]
    return module_fleets().gateway(engines_dir=spec.path.parent, no_worker_grace_s=0)


async def test_ws_a_cancel_before_the_vectors_ends_it_and_only_its_connection_may(idle_gw):
    """A request waiting for a worker: another connection cannot cancel it (its ids are
    its own) nor resume it with the wrong token; with the right one the resume is refused
    by name (an embeddings request is not resumable); its own connection's ``cancel``
    ends it with ``done`` (``cancelled``), and the id is free again."""
    c, other = await Client.connect(idle_gw.ws), await Client.connect(idle_gw.ws)
    try:
        pending = c.start_embed("e", ["a", "b"], MODEL)
        deadline = time.monotonic() + 30
        while c.results["e"].accepted is None:
            assert time.monotonic() < deadline and not pending.done(), c.results["e"]
            await asyncio.sleep(0.02)
        accepted = c.results["e"].accepted
        rid, token = accepted["request_id"], accepted["resume_token"]
        await other.send({"type": "cancel", "id": "e"})
        err = await other.next_other()
        assert (err["type"], err["code"], err["id"]) == ("error", "unknown_id", "e")
        stranger = await asyncio.wait_for(other.resume("s", rid, 0, resume_token="0" * len(token)), 30)
        assert (stranger.end["code"], stranger.end["param"]) == ("unknown_request", "request_id"), stranger.end
        refused = await asyncio.wait_for(other.resume("r", rid, 0, resume_token=token), 30)
        assert (refused.end["code"], refused.end["status"], refused.end["param"]) == ("invalid_request", 400,
                                                                                      "request_id")
        assert "embeddings request" in refused.end["message"] and "cannot be resumed" in refused.end["message"]
        assert not pending.done()
        await c.send({"type": "cancel", "id": "e"})
        res = await asyncio.wait_for(pending, 30)
        assert (res.end["type"], res.end["finish_reason"], res.end["request_id"]) == ("done", "cancelled", rid)
        again = c.start_embed("e", "x", MODEL)  # the id is free again (and waits as the first did)
        deadline = time.monotonic() + 30
        while c.results["e"].accepted is None:
            assert time.monotonic() < deadline and not again.done(), c.results["e"]
            await asyncio.sleep(0.02)
    finally:
        await c.close()
        await other.close()


#: 100 tokens a second, 1,000 at once; no request limit
TOKEN_TIERS = '{"tok": {"requests_per_minute": null, "tokens_per_minute": 6000, "token_burst": 1000}}'


def test_an_embeddings_request_is_charged_its_input_tokens_by_the_token_rate_limit(embed_fleet, rds):
    """docs/admission.md, "Token rate limit": an embeddings request's input tokens are taken
    once tokenized; one of more tokens than the bucket ever holds is 400 naming the limit."""
    fleet, engines, _spec = embed_fleet
    gw = fleet.gateway(engines_dir=engines, auth_enabled="true", tiers=TOKEN_TIERS)
    key = add_key(fleet, "embedder", "tok", tiers=TOKEN_TIERS)
    headers = {"authorization": f"Bearer {key}"}
    t0 = time.monotonic()
    r = httpx.post(gw.http + "/v1/embeddings", headers=headers, json={"model": MODEL, "input": TEXTS}, timeout=60)
    elapsed = time.monotonic() - t0
    assert r.status_code == 200, r.text
    used = r.json()["usage"]["prompt_tokens"]
    left = float(rds.hget(f"{fleet.prefix}:rlt:{key.split('-', 2)[1]}", "tokens"))
    assert 1000 - used <= left <= 1000 - used + 100 * elapsed + 1  # (refilled while it ran)
    r = httpx.post(gw.http + "/v1/embeddings", headers=headers,  # several tokens an input: over 1,000 in all
                   json={"model": MODEL, "input": ["streams and lanes and workers"] * 200}, timeout=60)
    assert r.status_code == 400, r.text
    assert "token rate limit ever allows at once (1000 tokens)" in r.json()["error"]["message"]
