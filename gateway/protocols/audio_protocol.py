"""The voice WebSocket protocol (``GET /v1/audio/stream``) of one connection, without I/O
(docs/voice.md, "Protocol").

``AudioProtocol`` parses client frames and returns what to do:

* ``Send(frame)``      write a JSON frame to the client (errors, pong)
* ``Start(config)``    a ``start`` frame passed every rule: begin a transcription session
* ``Audio(pcm)``       a binary frame of PCM to run voice activity detection on
* ``Stop()``           the client is done speaking: end the open utterance

Nothing invalid gets past it: a bad ``start`` (unknown or non-speech model, a sample
rate, encoding or language the model cannot take), audio before ``start``, odd-length
or oversized PCM, and frames over the connection's rate (a token bucket: an over-limit
frame is dropped with ``rate_limited`` and the connection stays) are answered with the
text protocol's ``error`` frames and codes.

Audio is also accounted by its duration (docs/voice.md, "Limits"): a second token bucket
holds seconds of audio, refilled at ``SF_AUDIO_MAX_REALTIME`` seconds per second of wall
time, up to ``SF_AUDIO_REALTIME_BURST_S``. A frame that would take it below zero is
dropped (never fed to the VAD, never queued) and the client hears of it at once with
``rate_limited`` (``param: "audio"``); further drops within ``AUDIO_NOTICE_S`` are
counted into the next such error rather than answered one by one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from streamfleet.gateway.admission.validation import Validator, check_lane
from streamfleet.gateway.protocols.frames import Send
from streamfleet.shared.errors import ErrorCode, RefusedError, StreamfleetError, ValidationError
from streamfleet.shared.modelrepo import kind_phrase
from streamfleet.shared.settings import GatewaySettings

__all__ = ["AudioConfig", "AudioProtocol", "Start", "Audio", "Stop", "TokenBucket", "same_language", "ENCODINGS",
           "MAX_FRAME_MS", "AUDIO_NOTICE_S"]

#: the PCM encodings accepted (little-endian signed 16-bit mono)
ENCODINGS = ("pcm_s16le",)
#: the longest audio frame accepted (the protocol asks for 10–100 ms frames)
MAX_FRAME_MS = 100
MAX_ID_CHARS = 128
#: after an audio frame over the real-time limit is answered with ``rate_limited``, more
#: frames dropped within this many seconds are not answered one by one: the next error
#: (once this has passed and a frame is dropped again) counts them
AUDIO_NOTICE_S = 1.0


@dataclass(frozen=True, slots=True)
class AudioConfig:
    """A transcription session, as its ``start`` frame set it up."""

    client_id: str
    model: str
    sample_rate: int
    encoding: str
    language: str
    lane: str

    @property
    def bytes_per_ms(self) -> float:
        return self.sample_rate * 2 / 1000


@dataclass(slots=True)
class Start:
    config: AudioConfig


@dataclass(slots=True)
class Audio:
    pcm: bytes


@dataclass(slots=True)
class Stop:
    pass


Output = Send | Start | Audio | Stop


class TokenBucket:
    """``rate`` tokens a second on average, ``burst`` at once: frames (a token each), or
    seconds of audio (a frame costs its duration)."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self.tokens = burst
        self.at = clock()

    def take(self, cost: float = 1.0) -> int | None:
        """Take ``cost`` tokens: None when there were that many, else the ms until there
        are (nothing is taken then)."""
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens + 1e-9 >= cost:
            self.tokens = max(0.0, self.tokens - cost)
            return None
        return max(1, math.ceil((cost - self.tokens) / self.rate * 1000 - 1e-6))


class AudioProtocol:
    """Frame parsing of one voice connection.

    Args:
        validator: the gateway's ``Validator`` (models and their specs).
        settings: the gateway's settings (``max_frame_bytes``, ``default_asr_model``,
            ``audio_frames_per_s``, ``audio_frames_burst``, ``audio_max_realtime``,
            ``audio_realtime_burst_s``).
    """

    def __init__(self, validator: Validator, settings: GatewaySettings,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.validator = validator
        self.settings = settings
        self.clock = clock
        self.config: AudioConfig | None = None
        self.bucket = TokenBucket(settings.audio_frames_per_s, settings.audio_frames_burst, clock)
        #: seconds of audio, refilled at ``audio_max_realtime`` per second (None: no limit).
        #: One per connection, kept across its sessions: a ``stop`` and a new ``start`` do
        #: not refill it
        self.audio_bucket = (TokenBucket(settings.audio_max_realtime, settings.audio_realtime_burst_s, clock)
                             if settings.audio_max_realtime > 0 else None)
        self.dropped_frames = 0  # over the real-time limit since the last error said so
        self.dropped_ms = 0.0
        self._noticed_at = -math.inf  # when the last real-time error went out

    # -- frames --------------------------------------------------------------------------
    def _over_rate(self) -> list[Output]:
        """Take a frame's token: [] when there was one, else the ``rate_limited`` error
        that goes out instead of handling the frame."""
        retry = self.bucket.take()
        if retry is None:
            return []
        return [Send(RefusedError(f"more than {self.settings.audio_frames_per_s:g} frames a second; this frame "
                                  f"was dropped", code=ErrorCode.rate_limited,
                                  retry_after_ms=retry).to_frame(self._id()))]

    def receive_bytes(self, data: bytes) -> list[Output]:
        refused = self._over_rate()
        if refused:
            return refused
        cfg = self.config
        if cfg is None:
            return [Send(ValidationError("audio before 'start': send a start frame first",
                                         code=ErrorCode.invalid_frame).to_frame(None))]
        if len(data) % 2:
            return [Send(ValidationError(f"an audio frame of {len(data)} bytes is not whole 16-bit samples",
                                         code=ErrorCode.invalid_request, param="audio").to_frame(cfg.client_id))]
        limit = int(MAX_FRAME_MS * cfg.bytes_per_ms)
        if len(data) > limit:
            return [Send(ValidationError(f"an audio frame of {len(data)} bytes is more than {MAX_FRAME_MS} ms "
                                         f"({limit} bytes at {cfg.sample_rate} Hz); send 10-100 ms frames",
                                         code=ErrorCode.frame_too_large, param="audio").to_frame(cfg.client_id))]
        if not data:
            return []
        dropped = self._over_realtime(data, cfg)
        if dropped is not None:
            return dropped
        return [Audio(data)]

    def _over_realtime(self, data: bytes, cfg: AudioConfig) -> list[Output] | None:
        """Charge a frame's duration to the real-time bucket: None when it fits, else the
        frame is dropped and the result is what the client gets for it: the
        ``rate_limited`` error, or nothing when one went out within ``AUDIO_NOTICE_S``
        (the next one counts this frame too)."""
        bucket = self.audio_bucket
        if bucket is None:
            return None
        ms = len(data) / cfg.bytes_per_ms
        retry = bucket.take(ms / 1000)
        if retry is None:
            return None
        self.dropped_frames += 1
        self.dropped_ms += ms
        now = self.clock()
        if now - self._noticed_at < AUDIO_NOTICE_S:
            return []
        self._noticed_at = now
        limit = self.settings.audio_max_realtime
        frames, dropped_ms = self.dropped_frames, self.dropped_ms
        self.dropped_frames, self.dropped_ms = 0, 0.0
        what = "this frame" if frames == 1 else f"{frames} frames"
        return [Send(RefusedError(
            f"audio is arriving faster than {limit:g}x real time (at most {limit:g} s of audio per second, "
            f"{self.settings.audio_realtime_burst_s:g} s ahead at once); {what} ({dropped_ms:.0f} ms of audio) "
            f"dropped, not transcribed. Frames over the limit in the next {AUDIO_NOTICE_S:g} s are dropped "
            f"too; send audio in real time", code=ErrorCode.rate_limited, param="audio",
            retry_after_ms=retry).to_frame(cfg.client_id))]

    def receive_text(self, text: str) -> list[Output]:
        refused = self._over_rate()
        if refused:
            return refused
        limit = min(self.settings.max_frame_bytes, 64 * 1024)  # control frames are small
        if len(text) > limit or len(text.encode("utf-8", "surrogatepass")) > limit:
            return [Send(ValidationError(f"a text frame may be at most {limit} bytes",
                                         code=ErrorCode.frame_too_large).to_frame(self._id()))]
        try:
            msg = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            return [Send(ValidationError(f"frame is not valid JSON: {exc.msg}",
                                         code=ErrorCode.invalid_json).to_frame(self._id()))]
        if not isinstance(msg, dict):
            return [Send(ValidationError("a frame must be a JSON object",
                                         code=ErrorCode.invalid_frame).to_frame(self._id()))]
        kind = msg.get("type")
        if kind == "start":
            if self.config is not None:
                return [Send(ValidationError("already started; send 'stop' before another 'start'",
                                             code=ErrorCode.invalid_frame).to_frame(self._id()))]
            try:
                self.config = self.check_start(msg)
            except StreamfleetError as exc:
                cid = msg.get("id") if isinstance(msg.get("id"), str) else None
                return [Send(exc.to_frame(cid))]
            return [Start(self.config)]
        if kind == "stop":
            if self.config is None:
                return [Send(ValidationError("'stop' before 'start'", code=ErrorCode.invalid_frame).to_frame(None))]
            self.config = None
            return [Stop()]
        if kind == "ping":
            return [Send({"type": "pong"})]
        if not isinstance(kind, str):
            return [Send(ValidationError("field 'type' must be a string", code=ErrorCode.invalid_frame,
                                         param="type").to_frame(self._id()))]
        shown = kind if len(kind) <= 32 else kind[:32] + "…"
        return [Send(ValidationError(f"unknown frame type {shown!r}; expected start, stop or ping (audio goes "
                                     f"in binary frames)", code=ErrorCode.unknown_type,
                                     param="type").to_frame(self._id()))]

    def _id(self) -> str | None:
        return self.config.client_id if self.config is not None else None

    # -- the start frame -----------------------------------------------------------------
    def check_start(self, msg: dict[str, Any]) -> AudioConfig:
        """Every rule of a ``start`` frame.

        Raises:
            ValidationError, NotFoundError: which rule, in the code and param.
        """
        cid = msg.get("id", "audio")
        if not isinstance(cid, str) or not cid or len(cid) > MAX_ID_CHARS:
            raise ValidationError(f"'id' must be a non-empty string of at most {MAX_ID_CHARS} characters",
                                  code=ErrorCode.invalid_type, param="id")
        model = msg.get("model", self.settings.default_asr_model)
        if model is None:
            model = self.settings.default_asr_model
        if not isinstance(model, str):
            raise ValidationError("'model' must be a string", code=ErrorCode.invalid_type, param="model")
        spec = self.validator.spec(model)
        if spec.kind != "asr":
            raise ValidationError(f"model {model!r} is {kind_phrase(spec.kind)}, not a speech model; use "
                                  f"/v1/stream for it", code=ErrorCode.invalid_request, param="model")
        rate = msg.get("sample_rate", spec.sample_rate)
        if not isinstance(rate, int) or isinstance(rate, bool):
            raise ValidationError("'sample_rate' must be an integer", code=ErrorCode.invalid_type,
                                  param="sample_rate")
        if rate != spec.sample_rate:
            raise ValidationError(f"model {model!r} takes {spec.sample_rate} Hz audio, not {rate} Hz; resample "
                                  f"before sending", code=ErrorCode.out_of_range, param="sample_rate")
        encoding = msg.get("encoding", ENCODINGS[0])
        if encoding not in ENCODINGS:
            raise ValidationError(f"'encoding' must be one of {', '.join(ENCODINGS)} (mono), not {encoding!r}",
                                  code=ErrorCode.out_of_range if isinstance(encoding, str)
                                  else ErrorCode.invalid_type, param="encoding")
        language = msg.get("language")
        if language is not None:
            if not isinstance(language, str):
                raise ValidationError("'language' must be a string", code=ErrorCode.invalid_type, param="language")
            if not same_language(language, spec.language):
                raise ValidationError(f"model {model!r} transcribes {spec.language}, not {language!r}",
                                      code=ErrorCode.out_of_range, param="language")
        lane = check_lane(msg.get("priority"))
        return AudioConfig(client_id=cid, model=spec.name, sample_rate=rate, encoding=encoding,
                           language=spec.language, lane=lane)


def same_language(asked: str, served: str) -> bool:
    """``en`` and ``en-us`` ask for what ``en-US`` serves; ``de`` does not."""
    a, s = asked.lower().replace("_", "-"), served.lower().replace("_", "-")
    return a == s or a == s.split("-")[0]
