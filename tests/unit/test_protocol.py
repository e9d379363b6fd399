"""The WebSocket protocol state, in memory."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from streamfleet.gateway.admission.validation import Validator
from streamfleet.gateway.protocols.frames import Cancel, ConnectionProtocol, Resume, Send, Submit, render
from streamfleet.shared.errors import ErrorCode, StreamfleetError, ValidationError
from streamfleet.shared.keys import LANES
from streamfleet.shared.modelrepo import ModelRepository
from streamfleet.shared.schema import DoneEvent, ErrorEvent, TokenEvent
from streamfleet.shared.settings import GatewaySettings
from tests.support.fuzzframes import frames, plausible


class FakeValid:
    def __init__(self, client_id):
        self.client_id = client_id


class StubValidator:
    """Accepts frames with a string prompt; the real rules are tested in test_validation."""

    def check(self, msg):
        if not isinstance(msg.get("prompt"), str):
            raise ValidationError("prompt", code="invalid_type", param="prompt")
        return FakeValid(msg["id"])


def proto(**kw) -> ConnectionProtocol:
    return ConnectionProtocol(StubValidator(), **kw)


def codes(outs):
    return [o.frame.get("code") for o in outs if isinstance(o, Send)]


def test_frames_map_to_actions():
    p = proto()
    assert isinstance(p.receive_text('{"type":"generate","id":"a","prompt":"x"}')[0], Submit)
    assert codes(p.receive_text('{"type":"generate","id":"a","prompt":"x"}')) == ["duplicate_id"]
    assert isinstance(p.receive_text('{"type":"cancel","id":"a"}')[0], Cancel)
    assert codes(p.receive_text('{"type":"cancel","id":"zzz"}')) == ["unknown_id"]
    assert p.receive_text('{"type":"ping"}')[0].frame == {"type": "pong"}
    p.finished("a")
    assert isinstance(p.receive_text('{"type":"generate","id":"a","prompt":"x"}')[0], Submit)  # reusable


@pytest.mark.parametrize("raw,code", [
    ("nope", "invalid_json"), ("[]", "invalid_frame"), ('{"type":1}', "invalid_frame"),
    ('{"type":"x"}', "unknown_type"), ('{"type":"cancel"}', "missing_field"),
    ('{"type":"resume","id":"a","request_id":5}', "invalid_type"),
    ('{"type":"resume","id":"a","request_id":"ab/c"}', "invalid_request"),
    ('{"type":"resume","id":"a","request_id":"abc","from_index":-1}', "out_of_range"),
    ('{"type":"generate","id":"a","prompt":5}', "invalid_type"),
])
def test_bad_frames(raw, code):
    assert codes(proto().receive_text(raw)) == [code]


#: valid JSON that is not an object (the HTTP door gives a body of these the same code)
NOT_OBJECTS = ["[]", "0", "null", "true", '"x"', "1e308", '[{"prompt":"x"}]', '[{"messages":[]}]']


@pytest.mark.parametrize("raw", NOT_OBJECTS)
def test_json_that_is_not_an_object_is_an_invalid_frame(raw):
    [out] = proto().receive_text(raw)
    assert out.frame == {"type": "error", "id": None, "code": "invalid_frame", "status": 400,
                         "message": "a frame must be a JSON object"}


def test_limits():
    p = proto(max_inflight=2, max_frame_bytes=100)
    assert codes(p.receive_text("x" * 101)) == ["frame_too_large"]
    assert codes(p.receive_bytes(b"\x00")) == ["binary_frame"]
    p.receive_text('{"type":"generate","id":"a","prompt":"x"}')
    p.receive_text('{"type":"resume","id":"b","request_id":"abc","from_index":3}')
    assert codes(p.receive_text('{"type":"generate","id":"c","prompt":"x"}')) == ["too_many_requests"]


def test_frame_limit_counts_utf8_bytes_not_characters():
    p = proto(max_frame_bytes=100)
    euro = '"' + "€" * 40 + '"'  # 42 characters, 122 bytes
    out = p.receive_text(euro)
    assert codes(out) == ["frame_too_large"]
    assert "122 bytes" in out[0].frame["message"]
    assert codes(p.receive_text('"' + "€" * 32 + '"')) == ["invalid_frame"]  # 98 bytes: read (a string, not an object)
    assert codes(p.receive_text('"' + "e" * 98 + '"')) == ["invalid_frame"]  # 100 bytes: at the limit
    assert codes(p.receive_text('"' + "e" * 99 + '"')) == ["frame_too_large"]
    assert codes(p.receive_text('"' + "😀" * 25 + '"')) == ["frame_too_large"]  # 27 characters, 102 bytes
    assert codes(p.receive_text('"' + "😀" * 24 + '"')) == ["invalid_frame"]  # 98 bytes
    big = proto(max_frame_bytes=1 << 20).receive_text('{"type":"ping","pad":"' + "€" * 400_000 + '"}')
    assert codes(big) == ["frame_too_large"]  # 3 MB of "€" is over a 1 MiB limit


def test_resume_action():
    out = proto().receive_text('{"type":"resume","id":"a","request_id":"abc123","from_index":7}')
    assert out == [Resume("a", "abc123", 7)]


def test_render():
    assert render("a", "rid", TokenEvent("rid", 3, "hi")) == {"type": "token", "id": "a", "index": 3, "text": "hi"}
    frame = render("a", "rid", DoneEvent("rid", "stop", 2, 5, ttft_ms=1.0004, total_ms=2.0, model_version="v3"))
    assert frame == {"type": "done", "id": "a", "request_id": "rid", "finish_reason": "stop",
                     "usage": {"prompt_tokens": 2, "completion_tokens": 5},
                     "timing": {"queue_ms": 0.0, "ttft_ms": 1.0, "total_ms": 2.0}, "model_version": "v3"}
    # the gateway's own end (a cancel no worker answered): no timing, no model version
    assert render("a", "rid", DoneEvent("rid", "cancelled", 2, 1)) == {
        "type": "done", "id": "a", "request_id": "rid", "finish_reason": "cancelled",
        "usage": {"prompt_tokens": 2, "completion_tokens": 1}, "timing": {}}
    err = render("a", "rid", ErrorEvent("rid", "out_of_range", "bad", param="top_p"))
    assert err == {"type": "error", "id": "a", "code": "out_of_range", "status": 400, "message": "bad",
                   "param": "top_p"}
    assert render("a", "rid", ErrorEvent("rid", "broker_unavailable", "down", retry_after_ms=1000)) == {
        "type": "error", "id": "a", "code": "broker_unavailable", "status": 503, "message": "down",
        "retry_after_ms": 1000}
    orjson.dumps(frame)


@pytest.fixture(scope="module")
def validator(tiny_spec):
    return Validator(GatewaySettings(), ModelRepository(tiny_spec.path.parent))


_CODES = {str(c) for c in ErrorCode}


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=st.lists(st.one_of(frames, plausible), min_size=1, max_size=8))
def test_random_frames_each_get_one_valid_answer_and_only_valid_requests_become_tasks(validator, batch):
    """Random frames, and frames near the valid ones, on one connection
    (tests/support/fuzzframes.py), through the real validator: each gets exactly one
    answer; an error is a well-formed frame with a known code and a 4xx/5xx status; a
    submit is a request that finishes into a task within every range, or a 4xx refusal;
    a resume or cancel names what it may."""
    p = ConnectionProtocol(validator, max_inflight=1000)
    s = validator.settings
    for frame in batch:
        outs = p.receive_bytes(frame) if isinstance(frame, bytes) else p.receive_text(frame)
        assert len(outs) == 1, (frame, outs)
        out = outs[0]
        if isinstance(out, Send):
            f = out.frame
            orjson.dumps(f)
            if f["type"] == "pong":
                continue
            assert f["type"] == "error" and f["code"] in _CODES, f
            assert isinstance(f["message"], str) and f["message"] and 400 <= f["status"] < 600, f
        elif isinstance(out, Submit):
            assert out.request.client_id in p.in_flight
            try:
                task = validator.finish(out.request).to_task("conn", request_id="rid")
            except StreamfleetError as exc:  # refused once admitted (the prompt's tokens)
                assert 400 <= exc.status < 500 and str(exc.code) in _CODES, exc
                continue
            q = task.params
            assert task.prompt_ids and len(task.prompt_ids) < 256
            assert 1 <= q.max_tokens <= s.max_max_tokens and 0 <= q.temperature <= 2 and 0 < q.top_p <= 1
            assert q.top_k >= 0 and task.lane in LANES and task.model == "tiny-gpt"
        elif isinstance(out, Resume):
            assert out.client_id in p.in_flight and out.request_id.isalnum() and 0 <= out.from_index <= 1_000_000
        else:
            assert isinstance(out, Cancel) and out.client_id in p.in_flight
