"""Streaming speech recognition: the interface a speech worker drives (docs/voice.md,
"Speech engines").

A ``SpeechEngine`` is loaded once per worker process. It creates all of its decoders at
load time (for PocketSphinx each one loads the language model, about 0.4 s, which must
never happen while a user waits) and lends them out, one per utterance in flight::

    engine = load_speech_engine(spec)           # workers/engines/speech_loader.py
    dec = engine.acquire()                      # at most engine.slots at once
    dec.begin()
    for chunk in chunks:                        # PCM16 mono, engine.sample_rate
        dec.feed(chunk)
        publish_partial(dec.hypothesis())
    publish_final(dec.finish())                 # the decoder is ready for begin() again
    engine.release(dec)

Threads: ``acquire``/``release``/``close`` may be called from any thread. One decoder is
not thread-safe: its calls must not overlap, which holds when every decoder is driven
from the worker's one executor thread (the intended use). A backend that shares state
between decoders guards that state itself.

Backends subclass ``SpeechEngine`` and ``SpeechDecoder`` and implement the underscore
hooks; the base classes own the pool, the order of calls and the PCM checks, so that
every backend refuses misuse the same way.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from streamfleet.shared.errors import ErrorCode, FatalError, RefusedError
from streamfleet.shared.modelrepo import ModelSpec
from streamfleet.workers.engines import import_from_string

__all__ = ["SAMPLE_RATE", "SPEECH_BACKENDS", "SpeechEngine", "SpeechDecoder", "SpeechStateError",
           "NoFreeDecoder", "check_pcm", "load_backend"]

#: the sample rate every speech engine here takes (PCM16 little-endian, mono)
SAMPLE_RATE = 16000

#: speech backend name -> "module:Class"; a backend may also be named as "module:Class"
#: in engine.toml, so a new engine plugs in without editing this table
SPEECH_BACKENDS: dict[str, str] = {
    "pocketsphinx": "streamfleet.workers.engines.pocketsphinx_engine:PocketSphinxEngine",
}


class SpeechStateError(RuntimeError):
    """A decoder or engine was called out of order (``feed`` before ``begin``, a decoder
    released twice, a closed engine): a bug in the caller, not in the audio."""


class NoFreeDecoder(RefusedError):
    """Every decoder slot is busy. A worker admits at most ``slots`` utterances, so this
    means it took one too many; as a wire error it is a 429 ``overloaded`` refusal."""

    code = ErrorCode.overloaded


def check_pcm(pcm: bytes | bytearray | memoryview) -> bytes:
    """``pcm`` as bytes, after checking it is whole PCM16 samples.

    A chunk may end anywhere the gateway cut it, but never inside a sample: an odd
    length means the caller lost a byte, and decoding it would shift every later
    sample by one byte (loud noise), so it is refused rather than repaired.

    Raises:
        TypeError: not a bytes-like object.
        ValueError: an odd number of bytes.
    """
    if not isinstance(pcm, (bytes, bytearray, memoryview)):
        raise TypeError(f"PCM must be bytes, not {type(pcm).__name__}")
    data = pcm if isinstance(pcm, bytes) else bytes(pcm)
    if len(data) % 2:
        raise ValueError(f"PCM16 audio must be whole 2-byte samples; got {len(data)} bytes")
    return data


class SpeechDecoder(ABC):
    """One utterance at a time: ``begin``, any number of ``feed``, then ``finish`` (or
    ``abort``), then ``begin`` again for the next utterance.

    Backends implement ``_begin``, ``_feed``, ``_hypothesis``, ``_finish`` and
    ``_abort``; they are only called in a valid order, ``_feed`` only with non-empty,
    checked PCM.
    """

    def __init__(self) -> None:
        self._active = False
        self._closed = False

    @property
    def active(self) -> bool:
        """Whether an utterance is in progress (``begin`` called, not yet finished)."""
        return self._active

    def begin(self) -> None:
        """Start an utterance, with no state left from the previous one.

        Raises:
            SpeechStateError: an utterance is already in progress, or the engine is closed.
        """
        if self._closed:
            raise SpeechStateError("the speech engine is closed")
        if self._active:
            raise SpeechStateError("begin() while an utterance is in progress; finish() or abort() it first")
        self._begin()
        self._active = True

    def feed(self, pcm: bytes) -> None:
        """Decode the next chunk of the utterance (any whole number of samples, empty included).

        Raises:
            SpeechStateError: no utterance in progress.
            ValueError: an odd number of bytes (see ``check_pcm``).
        """
        data = check_pcm(pcm)
        self._require_active("feed")
        if data:
            self._feed(data)

    def hypothesis(self) -> str:
        """The partial transcript of the audio fed so far ("" before the first word, or
        when no utterance is in progress). Cheap: call it after every ``feed``."""
        return self._hypothesis() if self._active else ""

    def finish(self) -> str:
        """End the utterance and return its final transcript; the decoder is then ready
        for ``begin``, even when this raises.

        Raises:
            SpeechStateError: no utterance in progress.
        """
        self._require_active("finish")
        try:
            return self._finish()
        except BaseException:
            self._abort()
            raise
        finally:
            self._active = False

    def abort(self) -> None:
        """Drop the utterance in progress, if any (a cancelled request, a lost client)."""
        if self._active:
            try:
                self._abort()
            finally:
                self._active = False

    def _require_active(self, call: str) -> None:
        if not self._active:
            raise SpeechStateError(f"{call}() with no utterance in progress; call begin() first")

    def _close(self) -> None:
        """Called once by the engine's ``close`` (after ``abort``); free what the decoder holds."""
        self._closed = True

    @abstractmethod
    def _begin(self) -> None: ...

    @abstractmethod
    def _feed(self, pcm: bytes) -> None: ...

    @abstractmethod
    def _hypothesis(self) -> str: ...

    @abstractmethod
    def _finish(self) -> str: ...

    @abstractmethod
    def _abort(self) -> None:
        """Return to the idle state from any point of an utterance, without raising if
        the backend already left the utterance."""


class SpeechEngine(ABC):  # noqa: B024 - a base for backends; every hook has a default
    """A speech model and its fixed pool of decoders (see the module docstring).

    Args:
        spec: the model folder (``kind = "asr"``).
        decoders: every decoder the engine will ever lend; ``slots`` is their number.
    """

    #: whether calls on different decoders gain from running on separate threads at once
    #: (decoders in child processes do; ones that hold the GIL do not), so that a worker
    #: waits for every slot's hypothesis or final at the same time
    concurrent: bool = False

    def __init__(self, spec: ModelSpec, decoders: Sequence[SpeechDecoder]) -> None:
        if not decoders:
            raise FatalError(f"speech model {spec.name!r}: an engine needs at least one decoder")
        self.spec = spec
        self.sample_rate: int = spec.sample_rate
        self._decoders: tuple[SpeechDecoder, ...] = tuple(decoders)
        self._free: list[SpeechDecoder] = list(reversed(self._decoders))
        self._lent: set[int] = set()  # id() of each lent decoder
        self._lock = threading.Lock()
        self._closed = False

    @property
    def slots(self) -> int:
        """Most decoders lent at once: the number of utterances one worker decodes together."""
        return len(self._decoders)

    @property
    def in_use(self) -> int:
        """Decoders lent now."""
        with self._lock:
            return len(self._lent)

    def acquire(self) -> SpeechDecoder:
        """Lend an idle decoder (call ``begin`` on it).

        Raises:
            NoFreeDecoder: all ``slots`` decoders are lent.
            SpeechStateError: the engine is closed.
        """
        with self._lock:
            if self._closed:
                raise SpeechStateError("the speech engine is closed")
            if not self._free:
                raise NoFreeDecoder(f"all {self.slots} speech decoders of {self.spec.name!r} are in use",
                                    retry_after_ms=1000)
            decoder = self._free.pop()
            self._lent.add(id(decoder))
            return decoder

    def release(self, decoder: SpeechDecoder) -> None:
        """Take a lent decoder back; an utterance still in progress is aborted, so that
        nothing of it can reach the next user of the decoder.

        Raises:
            ValueError: not one of this engine's decoders.
            SpeechStateError: it is not lent (released twice).
        """
        if not any(decoder is d for d in self._decoders):
            raise ValueError("release() of a decoder this engine did not lend")
        with self._lock:
            if id(decoder) not in self._lent:
                raise SpeechStateError("release() of a decoder that is not lent (released twice?)")
            self._lent.discard(id(decoder))  # claimed: a concurrent second release now fails
        try:
            decoder.abort()
        finally:
            with self._lock:
                self._free.append(decoder)

    def close(self) -> None:
        """Abort every utterance and free the model; later ``acquire`` calls raise. Call
        it once no decoder call is running (at shutdown, after the executor drained)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for decoder in self._decoders:
            try:
                decoder.abort()
            finally:
                decoder._close()
        self._close()

    def _close(self) -> None:  # noqa: B027 - a hook a backend may leave out
        """Free what the engine holds besides its decoders (a backend hook)."""


def load_backend(spec: ModelSpec, **options: Any) -> SpeechEngine:
    """Load the speech engine ``spec.backend`` names in this process, with ``options``
    (keyword arguments of that backend; they override engine.toml's). The worker loads
    through ``workers.engines.speech_loader.load_speech_engine``, which may put each
    decoder in a child process instead; a child loads its one decoder with this.

    Raises:
        FatalError: not a speech model, unknown backend, or the backend cannot start.
    """
    if spec.kind != "asr":
        raise FatalError(f"model {spec.name!r} is not a speech model (kind {spec.kind!r}, expected 'asr')")
    target = SPEECH_BACKENDS.get(spec.backend, spec.backend if ":" in spec.backend else None)
    if target is None:
        raise FatalError(f"speech model {spec.name!r}: unknown speech backend {spec.backend!r}; "
                         f"known: {', '.join(sorted(SPEECH_BACKENDS))}")
    engine = import_from_string(target)(spec, **options)
    if not isinstance(engine, SpeechEngine):
        raise FatalError(f"speech backend {target!r} did not make a SpeechEngine")
    return engine
