"""The voice WebSocket's frame rules, without I/O (gateway/audio_protocol.py)."""

from __future__ import annotations

import orjson
import pytest

from streamfleet.gateway.audio_protocol import Audio, AudioProtocol, Start, Stop, TokenBucket
from streamfleet.gateway.protocol import Send
from streamfleet.gateway.validation import Validator
from streamfleet.shared.modelrepo import ModelRepository
from streamfleet.shared.settings import GatewaySettings


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def proto():
    settings = GatewaySettings()
    return AudioProtocol(Validator(settings, ModelRepository(settings.engines_dir)), settings, clock=Clock())


def start(p, **fields):
    return p.receive_text(orjson.dumps({"type": "start", **fields}).decode())


def error(outs) -> dict:
    (out,) = outs
    assert isinstance(out, Send) and out.frame["type"] == "error", outs
    return out.frame


def test_start_defaults_and_audio(proto):
    (out,) = start(proto)
    assert isinstance(out, Start)
    c = out.config
    assert (c.client_id, c.model, c.sample_rate, c.encoding, c.lane) == ("audio", "asr-en", 16000, "pcm_s16le",
                                                                         "normal")
    assert proto.receive_bytes(b"\0\0" * 320) == [Audio(b"\0\0" * 320)]
    assert isinstance(proto.receive_text('{"type": "stop"}')[0], Stop)
    assert proto.config is None


@pytest.mark.parametrize("fields, code, param", [
    ({"sample_rate": 8000}, "out_of_range", "sample_rate"),
    ({"sample_rate": "16000"}, "invalid_type", "sample_rate"),
    ({"encoding": "opus"}, "out_of_range", "encoding"),
    ({"encoding": 3}, "invalid_type", "encoding"),
    ({"model": "tiny-gpt"}, "invalid_request", "model"),
    ({"model": "nope"}, "unknown_model", "model"),
    ({"language": "fr"}, "out_of_range", "language"),
    ({"priority": "urgent"}, "out_of_range", "priority"),
    ({"id": ""}, "invalid_type", "id"),
])
def test_bad_start(proto, fields, code, param):
    err = error(start(proto, **fields))
    assert (err["code"], err.get("param")) == (code, param)
    assert proto.config is None


def test_languages_the_model_serves(proto):
    for lang in ("en", "en-US", "en_us"):
        assert isinstance(start(proto, language=lang)[0], Start)
        proto.receive_text('{"type": "stop"}')


def test_bad_frames(proto):
    assert error(proto.receive_bytes(b"\0\0" * 10))["code"] == "invalid_frame"  # audio before start
    assert error(proto.receive_text('{"type": "stop"}'))["code"] == "invalid_frame"
    start(proto)
    assert error(start(proto))["code"] == "invalid_frame"  # a second start
    assert error(proto.receive_text("hello"))["code"] == "invalid_json"
    assert error(proto.receive_text("[1]"))["code"] == "invalid_frame"
    assert error(proto.receive_text('{"type": "speak"}'))["code"] == "unknown_type"
    err = error(proto.receive_bytes(b"\0" * 33))
    assert (err["code"], err["param"]) == ("invalid_request", "audio")
    assert error(proto.receive_bytes(b"\0\0" * 1601))["code"] == "frame_too_large"  # 100.06 ms
    assert proto.receive_bytes(b"\0\0" * 1600) == [Audio(b"\0\0" * 1600)]  # 100 ms exactly
    assert error(proto.receive_text("x" * 70_000))["code"] == "frame_too_large"
    assert proto.receive_text('{"type": "ping"}')[0].frame == {"type": "pong"}


def test_frame_rate_limit_drops_the_frame_and_keeps_the_connection(proto):
    clock = proto.bucket.clock
    start(proto)
    outs = [proto.receive_bytes(b"\0\0" * 160) for _ in range(400)]
    audio = [o for o in outs if isinstance(o[0], Audio)]
    refused = [o[0].frame for o in outs if isinstance(o[0], Send)]
    assert len(audio) == 299 and len(refused) == 101  # the start frame took one token of the burst
    assert {f["code"] for f in refused} == {"rate_limited"} and all(f["retry_after_ms"] >= 1 for f in refused)
    clock.t += 1.0  # a second later, 150 more
    assert sum(isinstance(proto.receive_bytes(b"\0\0" * 160)[0], Audio) for _ in range(200)) == 150


def test_token_bucket():
    clock = Clock()
    b = TokenBucket(10, 2, clock)
    assert b.take() is None and b.take() is None
    assert b.take() == 100
    clock.t = 0.05
    assert b.take() == 50
    clock.t = 0.1
    assert b.take() is None
