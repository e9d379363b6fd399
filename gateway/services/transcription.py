"""An audio file's transcription through the fleet, whatever its door (docs/openai.md,
"Audio transcriptions"): ``POST /v1/audio/transcriptions`` (``gateway/doors/transcriptions.py``)
and gRPC's ``Transcribe`` call (``gateway/doors/grpc_server.py``) both ``open_transcription``.

The speech model runs as it does for the voice WebSocket (docs/voice.md): the file is
decoded to the model's PCM (``gateway/services/audio_files.py``), cut into utterances by the voice
segmenter (``gateway/services/vad.py``, with the ``SF_VAD*`` settings; ``SF_VAD=off``: fixed
spans of ``SF_MAX_UTTERANCE_S``), and each utterance is one ``SpeechTask`` through
``ClientRequest`` (admission, the tenant's fair speech slot, the lanes, deadlines), its
audio appended to ``sf:audio:{request_id}`` with the end marker, its final
``TranscriptEvent`` the segment's text. ``SF_TRANSCRIPTION_CONCURRENCY`` utterances of a
file are in flight at once; the transcript keeps the file's order.

Before a file is decoded: the model, its live workers, one request of the key's rate
limit; then the file is decoded (its duration first, from its header,
``SF_TRANSCRIPTION_MAX_DURATION_S``) and segmented, in a thread, at most
``DECODES_AT_ONCE`` files per process. Each utterance after the first is admitted, and
charged to the key's rate limit and stream cap, as a voice utterance is. An utterance
that fails fails the transcription with its error.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

import anyio

from streamfleet.gateway.admission.kinds import SpeechRequest
from streamfleet.gateway.protocols.audio_protocol import same_language
from streamfleet.gateway.protocols.transcription_mapping import Segment
from streamfleet.gateway.requests.observe import stop_events
from streamfleet.gateway.services.audio_files import FORMATS, DecodedAudio, decode_audio
from streamfleet.gateway.services.vad import Segmenter, UtteranceEnd
from streamfleet.gateway.services.voice import new_detector
from streamfleet.shared.errors import ErrorCode, StreamfleetError, ValidationError
from streamfleet.shared.logging import get_logger
from streamfleet.shared.metrics import gateway as metrics
from streamfleet.shared.modelrepo import ModelSpec, kind_phrase
from streamfleet.shared.schema import AudioChunk, AudioInput, DoneEvent, ErrorEvent, TranscriptEvent

if TYPE_CHECKING:
    from streamfleet.gateway.admission.auth import Identity
    from streamfleet.gateway.hub import Hub

__all__ = ["open_transcription", "split_utterances", "Transcription", "DECODES_AT_ONCE"]

log = get_logger("gateway.transcriptions")

#: files one gateway process decodes and segments at once (each in a thread: CPU-bound);
#: more wait their turn
DECODES_AT_ONCE = 2
#: seconds of audio per entry of an utterance's audio stream (the worker decodes as they come)
APPEND_SECONDS = 1.0
#: the sample rate the segmenter's detectors take (``gateway/services/vad.py``)
VAD_RATE = 16000


#: the process's gate on concurrent decodes (``DECODES_AT_ONCE``), per event loop, made on
#: first use (the HTTP and the gRPC doors share it)
_decode_gates: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}


def _decode_gate() -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    gate = _decode_gates.get(loop)
    if gate is None:
        for old in [lp for lp in _decode_gates if lp.is_closed()]:
            del _decode_gates[old]
        gate = _decode_gates[loop] = asyncio.Semaphore(DECODES_AT_ONCE)
    return gate


def split_utterances(pcm: bytes, sample_rate: int, vad: str, *, hangover_ms: int, preroll_ms: int,
                     end_silence_ms: int, max_utterance_ms: int) -> list[tuple[int, int]]:
    """The utterances of a whole file, as ``(start_ms, end_ms)`` spans: the voice door's
    segmenter over the audio (``vad``: ``SF_VAD``), a second at a time; with ``off``, or at
    a sample rate the detectors do not take, consecutive spans of ``max_utterance_ms``.
    Blocking (the detector runs on every frame): the door runs it in a thread."""
    bytes_per_ms = sample_rate * 2 // 1000
    total_ms = len(pcm) // 2 * 1000 // sample_rate
    if vad == "off" or sample_rate != VAD_RATE:
        return [(start, min(total_ms, start + max_utterance_ms)) for start in range(0, total_ms, max_utterance_ms)]
    seg = Segmenter(new_detector(vad), hangover_ms=hangover_ms, preroll_ms=preroll_ms,
                    end_silence_ms=end_silence_ms, max_utterance_ms=max_utterance_ms)
    spans: list[tuple[int, int]] = []
    step = bytes_per_ms * 1000
    for i in range(0, len(pcm), step):
        spans.extend((ev.start_ms, ev.end_ms) for ev in seg.feed(pcm[i:i + step]) if isinstance(ev, UtteranceEnd))
    spans.extend((ev.start_ms, ev.end_ms) for ev in seg.flush() if isinstance(ev, UtteranceEnd))
    return [(a, b) for a, b in spans if b > a]


class Transcription:
    """The utterances of one file through the fleet: each one ``ClientRequest``, at most
    ``concurrency`` at once, admitted in the file's order; ``segments`` gives their
    transcripts in that order."""

    def __init__(self, hub: Hub, identity: Identity | None, *, model: str, lane: str, language: str,
                 audio: DecodedAudio, spans: list[tuple[int, int]], trace_id: str | None) -> None:
        self.hub = hub
        self.identity = identity
        self.model, self.lane, self.language = model, lane, language
        self.audio = audio
        self.spans = spans
        self.trace_id = trace_id
        # whose turn an utterance takes for a speech slot (gateway.admission.voiceslots): the API key,
        # or with auth off this request, as a voice connection is
        self.tenant = f"key:{identity.key_id}" if identity is not None else f"req:{uuid.uuid4().hex}"
        loop = asyncio.get_running_loop()
        self._results: list[asyncio.Future[str]] = [loop.create_future() for _ in spans]
        #: the first utterance was admitted and enqueued (or refused: its error)
        self.first_submitted: asyncio.Future[None] = loop.create_future()
        self._next = 0
        self._error: StreamfleetError | None = None  # the failure that ended the transcription
        self._runner: asyncio.Task[None] | None = None

    def start(self) -> None:
        if not self.spans:
            self.first_submitted.set_result(None)
            return
        n = min(self.hub.settings.transcription_concurrency, len(self.spans))
        self._runner = asyncio.create_task(self._run(n), name="transcription")

    async def _run(self, n: int) -> None:
        pumps = [asyncio.ensure_future(self._pump()) for _ in range(n)]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in pumps:
                task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*pumps, return_exceptions=True)
            # what never finished fails with the error that ended the transcription (an
            # earlier utterance cancelled because a later one failed included), or is
            # cancelled when the door closed it (nobody waits for it then)
            futures: list[asyncio.Future[Any]] = [*self._results, self.first_submitted]
            for fut in futures:
                if not fut.done():
                    if self._error is not None:
                        fut.set_exception(self._error)
                    else:
                        fut.cancel()

    async def _pump(self) -> None:
        """Transcribe utterances, the next in the file's order each time, until none is
        left; an utterance's failure ends the pump (and so the transcription)."""
        while self._next < len(self.spans):
            i = self._next
            self._next += 1
            try:
                text = await self._one(i)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                error = exc if isinstance(exc, StreamfleetError) else StreamfleetError("internal error",
                                                                                        code=ErrorCode.internal)
                if not isinstance(exc, StreamfleetError):
                    log.exception("utterance failed", utterance=i)
                if self._error is None:
                    self._error = error
                if not self._results[i].done():
                    self._results[i].set_exception(error)
                if not self.first_submitted.done():
                    self.first_submitted.set_exception(error)
                raise error from None
            self._results[i].set_result(text)

    async def _one(self, i: int) -> str:
        """One utterance: admitted (the first on the charge the door took already), its fair
        slot, enqueued, its audio and end marker appended, its final transcript read."""
        hub, s = self.hub, self.hub.settings
        start_ms, end_ms = self.spans[i]
        rate = self.audio.sample_rate
        request = SpeechRequest(client_id="transcription", model=self.model, lane=self.lane,
                                timeout_s=s.request_timeout_s,
                                audio=AudioInput(sample_rate=rate, encoding="pcm_s16le", language=self.language,
                                                 utterance=i, start_ms=start_ms))
        req = hub.request("transcription", identity=self.identity)
        grant: str | None = None

        async def take_slot() -> None:
            nonlocal grant
            slots = hub.voice_slots
            if slots is not None:
                cap = self.identity.tier.max_utterances if self.identity is not None else None
                grant = await slots.acquire(self.model, self.tenant, cap, timeout_s=s.request_timeout_s)

        async def release_slot() -> None:
            nonlocal grant
            held, grant = grant, None
            if held is not None and hub.voice_slots is not None:
                await hub.voice_slots.release(self.model, held)

        events = None
        try:
            try:
                await req.submit(request, trace_id=self.trace_id, before_enqueue=take_slot, charged=i == 0)
            except StreamfleetError as exc:
                metrics.refusals.labels("transcription", str(exc.code)).inc()
                raise
            if i == 0:
                self.first_submitted.set_result(None)
            req.watch()  # a revoked key ends it
            pcm = self.audio.pcm[start_ms * rate * 2 // 1000:end_ms * rate * 2 // 1000]
            step = int(APPEND_SECONDS * rate) * 2
            chunks = [AudioChunk(pcm=pcm[j:j + step]) for j in range(0, len(pcm), step)] + [AudioChunk(end=True)]
            stream = req.stream
            assert stream is not None  # (submitted)
            await hub.broker.append_audio(stream.request_id, stream.model, chunks, s.request_timeout_s + s.log_ttl_s)
            events = req.events("transcription")
            text = ""
            async for ev in events:
                if isinstance(ev, TranscriptEvent):
                    if ev.final:
                        text = ev.text
                elif isinstance(ev, DoneEvent):
                    await release_slot()
                    req.delivered()
                    return text.strip()
                elif isinstance(ev, ErrorEvent):
                    await release_slot()
                    req.delivered()
                    raise ev.error()
            raise StreamfleetError("the utterance's events ended without its end", code=ErrorCode.internal)
        finally:
            with anyio.CancelScope(shield=True):
                if events is not None:
                    await stop_events(None, events)
                await release_slot()
                await req.close(reason="http_disconnect")

    async def segments(self) -> AsyncGenerator[Segment, None]:
        """The transcript of each utterance, in the file's order, as each is known.

        Raises:
            StreamfleetError: an utterance failed (the first, in the file's order).
        """
        for i, fut in enumerate(self._results):
            text = await fut
            start_ms, end_ms = self.spans[i]
            yield Segment(i, start_ms, end_ms, text)

    async def close(self) -> None:
        """Stop what still runs (the client left, or an utterance failed): every utterance
        in flight is cancelled at its worker."""
        if self._runner is not None and not self._runner.done():
            self._runner.cancel()
        if self._runner is not None:
            with anyio.CancelScope(shield=True):
                await asyncio.gather(self._runner, return_exceptions=True)
        futures: list[asyncio.Future[Any]] = [*self._results, self.first_submitted]
        for fut in futures:  # (a failure nobody awaited is not "never retrieved")
            if fut.done() and not fut.cancelled():
                fut.exception()


def _decode(data: bytes, sample_rate: int, max_seconds: float) -> DecodedAudio:
    """``decode_audio``, failing closed: a decoder's unforeseen error on untrusted bytes is
    logged and answered 400 naming the file, not 500."""
    try:
        return decode_audio(data, sample_rate, max_seconds)
    except StreamfleetError:
        raise
    except Exception as exc:
        log.exception("an audio file could not be decoded", size=len(data))
        raise ValidationError(f"the file could not be decoded ({type(exc).__name__}); send {FORMATS}",
                              code=ErrorCode.invalid_request, param="file") from exc


def _check_model(hub: Hub, model: str | None, language: str | None) -> ModelSpec:
    """The speech model named (default ``SF_DEFAULT_ASR_MODEL``), which must transcribe
    ``language`` when one is given.

    Raises:
        NotFoundError: no such model; ValidationError: not a speech model, or another language.
    """
    name = model or hub.settings.default_asr_model
    spec = hub.validator.spec(name)
    if spec.kind != "asr":
        raise ValidationError(f"model {spec.name!r} is {kind_phrase(spec.kind)}, not a speech model; use "
                              f"/v1/completions or /v1/chat/completions for it", code=ErrorCode.invalid_request,
                              param="model")
    if language is not None and not same_language(language, spec.language):
        raise ValidationError(f"model {spec.name!r} transcribes {spec.language}, not {language[:32]!r}",
                              code=ErrorCode.out_of_range, param="language")
    return spec


async def open_transcription(hub: Hub, identity: Identity | None, data: bytes, *, model: str | None,
                             language: str | None, lane: str, trace_id: str | None,
                             log_fields: dict[str, Any] | None = None) -> tuple[Transcription, DecodedAudio, ModelSpec]:
    """A file's transcription, started: the model checked, its live workers, one request of
    the key's rate limit, the file decoded and segmented (in a thread, behind the
    process's decode gate), its utterances submitted. Returns ``(job, audio, spec)``
    once the first utterance is admitted and enqueued (the caller awaits
    ``job.first_submitted`` to know), the caller closing the job.

    Raises:
        StreamfleetError: the model, the workers, the rate limit or the file refused it.
    """
    s = hub.settings
    spec = _check_model(hub, model, language)
    await hub.check_workers(spec.name)
    # one request of the key's rate limit before the file is decoded; the first
    # utterance is admitted on it, each further one takes its own
    await hub.admission.charge(identity, 1, "file")
    async with _decode_gate():
        audio = await asyncio.to_thread(_decode, data, spec.sample_rate, s.transcription_max_duration_s)
        spans = await asyncio.to_thread(
            split_utterances, audio.pcm, audio.sample_rate, s.vad, hangover_ms=s.vad_hangover_ms,
            preroll_ms=s.vad_preroll_ms, end_silence_ms=s.vad_end_silence_ms,
            max_utterance_ms=int(s.max_utterance_s * 1000))
    log.info("transcription", model=spec.name, format=audio.format, duration_s=round(audio.duration_s, 2),
             source_rate=audio.source_rate, channels=audio.source_channels, utterances=len(spans),
             **(log_fields or {}))
    job = Transcription(hub, identity, model=spec.name, lane=lane, language=spec.language, audio=audio, spans=spans,
                        # one trace for the file: every utterance's log lines, here and in the worker
                        trace_id=trace_id or uuid.uuid4().hex[:16])
    job.start()
    return job, audio, spec
