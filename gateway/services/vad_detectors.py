"""Voice activity detectors: speech or not, one frame of 16 kHz PCM16 at a time.

The contract (``Detector``), the detectors that need no model of their own
(``EnergyDetector``, an RMS threshold; ``WebRtcDetector``, the WebRTC GMM detector;
``AlwaysSpeech``, VAD off), and the kinds a voice connection may be configured with, by
name: ``make_detector(kind, **options)`` builds one, ``"silero"`` (the default) being
``gateway/services/silero.py``'s. ``gateway/services/vad.py`` turns a detector's decisions into utterances.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np

from streamfleet.gateway.services.silero import SileroDetector

__all__ = [
    "SAMPLE_RATE", "BYTES_PER_MS", "DETECTORS", "DEFAULT_DETECTOR", "Detector", "WebRtcDetector", "EnergyDetector",
    "AlwaysSpeech", "make_detector",
]

SAMPLE_RATE = 16000
#: 16 kHz x 2 bytes: offsets in milliseconds map to byte positions exactly
BYTES_PER_MS = SAMPLE_RATE * 2 // 1000
#: the detector a voice connection gets unless configured otherwise (docs/voice.md has
#: the measurements behind the choice)
DEFAULT_DETECTOR = "silero"


@runtime_checkable
class Detector(Protocol):
    """Speech or not, one frame at a time.

    A detector may keep state from frame to frame (Silero is recurrent), so a connection
    owns its detector: never share one between streams.
    """

    #: the length of the frame ``is_speech`` takes, in milliseconds
    frame_ms: int

    def is_speech(self, frame: bytes) -> bool:
        """Whether ``frame`` (exactly ``frame_ms`` of 16 kHz PCM16) is speech."""
        ...


def _check_frame(frame: bytes, frame_bytes: int, name: str) -> None:
    if len(frame) != frame_bytes:
        raise ValueError(f"{name} takes frames of exactly {frame_bytes} bytes "
                         f"({frame_bytes // BYTES_PER_MS} ms of 16 kHz PCM16), got {len(frame)}")


# --------------------------------------------------------------------------------------
# Energy
# --------------------------------------------------------------------------------------


class EnergyDetector:
    """Speech when a frame's RMS level is above ``threshold_dbfs``.

    No dependency and almost no CPU, which makes it the fallback; but it hears any loud
    sound as speech and misses quiet speech under noise (docs/voice.md has the figures).
    """

    def __init__(self, threshold_dbfs: float = -40.0, frame_ms: int = 20) -> None:
        if frame_ms <= 0:
            raise ValueError(f"energy detector: frame_ms must be positive, got {frame_ms}")
        if threshold_dbfs >= 0:
            raise ValueError(f"energy detector: threshold_dbfs must be below 0 dBFS, got {threshold_dbfs}")
        self.frame_ms = frame_ms
        self.threshold_dbfs = threshold_dbfs
        self._frame_bytes = frame_ms * BYTES_PER_MS
        # compare mean squares, not decibels: no log per frame
        self._min_mean_square = (32768.0 * 10 ** (threshold_dbfs / 20)) ** 2

    def level_dbfs(self, frame: bytes) -> float:
        """The RMS level of ``frame`` in dBFS (full scale = 32768); -inf for digital silence."""
        _check_frame(frame, self._frame_bytes, "energy detector")
        ms = self._mean_square(frame)
        return 10 * math.log10(ms) - 20 * math.log10(32768.0) if ms > 0 else -math.inf

    def is_speech(self, frame: bytes) -> bool:
        _check_frame(frame, self._frame_bytes, "energy detector")
        return self._mean_square(frame) > self._min_mean_square

    @staticmethod
    def _mean_square(frame: bytes) -> float:
        x = np.frombuffer(frame, dtype="<i2").astype(np.float64)
        return float(np.dot(x, x)) / len(x)


# --------------------------------------------------------------------------------------
# WebRTC
# --------------------------------------------------------------------------------------


class WebRtcDetector:
    """The WebRTC voice activity detector (``webrtcvad``): a GMM over sub-band energies.

    ``aggressiveness`` 0-3: higher filters out more non-speech (and some quiet speech).
    Frames of 10, 20 or 30 ms; a little C per frame and a few hundred bytes of state.
    Frames quieter than ``min_dbfs`` are never speech: the WebRTC detector adapts its
    noise model from zero, so it calls the start of even low hiss speech, and its
    internal hangover calls the stretch after a click speech too, both long enough to
    pass ``min_speech_ms`` (docs/voice.md). ``min_dbfs=None`` turns the floor off.
    """

    FRAME_MS = (10, 20, 30)

    def __init__(self, aggressiveness: int = 2, frame_ms: int = 30, min_dbfs: float | None = -50.0) -> None:
        import webrtcvad

        if aggressiveness not in (0, 1, 2, 3):
            raise ValueError(f"webrtc detector: aggressiveness must be 0, 1, 2 or 3, got {aggressiveness!r}")
        if frame_ms not in self.FRAME_MS:
            raise ValueError(f"webrtc detector: frame_ms must be 10, 20 or 30, got {frame_ms!r}")
        self.frame_ms = frame_ms
        self.aggressiveness = aggressiveness
        self.min_dbfs = min_dbfs
        self._frame_bytes = frame_ms * BYTES_PER_MS
        self._vad = webrtcvad.Vad(aggressiveness)
        self._floor = EnergyDetector(min_dbfs, frame_ms) if min_dbfs is not None else None

    def is_speech(self, frame: bytes) -> bool:
        _check_frame(frame, self._frame_bytes, "webrtc detector")
        # the detector hears every frame, so that its noise model keeps adapting
        voiced = bool(self._vad.is_speech(frame, SAMPLE_RATE))
        return voiced and (self._floor is None or self._floor.is_speech(frame))


# --------------------------------------------------------------------------------------
# VAD off, and the kinds by name
# --------------------------------------------------------------------------------------


class AlwaysSpeech:
    """Every frame is speech: VAD off (``SF_VAD=off``). An utterance then runs from the
    first audio to ``stop`` (or ``max_utterance_ms``), so the client's own start and stop
    bound it, as push-to-talk does; a connection streaming silence holds a worker slot
    all the while. Not a detector in ``DETECTORS``: it detects nothing."""

    frame_ms = 20

    def is_speech(self, frame: bytes) -> bool:
        return True


#: detector kinds by name, for ``make_detector`` and configuration
DETECTORS: dict[str, Callable[..., Detector]] = {
    "silero": SileroDetector,
    "webrtc": WebRtcDetector,
    "energy": EnergyDetector,
}


def make_detector(kind: str, **options: Any) -> Detector:
    """A new detector of ``kind`` ("silero", "webrtc" or "energy") with ``options``
    passed to its class; one per connection."""
    factory = DETECTORS.get(kind)
    if factory is None:
        raise ValueError(f"unknown voice activity detector {kind!r}; known: {', '.join(sorted(DETECTORS))}")
    try:
        return factory(**options)
    except TypeError as exc:
        raise ValueError(f"{kind} detector: bad options {sorted(options)}: {exc}") from exc

