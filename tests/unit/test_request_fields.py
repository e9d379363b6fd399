"""A request's fields from each door to the worker (docs/architecture.md, "Adding a field to
a request"): every field of the generate payload (``GENERATE_FIELDS``) is what
``Validator.check`` reads, and every door maps each one (or names why it does not); the
worked example, ``include_stop_str_in_output``, end to end: its validation, the typed
request, the task on the wire, the worker's re-check and its stop matcher."""

from __future__ import annotations

from typing import get_args

import orjson
import pytest

from streamfleet.gateway.admission.kinds import TextRequest
from streamfleet.gateway.admission.validation import GENERATE_FIELDS, UNSUPPORTED, GenerateField, Validator
from streamfleet.gateway.doors.grpc_server import generate_payload, grpc_carries
from streamfleet.gateway.protocols.openai_mapping import openai_carries, request_payload
from streamfleet.gateway.protocols.responses_mapping import chat_body, parse_request, responses_carries
from streamfleet.shared.errors import ErrorCode, ValidationError
from streamfleet.shared.grammar import CONSTRAINTS
from streamfleet.shared.modelrepo import ModelRepository
from streamfleet.shared.schema import SamplingParams, Task, decode_task, sampling_problem
from streamfleet.shared.settings import GatewaySettings
from streamfleet.v1 import inference_pb2 as pb
from streamfleet.workers.detokenize import StopMatcher

FIELD = "include_stop_str_in_output"
#: what a door does not take, and why: each entry is a decision, not an oversight
NOT_MAPPED = {
    # the client's id is the WebSocket frame's (gRPC: the ClientFrame's); n and best_of are
    # spread over requests by the OpenAI door, refused elsewhere
    "openai_chat": {"id", "prompt", "best_of", "n"},
    "openai_completions": {"id", "messages", "tools", "tool_choice", "parallel_tool_calls", "n", "best_of"},
    # structured outputs under the message's own names (json_schema, json_object, regex, choice, grammar)
    "grpc": {"id", "n", "best_of", "guided_json", "guided_regex", "guided_choice", "guided_grammar"},
}


@pytest.fixture(scope="module")
def validator(tiny_spec):
    return Validator(GatewaySettings(), ModelRepository(tiny_spec.path.parent))


class Recording(dict):
    """A payload that records every field read of it."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        self.read.add(key)
        return super().__contains__(key)


def test_generate_fields_are_what_validation_reads(validator):
    for p in ({"id": "a", "prompt": "hi"}, {"id": "a", "messages": [{"role": "user", "content": "hi"}]}):
        rec = Recording(p)
        validator.check(rec)
        assert rec.read <= GENERATE_FIELDS, sorted(rec.read - GENERATE_FIELDS)
        assert FIELD in rec.read


def test_each_door_places_every_field():
    """The type checker sees each door's ``match`` over ``GenerateField`` exhausted (a
    field it misses is an ``assert_never`` error); here, each placement is one it knows."""
    fields = get_args(GenerateField)
    assert set(CONSTRAINTS) <= set(fields) and len(set(fields)) == len(fields)
    for f in fields:
        assert openai_carries(f) in ("as_is", "chat_as_is", "own", "no")
        assert responses_carries(f) in ("extra", "own", "no")
        assert grpc_carries(f) in ("optional", "flag", "repeated", "own", "no")
        if grpc_carries(f) != "own" and grpc_carries(f) != "no":
            assert f in pb.GenerateRequest.DESCRIPTOR.fields_by_name, f


def test_every_door_maps_every_generate_field():
    """A field added to ``GENERATE_FIELDS`` fails here until each door maps it (or says
    why not, in ``NOT_MAPPED``)."""
    wanted = set(GENERATE_FIELDS) - set(UNSUPPORTED)
    chat = request_payload({name: True for name in wanted if name not in ("prompt", "messages", "logprobs",
                                                                          *NOT_MAPPED["openai_chat"])}
                           | {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, chat=True)
    assert wanted - NOT_MAPPED["openai_chat"] <= set(chat), sorted(wanted - NOT_MAPPED["openai_chat"] - set(chat))
    completions = request_payload({name: True for name in wanted if name not in (  # top_logprobs: from logprobs
                                       "prompt", "messages", "logprobs", "top_logprobs",
                                       *NOT_MAPPED["openai_completions"])}
                                  | {"prompt": "hi", "logprobs": 2}, chat=False)
    assert wanted - NOT_MAPPED["openai_completions"] <= set(completions), \
        sorted(wanted - NOT_MAPPED["openai_completions"] - set(completions))
    req = pb.GenerateRequest(prompt="hi", priority=pb.PRIORITY_HIGH, json_schema="{}",
                             messages=[pb.ChatMessage(role="user", content="hi")], tools=[pb.Tool(name="f")],
                             tool_choice="auto", logit_bias={1: 1.0})
    for f in pb.GenerateRequest.DESCRIPTOR.fields:  # every other field set, so that it shows
        if f.name in ("prompt", "priority", "json_schema", "messages", "tools", "tool_choice", "logit_bias"):
            continue
        if f.is_repeated:
            getattr(req, f.name).append("x" if f.type == f.TYPE_STRING else 1)
        else:
            setattr(req, f.name, True if f.type == f.TYPE_BOOL else "x" if f.type == f.TYPE_STRING else 1)
    grpc = set(generate_payload(req, "x"))
    assert wanted - NOT_MAPPED["grpc"] <= grpc | {"response_format"}, sorted(wanted - NOT_MAPPED["grpc"] - grpc)


def test_the_field_is_validated_into_the_typed_request(validator):
    on = validator.check({"id": "a", "prompt": "hi", "stop": ["x"], FIELD: True})
    assert isinstance(on, TextRequest) and on.params.include_stop_str_in_output is True
    assert validator.check({"id": "a", "prompt": "hi"}).params.include_stop_str_in_output is False
    assert validator.check({"id": "a", "prompt": "hi", FIELD: None}).params.include_stop_str_in_output is False
    for bad in (1, "true", [True]):
        with pytest.raises(ValidationError) as err:
            validator.check({"id": "a", "prompt": "hi", FIELD: bad})
        assert err.value.code == ErrorCode.invalid_type and err.value.param == FIELD


def test_each_door_carries_the_field():
    assert request_payload({"prompt": "hi", FIELD: True}, chat=False)[FIELD] is True
    assert request_payload({"messages": [{"role": "user", "content": "hi"}], FIELD: True}, chat=True)[FIELD] is True
    assert generate_payload(pb.GenerateRequest(prompt="hi", include_stop_str_in_output=True), "x")[FIELD] is True
    assert FIELD not in generate_payload(pb.GenerateRequest(prompt="hi"), "x")
    responses = parse_request({"model": "m", "input": "hi", FIELD: True})
    assert chat_body(responses, list(responses.items))[FIELD] is True


def test_the_task_carries_the_field_only_when_set(validator):
    off = validator.generate({"id": "a", "prompt": "hi"}).to_task("conn", request_id="r")
    assert FIELD not in orjson.loads(off.encode())["params"]  # a worker that predates it reads the same
    on = validator.generate({"id": "a", "prompt": "hi", FIELD: True}).to_task("conn", request_id="r")
    raw = on.encode()
    assert orjson.loads(raw)["params"][FIELD] is True
    back = decode_task(raw)
    assert isinstance(back, Task) and back.params.include_stop_str_in_output is True
    both = validator.generate({"id": "a", "prompt": "hi", FIELD: True, "logprobs": True}).to_task("c", request_id="r")
    assert decode_task(both.encode()).params.include_stop_str_in_output is True


def test_the_worker_rechecks_the_field():
    assert sampling_problem(SamplingParams(include_stop_str_in_output=True), 100) is None
    assert FIELD in sampling_problem(SamplingParams(include_stop_str_in_output=1), 100)  # type: ignore[arg-type]


def test_the_stop_matcher_keeps_the_stop_string_when_asked():
    for include, want in ((False, "Hello "), (True, "Hello END")):
        m = StopMatcher(["END"], include)
        out = [m.push(t) for t in ("Hel", "lo E", "N", "D and more")]
        assert "".join(s for s, _ in out) == want and out[-1][1] and m.hit
        assert m.flush() == ""
