"""The voice WebSocket's frame rules, without I/O (gateway/protocols/audio_protocol.py)."""

from __future__ import annotations

import orjson
import pytest

from streamfleet.gateway.admission.validation import Validator
from streamfleet.gateway.protocols.audio_protocol import Audio, AudioProtocol, Start, Stop, TokenBucket
from streamfleet.gateway.protocols.frames import Send
from streamfleet.shared.modelrepo import ModelRepository
from streamfleet.shared.settings import GatewaySettings


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_proto(**overrides) -> AudioProtocol:
    settings = GatewaySettings(**overrides)
    return AudioProtocol(Validator(settings, ModelRepository(settings.engines_dir)), settings, clock=Clock())


@pytest.fixture
def proto():
    return make_proto()


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


def test_frame_rate_limit_drops_the_frame_and_keeps_the_connection():
    proto = make_proto(audio_max_realtime=0)  # the frame count alone (4 s of audio at once)
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


def test_token_bucket_of_seconds():
    clock = Clock()
    b = TokenBucket(1.5, 2.0, clock)  # 1.5 s of audio a second, 2 s ahead
    assert b.take(1.0) is None and b.take(0.9) is None
    assert b.take(0.2) == 67  # 0.1 s there, 0.1 s more comes in 67 ms
    clock.t = 1.0
    assert b.take(1.6) is None  # 0.1 + 1.5


def frames(p, n: int, ms: int = 100) -> list:
    return [p.receive_bytes(b"\0\0" * (16 * ms)) for _ in range(n)]


def test_audio_faster_than_the_real_time_limit_is_dropped_with_one_error_a_second():
    """SF_AUDIO_MAX_REALTIME 1.5, burst 2 s: 150 frames of 100 ms in one second (15 s of
    audio) pass 3.5 s, and the first frame over gets the error at once."""
    p = make_proto(audio_frames_per_s=1000, audio_frames_burst=1000)
    clock = p.clock
    start(p)
    outs = []
    for i in range(150):
        clock.t = i / 150
        outs.append(p.receive_bytes(b"\0\0" * 1600))
    audio = [o for o in outs if o and isinstance(o[0], Audio)]
    errors = [o[0].frame for o in outs if o and isinstance(o[0], Send)]
    silent = [o for o in outs if o == []]
    assert 34 <= len(audio) <= 36  # 2 s at once, then 1.5 s a second
    first_over = next(i for i, o in enumerate(outs) if not (o and isinstance(o[0], Audio)))
    assert isinstance(outs[first_over][0], Send)  # answered at the first frame over the limit
    assert len(errors) == 1 and len(audio) + len(errors) + len(silent) == 150
    err = errors[0]
    assert (err["type"], err["code"], err["status"], err["param"]) == ("error", "rate_limited", 429, "audio")
    assert err["retry_after_ms"] >= 1 and "1.5x real time" in err["message"] and "dropped" in err["message"]
    # over the limit again more than a second after that error: the next error counts
    # this frame and those dropped without one
    clock.t = 2.0
    p.audio_bucket.tokens, p.audio_bucket.at = 0.0, clock.t
    (out,) = p.receive_bytes(b"\0\0" * 1600)
    assert isinstance(out, Send) and f"{len(silent) + 1} frames" in out.frame["message"], out.frame
    assert p.dropped_frames == 0


def test_audio_in_real_time_with_jitter_passes():
    p = make_proto()
    clock = p.clock
    start(p)
    # 60 s of 20 ms frames in real time, arriving in bunches of up to a second late
    t = 0.0
    for n in range(3000):
        if n % 50 == 0:
            t = n * 0.02 + 1.0  # a second's frames held up, then all at once
        clock.t = max(clock.t, t)
        assert isinstance(p.receive_bytes(b"\0\0" * 320)[0], Audio), n
    assert p.dropped_frames == 0


def test_no_real_time_limit_when_off():
    p = make_proto(audio_max_realtime=0, audio_frames_per_s=1000, audio_frames_burst=1000)
    start(p)
    assert all(isinstance(o[0], Audio) for o in frames(p, 200))
