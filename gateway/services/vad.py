"""Voice activity segmentation: a connection's audio stream cut into utterances.

Voice clients stream 16 kHz mono PCM16 (little-endian) in chunks of any size; the gateway
runs one ``Segmenter`` per connection on every chunk, so that only voiced audio becomes
inference work (docs/voice.md, "Voice activity detection"). A ``Detector``
(``gateway/services/vad_detectors.py``; Silero in ``gateway/services/silero.py``) decides speech or not
for one frame; the ``Segmenter`` turns those decisions into utterances, without I/O:
``feed(pcm)`` returns ``SpeechStarted`` / ``SpeechAudio`` / ``SpeechStopped`` /
``UtteranceEnd`` events, ``flush()`` ends the stream. ``feed`` is ``frames`` then
``decide``, and the two halves let many connections' Silero frames be decided in one
batch (``SileroDetector.decide_many``), which costs a fraction of the CPU.

    seg = Segmenter(make_detector("silero"))
    for event in seg.feed(chunk):          # any even number of bytes
        ...
    events = seg.flush()                   # at the end of the stream
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass

from streamfleet.gateway.services.vad_detectors import BYTES_PER_MS, Detector

__all__ = ["SpeechStarted", "SpeechAudio", "SpeechStopped", "UtteranceEnd", "VadEvent", "Segmenter"]


@dataclass(frozen=True, slots=True)
class SpeechStarted:
    """Speech began at ``offset_ms`` (the first frame of the onset run).

    ``audio`` is what the decoder has not heard yet up to the end of the onset frames:
    at the start of an utterance, up to ``preroll_ms`` before the onset plus the onset
    frames; when speech resumes inside an utterance, the whole held silent gap since
    ``SpeechStopped`` plus the onset frames.
    """

    offset_ms: int
    audio: bytes


@dataclass(frozen=True, slots=True)
class SpeechAudio:
    """More audio of the current utterance: voiced frames and the hangover after them.
    Consecutive audio from one ``feed`` call comes as one event."""

    audio: bytes


@dataclass(frozen=True, slots=True)
class SpeechStopped:
    """``hangover_ms`` of non-speech have passed; ``offset_ms`` is the end of the audio
    emitted so far. The utterance stays open for ``end_silence_ms`` more."""

    offset_ms: int


@dataclass(frozen=True, slots=True)
class UtteranceEnd:
    """The utterance is over. Its audio (all the ``SpeechStarted`` and ``SpeechAudio``
    events since its first ``SpeechStarted``) is exactly the stream's bytes from
    ``start_ms`` to ``end_ms``."""

    start_ms: int
    end_ms: int


VadEvent = SpeechStarted | SpeechAudio | SpeechStopped | UtteranceEnd

_SILENT, _SPEAKING, _GAP = "silent", "speaking", "gap"


class Segmenter:
    """One connection's voice activity segmentation, sans I/O (docs/voice.md).

    States: silent (no utterance), speaking (voiced frames and up to ``hangover_ms``
    after the last one are emitted), gap (after ``SpeechStopped``: audio is held, not
    emitted, for up to ``end_silence_ms``; speech again resumes the same utterance and
    the held audio goes out first, so the decoder hears the pause as it was).

    Onset needs ``min_speech_ms`` of consecutive speech frames, so that clicks do not
    open utterances. An utterance ends after ``end_silence_ms`` of gap, at
    ``max_utterance_ms`` (a new one may start at the next frame), or at ``flush()``.

    Every event depends only on the bytes fed, never on how they were chunked, except
    that the ``SpeechAudio`` of one ``feed`` call is merged into one event.
    """

    def __init__(self, detector: Detector, *, preroll_ms: int = 300, hangover_ms: int = 200,
                 end_silence_ms: int = 600, min_speech_ms: int = 90, max_utterance_ms: int = 30000) -> None:
        for name, value in (("preroll_ms", preroll_ms), ("hangover_ms", hangover_ms),
                            ("end_silence_ms", end_silence_ms), ("min_speech_ms", min_speech_ms)):
            if value < 0:
                raise ValueError(f"{name} must not be negative, got {value}")
        frame_ms = detector.frame_ms
        self.detector = detector
        self.frame_ms = frame_ms
        self._frame_bytes = frame_ms * BYTES_PER_MS
        # durations in whole frames: pre-roll and max length at most what was asked,
        # onset, hangover and end silence at least
        self._onset = max(1, math.ceil(min_speech_ms / frame_ms))
        self._preroll = preroll_ms // frame_ms
        self._hangover = math.ceil(hangover_ms / frame_ms)
        self._end_silence = math.ceil(end_silence_ms / frame_ms)
        self._max = max_utterance_ms // frame_ms
        if self._max <= self._preroll + self._onset:
            raise ValueError(f"max_utterance_ms ({max_utterance_ms}) must exceed preroll_ms + min_speech_ms "
                             f"({(self._preroll + self._onset) * frame_ms} ms in {frame_ms} ms frames)")
        self._pending = bytearray()  # bytes of an incomplete frame
        self._undecided = 0  # frames handed out by frames() and not yet decided
        self._frames = 0  # frames decided so far; frame i covers [i, i + 1) x frame_ms
        self._state = _SILENT
        self._run = 0  # consecutive voiced frames not yet emitted
        self._quiet = 0  # unvoiced frames since the last voiced one, while speaking
        self._gap_frames = 0
        #: recent frames not emitted: the pre-roll and onset frames of the next utterance
        self._recent: collections.deque[bytes] = collections.deque(maxlen=self._preroll + self._onset)
        self._held: list[bytes] = []  # the gap's audio while the utterance may resume
        self._utterance_start = 0  # frame index
        self._stopped_at = 0  # frame index where the emitted audio ends
        self._out: list[VadEvent] = []
        self._audio: list[bytes] = []  # SpeechAudio not yet put in _out
        self._flushed = False

    @property
    def offset_ms(self) -> int:
        """Milliseconds of audio decided so far (a partial frame waits for the next feed)."""
        return self._frames * self.frame_ms

    @property
    def in_utterance(self) -> bool:
        return self._state != _SILENT

    def feed(self, pcm: bytes) -> list[VadEvent]:
        """Process the next chunk of the stream (16 kHz PCM16, any even length)."""
        frames = self.frames(pcm)
        is_speech = self.detector.is_speech
        return self.decide(frames, [is_speech(frame) for frame in frames])

    def frames(self, pcm: bytes) -> list[bytes]:
        """First half of ``feed``: buffer ``pcm`` and return the complete frames it makes,
        for a detector to decide outside (many streams' Silero frames in one call:
        ``SileroDetector.decide_many``); ``decide`` must follow with the decisions."""
        if self._flushed:
            raise RuntimeError("segmenter already flushed: the stream has ended")
        if self._undecided:
            raise RuntimeError(f"{self._undecided} frames still wait for decide()")
        if len(pcm) % 2:
            raise ValueError(f"PCM16 chunks have an even number of bytes, got {len(pcm)}")
        fb = self._frame_bytes
        pending = self._pending
        pending += pcm
        n = len(pending) // fb
        if not n:
            return []
        with memoryview(pending) as view:
            frames = [bytes(view[k * fb:(k + 1) * fb]) for k in range(n)]
        del pending[:n * fb]
        self._undecided = n
        return frames

    def decide(self, frames: list[bytes], speech: Sequence[bool]) -> list[VadEvent]:
        """Second half of ``feed``: the events of the frames ``frames`` returned, given
        the detector's decision for each."""
        if len(frames) != self._undecided or len(speech) != len(frames):
            raise ValueError(f"decide() takes the {self._undecided} frames of the last frames() call and one "
                             f"decision each, got {len(frames)} frames and {len(speech)} decisions")
        self._undecided = 0
        for frame, voiced in zip(frames, speech):
            self._step(frame, bool(voiced))
        return self._take()

    def flush(self) -> list[VadEvent]:
        """End of stream: close an open utterance. A trailing partial frame (under
        ``frame_ms``) is dropped. The segmenter takes no more audio afterwards."""
        if self._undecided:
            raise RuntimeError(f"{self._undecided} frames still wait for decide()")
        if not self._flushed:
            self._flushed = True
            self._pending.clear()
            if self._state == _SPEAKING:
                self._stop(self._frames)
            if self._state == _GAP:
                self._end()
        return self._take()

    # -- internals -------------------------------------------------------------------

    def _take(self) -> list[VadEvent]:
        self._put_audio()
        out, self._out = self._out, []
        return out

    def _put_audio(self) -> None:
        if self._audio:
            self._out.append(SpeechAudio(b"".join(self._audio)))
            self._audio = []

    def _emit(self, event: VadEvent) -> None:
        self._put_audio()
        self._out.append(event)

    def _step(self, frame: bytes, voiced: bool) -> None:
        i = self._frames
        self._frames = i + 1
        if self._state == _SPEAKING:
            if voiced:
                self._quiet = 0
                self._audio.append(frame)
            elif self._quiet < self._hangover:
                self._quiet += 1
                self._audio.append(frame)
                if self._quiet == self._hangover:
                    self._stop(i + 1)
            else:  # no hangover: this frame is already silence after the utterance
                self._stop(i)
                self._not_speaking(frame, voiced, i)
        else:
            self._not_speaking(frame, voiced, i)
        if self._state == _SPEAKING and self._frames - self._utterance_start >= self._max:
            self._stop(self._frames)
            if self._state == _GAP:
                self._end()

    def _not_speaking(self, frame: bytes, voiced: bool, i: int) -> None:
        if self._state == _GAP:
            self._gap(frame, voiced, i)
        else:
            self._silent(frame, voiced, i)

    def _silent(self, frame: bytes, voiced: bool, i: int) -> None:
        self._recent.append(frame)
        self._run = self._run + 1 if voiced else 0
        if self._run >= self._onset:
            audio = b"".join(self._recent)
            self._utterance_start = i + 1 - len(self._recent)
            self._start(i, audio)

    def _gap(self, frame: bytes, voiced: bool, i: int) -> None:
        self._held.append(frame)
        self._recent.append(frame)
        self._run = self._run + 1 if voiced else 0
        if self._run >= self._onset:
            audio = b"".join(self._held)
            self._held = []
            self._start(i, audio)
            return
        self._gap_frames += 1
        if self._gap_frames >= self._end_silence or i + 1 - self._utterance_start >= self._max:
            self._end()

    def _start(self, i: int, audio: bytes) -> None:
        self._emit(SpeechStarted((i + 1 - self._onset) * self.frame_ms, audio))
        self._recent.clear()
        self._run = 0
        self._quiet = 0
        self._state = _SPEAKING

    def _stop(self, end_frame: int) -> None:
        self._emit(SpeechStopped(end_frame * self.frame_ms))
        self._stopped_at = end_frame
        self._state = _GAP
        self._gap_frames = 0
        self._held = []
        if self._end_silence == 0:
            self._end()

    def _end(self) -> None:
        self._emit(UtteranceEnd(self._utterance_start * self.frame_ms, self._stopped_at * self.frame_ms))
        self._held = []
        self._state = _SILENT
