"""The WebSocket protocol state, in memory."""

from __future__ import annotations

import orjson
import pytest

from streamfleet.shared.errors import ValidationError

from streamfleet.gateway.protocol import Cancel, ConnectionProtocol, Resume, Send, Submit, render
from streamfleet.gateway.request_stream import End, Failed, Token


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
    assert render("a", "rid", Token(3, "hi")) == {"type": "token", "id": "a", "index": 3, "text": "hi"}
    frame = render("a", "rid", End("stop", 2, 5, {"ttft_ms": 1.0}))
    assert frame["type"] == "done" and frame["usage"] == {"prompt_tokens": 2, "completion_tokens": 5}
    err = render("a", "rid", Failed(ValidationError("bad", code="out_of_range", param="top_p")))
    assert err == {"type": "error", "id": "a", "code": "out_of_range", "status": 400, "message": "bad",
                   "param": "top_p"}
    orjson.dumps(frame)
