"""PocketSphinx behind the streaming speech interface (docs/voice.md, "Speech engines").

Two passes, because one cannot give both partials and good finals:

* The streaming pass: each slot's decoder takes every chunk with
  ``process_raw(full_utt=False)``, which is what makes partials possible. But a
  streaming decoder normalises the features with a *live* cepstral mean that starts
  from the acoustic model's prior (``cmninit``) and is not updated within an utterance
  shorter than 8 s, while the bundled model expects per-utterance (batch) means: its
  finals are much less accurate (docs/voice.md has the word error rates).
* The final pass: at ``finish``, the utterance's retained audio is decoded again, whole
  (``process_raw(full_utt=True)``), so that the mean is the utterance's own.

The final pass costs about twice what the (pruned) streaming pass does; it runs on one decoder
shared by every slot (behind a lock: finishes are serialised, which costs nothing when
one executor thread drives all decoders, the intended use) and the streaming decoders
skip the ``fwdflat``/``bestpath`` refinements whose only product is a final they no
longer give. ``final_pass = false`` in engine.toml turns the final pass off (finals from
the streaming pass, with those refinements back on); utterances longer than
``final_pass_max_s`` seconds keep the streaming final, so one long utterance can
neither hold unbounded audio nor stall the other slots for long.

Every ``begin`` resets the decoder's feature front end (``reinit_feat``: the noise
estimate and the cepstral mean go back to the model's initial values), so an
utterance's text does not depend on what the decoder heard before.

PocketSphinx holds the GIL while it decodes: a call in an executor thread keeps the
event loop waiting for as long as it runs (a feed far less than its audio's duration,
the final pass a fraction of the utterance's: docs/voice.md).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from streamfleet.shared.errors import FatalError
from streamfleet.shared.modelrepo import ModelSpec, ensure_artifacts, pocketsphinx_model

if TYPE_CHECKING:
    from pocketsphinx import Decoder
from streamfleet.workers.engines.speech import SAMPLE_RATE, SpeechDecoder, SpeechEngine

__all__ = ["PocketSphinxEngine", "PocketSphinxDecoder"]

#: default ``final_pass_max_s``: longer utterances are not decoded a second time
FINAL_PASS_MAX_S = 30.0


def _text(decoder: Decoder) -> str:
    hyp = decoder.hyp()
    return " ".join(hyp.hypstr.split()) if hyp is not None else ""


class _FullPass:
    """The decoder that runs every slot's final pass, one at a time."""

    def __init__(self, decoder: Decoder) -> None:
        self._decoder = decoder
        self._lock = threading.Lock()

    def decode(self, pcm: bytes | bytearray) -> str | None:
        """The transcript of one whole utterance, with its own cepstral mean; None when
        that mean does not exist. PocketSphinx leaves frames without energy (digital
        silence) out of the mean, so for an utterance of nothing else it divides by zero,
        and the NaN features decode as an arbitrary word ("and", "dog")."""
        with self._lock:
            d = self._decoder
            d.reinit_feat()  # batch normalisation again, and no noise estimate from the last utterance
            d.start_utt()
            try:
                d.process_raw(pcm, False, True)
            finally:
                d.end_utt()
            return None if "nan" in d.get_cmn().lower() else _text(d)


class PocketSphinxDecoder(SpeechDecoder):
    """One slot: a streaming PocketSphinx decoder and the audio of its utterance.

    Args:
        decoder: the slot's ``pocketsphinx.Decoder``.
        full_pass: the shared final-pass decoder; None for streaming finals.
        max_retained: most bytes of audio kept for the final pass.
    """

    def __init__(self, decoder: Decoder, full_pass: _FullPass | None, max_retained: int) -> None:
        super().__init__()
        self._ps = decoder
        self._full_pass = full_pass
        self._max_retained = max_retained
        self._audio = bytearray()
        self._retaining = full_pass is not None
        self._in_utt = False
        self._partial: str | None = ""  # None: audio fed since the last look

    def _begin(self) -> None:
        self._ps.reinit_feat()
        self._ps.start_utt()
        self._in_utt = True
        self._audio = bytearray()
        self._retaining = self._full_pass is not None
        self._partial = ""

    def _feed(self, pcm: bytes) -> None:
        self._ps.process_raw(pcm, False, False)
        self._partial = None
        if self._retaining:
            if len(self._audio) + len(pcm) > self._max_retained:
                self._retaining = False  # too long for a final pass: the streaming final it is
                self._audio = bytearray()
            else:
                self._audio += pcm

    def _hypothesis(self) -> str:
        if self._partial is None:  # one backtrace per fed chunk, however often it is asked
            self._partial = _text(self._ps)
        return self._partial

    def _finish(self) -> str:
        self._in_utt = False
        self._ps.end_utt()
        audio, self._audio = self._audio, bytearray()
        if self._full_pass is not None and self._retaining and audio:
            final = self._full_pass.decode(audio)
            if final is not None:
                return final
        return _text(self._ps)  # the streaming pass's own final

    def _abort(self) -> None:
        self._audio = bytearray()
        self._partial = ""
        if self._in_utt:
            self._in_utt = False
            self._ps.end_utt()

    def _close(self) -> None:
        super()._close()
        self._ps = None


class PocketSphinxEngine(SpeechEngine):
    """``slots`` PocketSphinx decoders on the model the pocketsphinx wheel bundles.

    Options (keyword arguments, else top-level keys of engine.toml): ``slots``
    (default: the spec's), ``final_pass`` (default true), ``final_pass_max_s`` (default
    30). Memory: about 90 MB per decoder (each holds its own copy of the language
    model), ``slots + 1`` decoders with the final pass on.

    Raises:
        FatalError: the bundled model is missing, the spec asks for another language or
            sample rate, or an option is invalid.
    """

    def __init__(self, spec: ModelSpec, *, slots: int | None = None, final_pass: bool | None = None,
                 final_pass_max_s: float | None = None, **options: Any) -> None:
        ensure_artifacts(spec)  # pocketsphinx installed, its model present, the language its own
        if spec.sample_rate != SAMPLE_RATE:
            raise FatalError(f"speech model {spec.name!r}: pocketsphinx's bundled model takes {SAMPLE_RATE} Hz "
                             f"audio, not {spec.sample_rate} Hz")
        use_final = _as_bool(final_pass if final_pass is not None else spec.options.get("final_pass", True),
                             spec, "final_pass")
        try:
            n = int(slots if slots is not None else spec.slots)
            max_s = float(final_pass_max_s if final_pass_max_s is not None
                          else spec.options.get("final_pass_max_s", FINAL_PASS_MAX_S))
        except (TypeError, ValueError) as exc:
            raise FatalError(f"speech model {spec.name!r}: slots and final_pass_max_s must be numbers: {exc}") from exc
        if n < 1 or max_s <= 0:
            raise FatalError(f"speech model {spec.name!r}: slots must be at least 1 and final_pass_max_s "
                             f"positive (got {n}, {max_s})")
        from pocketsphinx import Decoder  # imported by speech workers only

        files = pocketsphinx_model()
        if files is None:  # ensure_artifacts checked; only a concurrent uninstall gets here
            raise FatalError(f"speech model {spec.name!r}: pocketsphinx's bundled model is gone")
        base: dict[str, Any] = {"hmm": str(files["hmm"]), "lm": str(files["lm"]), "dict": str(files["dict"]),
                                "samprate": SAMPLE_RATE, "loglevel": "FATAL"}
        # With a final pass the streaming decoders give partials only: no fwdflat/bestpath
        # (they refine a final that is not used), and every other frame scored (ds) with at
        # most 3000 HMMs a frame, which costs much less and left the partials' WER as it
        # was (docs/voice.md); the final pass keeps the model's settings, which those cuts
        # made worse.
        streaming = base if not use_final else {**base, "fwdflat": False, "bestpath": False, "ds": 2,
                                                "maxhmmpf": 3000}
        try:
            full_pass = _FullPass(Decoder(**base)) if use_final else None
            decoders = [PocketSphinxDecoder(Decoder(**streaming), full_pass, int(max_s * SAMPLE_RATE) * 2)
                        for _ in range(n)]
        except (RuntimeError, ValueError) as exc:
            raise FatalError(f"speech model {spec.name!r}: pocketsphinx cannot start: {exc}") from exc
        super().__init__(spec, decoders)
        self.final_pass = use_final
        self.final_pass_max_s = max_s
        self._full_pass = full_pass

    def _close(self) -> None:
        self._full_pass = None


def _as_bool(value: object, spec: ModelSpec, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    raise FatalError(f"speech model {spec.name!r}: {key} must be true or false, not {value!r}")
