"""The WebSocket's ``embed`` frame (docs/websocket.md, "Embeddings"), without processes
or Redis.

The frame is read by the real ``ConnectionProtocol`` with the HTTP door's real checks
(``gateway.doors.embeddings.check_body``, on a real ``Validator`` over tiny-gpt and a tiny
random BERT): what it accepts, what it refuses and how (the ``error`` frame naming the
parameter), the connection's limits it shares with ``generate``. The real ``Session``
then submits it through the HTTP door's ``submit`` and reads it with its ``EmbedCall``;
what stands in (tests/support/sessionstub.py) is the request (``ScriptedRequest``: its
submit and events are the test's) and the adapter's writes. Last, an embeddings request
cannot be resumed (``ClientRequest``'s check, run by ``ReplyChannel.resume`` before
anything is followed).
"""

from __future__ import annotations

import json
import shutil
from functools import partial
from types import SimpleNamespace

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from streamfleet.gateway.admission.validation import MAX_ID_CHARS, Validator
from streamfleet.gateway.protocols.frames import Cancel, ConnectionProtocol, Embed, Send, Submit, embeddings_frame
from streamfleet.gateway.requests.lifecycle import ClientRequest
from streamfleet.gateway.requests.reply_channel import ReplyChannel
from streamfleet.gateway.services.embeddings import MAX_INPUTS, EmbeddingsBody, check_body
from streamfleet.shared.errors import ErrorCode, RefusedError, StreamfleetError, ValidationError
from streamfleet.shared.modelrepo import ModelRepository, load_tokenizer
from streamfleet.shared.schema import DoneEvent, EmbeddingEvent, ErrorEvent, RequestRecord
from streamfleet.shared.settings import GatewaySettings
from tests.support.sessionstub import Conn, Hub, idle, refusals, until
from tests.support.tinybert import tiny_embedding_model

MODEL = "tiny-embed"  # 32 dimensions, a context of 48 tokens (tests/support/tinybert.py)
CODES = {str(c) for c in ErrorCode}


@pytest.fixture(scope="module")
def engines(tmp_path_factory, tiny_spec):
    root = tmp_path_factory.mktemp("ws-embed") / "engines"
    root.mkdir()
    shutil.copytree(tiny_spec.path, root / tiny_spec.name, ignore=shutil.ignore_patterns("versions", "plans"))
    tiny_embedding_model(root, MODEL)
    return root


@pytest.fixture(scope="module")
def validator(engines):
    return Validator(GatewaySettings(default_model="tiny-gpt"), ModelRepository(engines))


@pytest.fixture(scope="module")
def spec(validator):
    return validator.spec(MODEL)


def make_hub(validator, **settings) -> SimpleNamespace:
    """What ``check_body`` reads of the hub: its settings and validator."""
    return SimpleNamespace(settings=GatewaySettings(default_model="tiny-gpt", **settings), validator=validator)


def proto(validator, **kw) -> ConnectionProtocol:
    return ConnectionProtocol(validator, check_embed=partial(check_body, make_hub(validator)), **kw)


def embed(cid="e", **fields) -> str:
    return orjson.dumps({"type": "embed", "id": cid, "model": MODEL, **fields}).decode()


def one(outs):
    assert len(outs) == 1, outs
    return outs[0]


# -- the frame --------------------------------------------------------------------------------
@pytest.mark.parametrize("value, inputs", [
    ("hello world", ("hello world",)),
    (["a", "b c"], ("a", "b c")),
    ([5, 6, 7], ((5, 6, 7),)),  # a list of ids is one input
    ([[5, 6], [7]], ((5, 6), (7,))),
])
def test_an_embed_frame_is_an_embed_action_with_the_checked_body(validator, value, inputs):
    p = proto(validator)
    out = one(p.receive_text(embed("e1", input=value)))
    assert isinstance(out, Embed) and out.client_id == "e1" and "e1" in p.in_flight
    body = out.body
    assert isinstance(body, EmbeddingsBody) and body.spec.name == MODEL and body.inputs == inputs
    assert (body.encoding, body.lane, body.timeout_s) == ("float", "normal", GatewaySettings().request_timeout_s)


def test_the_bodys_optional_fields(validator, spec):
    out = one(proto(validator).receive_text(embed(input="x", encoding_format="base64", dimensions=spec.dimensions,
                                                   priority="high", timeout=2.5, user="u1")))
    assert isinstance(out, Embed)
    assert (out.body.encoding, out.body.lane, out.body.timeout_s) == ("base64", "high", 2.5)


@pytest.mark.parametrize("fields, code, status, param, words", [
    ({"input": []}, "invalid_request", 400, "input", "'input' is empty"),
    ({"input": ""}, "invalid_request", 400, "input", "input 0 is an empty string"),
    ({"input": ["a", ""]}, "invalid_request", 400, "input", "input 1 is an empty string"),
    ({"input": [[5, 6], []]}, "invalid_request", 400, "input", "input 1 is an empty list of token ids"),
    ({"input": ["a"] * (MAX_INPUTS + 1)}, "invalid_request", 400, "input",
     f"holds {MAX_INPUTS + 1} inputs; the limit is {MAX_INPUTS}"),
    ({"input": [[5] * 10, [5] * 49]}, "prompt_too_long", 400, "input",
     "input 1 has 49 tokens, over the limit of model 'tiny-embed' (48 tokens"),
    ({"input": [[5, 10**6]]}, "out_of_range", 400, "input", "input 0 holds token id 1000000, outside the vocabulary"),
    ({"input": [["a"]]}, "invalid_type", 400, "input", "input 0 must be a list of token ids"),
    ({"input": 7}, "invalid_type", 400, "input", "'input' must be a string"),
    ({}, "missing_field", 400, "input", "'input' is required"),
    ({"input": "a", "model": None}, "missing_field", 400, "model", "'model' is required"),
    ({"input": "a", "model": 5}, "invalid_type", 400, "model", "'model' must be a string"),
    ({"input": "a", "model": "tiny-gpt"}, "invalid_request", 400, "model",
     "model 'tiny-gpt' is a text model, not an embedding model"),
    ({"input": "a", "model": "nope"}, "unknown_model", 404, "model", "nope"),
    ({"input": "a", "dimensions": 16}, "invalid_request", 400, "dimensions",
     "'dimensions' must be 32 for model 'tiny-embed'"),
    ({"input": "a", "encoding_format": "int8"}, "out_of_range", 400, "encoding_format", "'encoding_format' must be"),
    ({"input": "a", "user": 5}, "invalid_type", 400, "user", "'user' must be a string"),
    ({"input": "a", "timeout": 0}, "out_of_range", 400, "timeout", "'timeout' must be a number of seconds"),
    ({"input": "a", "priority": "urgent"}, "out_of_range", 400, "priority", "priority"),
    ({"input": "a", "prompt": "x"}, "invalid_request", 400, "prompt", "unrecognized request argument supplied: "
                                                                       "'prompt'"),
])
def test_a_bad_embed_frame_is_an_error_naming_the_parameter(validator, fields, code, status, param, words):
    p = proto(validator)
    frame = one(p.receive_text(embed("bad", **fields))).frame
    assert frame["type"] == "error" and frame["id"] == "bad", frame
    assert (frame["code"], frame["status"], frame["param"]) == (code, status, param), frame
    assert words in frame["message"], frame
    assert p.in_flight == {}  # nothing is in flight: the id is free


def test_the_same_body_over_http_gets_the_same_refusal(validator):
    """The frame's body is the HTTP door's body: ``check_body`` on it raises what the
    frame's error says."""
    body = {"model": MODEL, "input": [[5] * 49]}
    with pytest.raises(ValidationError) as err:
        check_body(make_hub(validator), body)
    frame = one(proto(validator).receive_text(embed("x", input=body["input"]))).frame
    assert frame == err.value.to_frame("x")


def test_a_text_over_the_character_limit_is_too_long(validator):
    p = ConnectionProtocol(validator, check_embed=partial(check_body, make_hub(validator, max_prompt_chars=10)))
    frame = one(p.receive_text(embed(input=["short", "x" * 11]))).frame
    assert (frame["code"], frame["param"]) == ("prompt_too_long", "input")
    assert "input 1 has 11 characters; the limit is 10" in frame["message"]


@pytest.mark.parametrize("cid, code", [(None, "missing_field"), (5, "invalid_type"), ("", "invalid_type"),
                                       ("x" * (MAX_ID_CHARS + 1), "invalid_type")])
def test_the_id_is_checked_as_a_generate_frames(validator, cid, code):
    frame = {"type": "embed", "model": MODEL, "input": "a"}
    if cid is not None:
        frame["id"] = cid
    out = one(proto(validator).receive_text(orjson.dumps(frame).decode())).frame
    assert (out["code"], out["param"]) == (code, "id")


def test_the_connections_limits_are_shared_with_generate(validator):
    p = proto(validator, max_inflight=2)
    assert isinstance(one(p.receive_text('{"type":"generate","id":"g","prompt":"hi","model":"tiny-gpt"}')), Submit)
    assert one(p.receive_text(embed("g", input="a"))).frame["code"] == "duplicate_id"
    assert isinstance(one(p.receive_text(embed("e", input="a"))), Embed)
    assert one(p.receive_text(embed("f", input="a"))).frame["code"] == "too_many_requests"
    assert one(p.receive_text(embed("e", input="a"))).frame["code"] == "duplicate_id"
    assert one(p.receive_text('{"type":"cancel","id":"e"}')) == Cancel("e")
    p.finished("e")  # its final frame was queued: the id is free again
    assert one(p.receive_text('{"type":"cancel","id":"e"}')).frame["code"] == "unknown_id"
    assert isinstance(one(p.receive_text(embed("e", input="again"))), Embed)


def test_a_generate_frame_refuses_the_embedding_model(validator):
    frame = one(proto(validator).receive_text(
        orjson.dumps({"type": "generate", "id": "g", "model": MODEL, "prompt": "hi"}).decode())).frame
    assert (frame["code"], frame["status"], frame["param"]) == ("invalid_request", 400, "model")
    assert "model 'tiny-embed' is an embedding model, not a text model" in frame["message"]


def test_the_unknown_type_error_names_embed_where_it_is_served(validator):
    msg = one(proto(validator).receive_text('{"type":"nope","id":"a"}')).frame["message"]
    assert "expected generate, embed, cancel, resume or ping" in msg
    plain = ConnectionProtocol(validator)  # no embeddings here: an embed frame is an unknown type
    frame = one(plain.receive_text(embed(input="a"))).frame
    assert frame["code"] == "unknown_type" and "expected generate, cancel, resume or ping" in frame["message"]


# -- the answer -------------------------------------------------------------------------------
def test_the_embeddings_frame():
    vectors = [np.array([0.1, -2.5, 3.0], dtype="<f4"), np.array([1e-8, 0.0, -0.3], dtype="<f4")]
    packed = [EmbeddingEvent.pack(v) for v in vectors]
    done = DoneEvent("rid", "stop", 9, 0, queue_ms=0.4004, ttft_ms=3.0, total_ms=3.1234, model_version="v2")
    frame = embeddings_frame("e", "rid", MODEL, packed, done, "float")
    assert frame == {"type": "embeddings", "id": "e", "request_id": "rid", "model": MODEL,
                     "data": [{"index": i, "embedding": v.astype("float64").tolist()} for i, v in enumerate(vectors)],
                     "usage": {"prompt_tokens": 9, "total_tokens": 9}, "timing": {"queue_ms": 0.4, "total_ms": 3.123},
                     "model_version": "v2"}
    # written as JSON, each value reads back as the worker's float32
    back = orjson.loads(orjson.dumps(frame))
    assert all(np.array_equal(np.asarray(d["embedding"], dtype="<f4"), v) for d, v in zip(back["data"], vectors))
    b64 = embeddings_frame("e", "rid", MODEL, packed, DoneEvent("rid", "stop", 9, 0), "base64")
    assert [d["embedding"] for d in b64["data"]] == packed and b64["timing"] == {} and "model_version" not in b64


# -- through the session ----------------------------------------------------------------------
def vector(i: int) -> str:
    return EmbeddingEvent.pack(np.arange(4, dtype="<f4") + i)


async def test_an_embed_is_accepted_then_answered_with_one_embeddings_frame(validator):
    conn = Conn(Hub(validator))
    conn.identity, conn.trace_id = "key-1", "trace-1"
    conn.text({"type": "embed", "id": "e", "model": MODEL, "input": ["hello world", [5, 6]]})
    [req] = conn.hub.made
    # the connection's request under the client's id, of the connection's API key (its owner)
    assert (req.client_id, req.identity, req.channel, req.share) == ("e", "key-1", conn.channel, True)
    await until(lambda: conn.emitted)
    draft, trace = req.submitted
    assert (draft.client_id, draft.model, draft.inputs, trace) == ("e", MODEL, ("hello world", (5, 6)), "trace-1")
    assert conn.emitted == [{"type": "accepted", "id": "e", "request_id": req.request_id, "queue_depth": 7,
                             "resume_token": "tok-e"}]
    req.feed(EmbeddingEvent("rid", 1, vector(1)), EmbeddingEvent("rid", 0, vector(0)),
             DoneEvent("rid", "stop", 7, 0, queue_ms=1.0, ttft_ms=2.0, total_ms=2.0))
    await idle(conn)
    assert conn.emitted[1] == {"type": "embeddings", "id": "e", "request_id": req.request_id, "model": MODEL,
                               "data": [{"index": 0, "embedding": [0.0, 1.0, 2.0, 3.0]},
                                        {"index": 1, "embedding": [1.0, 2.0, 3.0, 4.0]}],
                               "usage": {"prompt_tokens": 7, "total_tokens": 7},
                               "timing": {"queue_ms": 1.0, "total_ms": 2.0}}
    assert len(conn.emitted) == 2 and conn.sent == []
    assert req.transport == "ws" and req.delivered_calls == 1 and req.closes and not req.watched
    assert conn.requests == {} and conn.proto.in_flight == {}  # the id is free again


async def test_base64_is_passed_on_as_the_worker_sent_it(validator):
    conn = Conn(Hub(validator))
    conn.text({"type": "embed", "id": "e", "model": MODEL, "input": "a", "encoding_format": "base64"})
    await until(lambda: conn.emitted)
    conn.hub.made[0].feed(EmbeddingEvent("rid", 0, vector(2)), DoneEvent("rid", "stop", 3, 0))
    await idle(conn)
    assert conn.emitted[-1]["data"] == [{"index": 0, "embedding": vector(2)}]


async def test_a_cancel_before_the_vectors_ends_it_with_done_cancelled(validator):
    conn = Conn(Hub(validator))
    conn.text({"type": "embed", "id": "e", "model": MODEL, "input": ["a", "b"]})
    await until(lambda: conn.emitted)
    [req] = conn.hub.made
    conn.text({"type": "cancel", "id": "e"})
    assert req.cancels == ["client"]
    req.feed(EmbeddingEvent("rid", 0, vector(0)), DoneEvent("rid", "cancelled", 2, 0))
    await idle(conn)
    assert conn.emitted[1] == {"type": "done", "id": "e", "request_id": req.request_id, "finish_reason": "cancelled",
                               "usage": {"prompt_tokens": 2, "completion_tokens": 0}, "timing": {}}
    assert conn.proto.in_flight == {}


async def test_a_workers_error_is_the_error_frame(validator):
    conn = Conn(Hub(validator))
    conn.text({"type": "embed", "id": "e", "model": MODEL, "input": "a"})
    await until(lambda: conn.emitted)
    conn.hub.made[0].feed(ErrorEvent("rid", "prompt_too_long", "input 0 has 60 tokens", param="input"))
    await idle(conn)
    err = conn.emitted[-1]
    assert (err["type"], err["id"], err["code"], err["param"]) == ("error", "e", "prompt_too_long", "input")


async def test_an_end_without_every_vector_is_an_internal_error(validator):
    conn = Conn(Hub(validator))
    conn.text({"type": "embed", "id": "e", "model": MODEL, "input": ["a", "b"]})
    await until(lambda: conn.emitted)
    conn.hub.made[0].feed(EmbeddingEvent("rid", 0, vector(0)), DoneEvent("rid", "stop", 2, 0))
    await idle(conn)
    assert (conn.emitted[-1]["type"], conn.emitted[-1]["code"]) == ("error", "internal")


async def test_a_refused_submit_is_an_error_frame_and_frees_the_id(validator):
    hub = Hub(validator)
    hub.refuse = RefusedError("rate limited", code=ErrorCode.rate_limited, retry_after_ms=250)
    conn = Conn(hub)
    before = refusals("ws", "rate_limited")
    conn.text({"type": "embed", "id": "e", "model": MODEL, "input": "a"})
    await idle(conn)
    assert conn.emitted == [{"type": "error", "id": "e", "code": "rate_limited", "status": 429,
                             "message": "rate limited", "retry_after_ms": 250}]
    assert refusals("ws", "rate_limited") == before + 1 and conn.proto.in_flight == {} and hub.made[0].closes


async def test_a_draining_gateway_refuses_an_embed_without_submitting_it(validator):
    hub = Hub(validator)
    hub.draining = True
    conn = Conn(hub)
    conn.text({"type": "embed", "id": "e", "model": MODEL, "input": "a"})
    await idle(conn)
    [req] = hub.made
    assert req.submitted is None and conn.emitted[0]["code"] == "shutting_down"


# -- no resume --------------------------------------------------------------------------------
class Broker:
    """What ``ReplyChannel.resume`` asks of the broker: the record, and the follow."""

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self.follows: list[str] = []

    async def read_request(self, request_id):
        return self.record if request_id == self.record.request_id else None

    async def follow(self, request_id, model, connection_id, ttl_s, announce=True):
        self.follows.append(request_id)


def record(model: str) -> RequestRecord:
    return RequestRecord("abc123", "owner-1", model, "conn", 0.0, 1e12, prompt_tokens=3)


def client_request(validator) -> ClientRequest:
    return ClientRequest("r", admission=None, validator=validator, broker=None, check_workers=None,
                         shared_channel=None)


async def test_an_embeddings_request_cannot_be_resumed(validator):
    broker = Broker(record(MODEL))
    channel = ReplyChannel(broker, "conn-2")
    with pytest.raises(ValidationError) as err:
        await channel.resume("abc123", "r", 0, owner="owner-1", check=client_request(validator)._resumable)
    assert (err.value.code, err.value.param, err.value.status) == (ErrorCode.invalid_request, "request_id", 400)
    assert "is an embeddings request of model 'tiny-embed'" in err.value.message
    assert "cannot be resumed" in err.value.message
    assert broker.follows == [] and channel.streams == {}  # nothing was followed
    # another tenant's request is not found, before anything says what it is
    with pytest.raises(StreamfleetError) as other:
        await channel.resume("abc123", "r", 0, owner="owner-2", check=client_request(validator)._resumable)
    assert other.value.code == ErrorCode.unknown_request


@pytest.mark.parametrize("model", ["tiny-gpt", "gone"])
def test_a_text_request_or_one_of_a_model_no_longer_served_is_resumable(validator, model):
    client_request(validator)._resumable(record(model))


# -- random frames ----------------------------------------------------------------------------
_tokens = st.lists(st.integers(min_value=-2, max_value=500), max_size=50)
_input = st.one_of(st.text(max_size=30), st.lists(st.text(max_size=10), max_size=4), _tokens,
                   st.lists(_tokens, max_size=3), st.integers(), st.none(), st.lists(st.none(), max_size=2))
embed_frames = st.fixed_dictionaries(
    {"type": st.just("embed"), "id": st.sampled_from(["a", "b", "", 5])},
    optional={"model": st.sampled_from([MODEL, MODEL, "tiny-gpt", "nope", None, 3]), "input": _input,
              "encoding_format": st.sampled_from(["float", "base64", "int8", None, 1]),
              "dimensions": st.sampled_from([32, 16, None, "32"]), "user": st.sampled_from(["u", 1, None]),
              "priority": st.sampled_from(["high", "normal", "low", "x", None]),
              "timeout": st.sampled_from([0.5, 30, 0, 4000, "1", None]), "extra": st.just(1)})


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=st.lists(embed_frames, min_size=1, max_size=6))
def test_random_embed_frames_each_get_one_answer_and_only_valid_bodies_become_requests(validator, spec, batch):
    p = proto(validator, max_inflight=1000)
    vocab = len(load_tokenizer(spec))
    for msg in batch:
        out = one(p.receive_text(json.dumps(msg)))
        if isinstance(out, Send):
            f = out.frame
            assert f["type"] == "error" and f["code"] in CODES and 400 <= f["status"] < 500, f
            assert isinstance(f["message"], str) and f["message"] and isinstance(f.get("param"), str), f
            continue
        assert isinstance(out, Embed) and out.client_id == msg["id"] and msg["id"] in p.in_flight
        body = out.body
        assert body.spec.name == MODEL and 1 <= len(body.inputs) <= MAX_INPUTS and "extra" not in msg
        for item in body.inputs:
            assert item and (isinstance(item, str) or (len(item) <= spec.max_context
                                                       and all(0 <= t < vocab for t in item)))
        p.finished(out.client_id)
