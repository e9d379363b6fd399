"""What a voice connection's frames mean (docs/voice.md): audio in, transcripts out,
whatever carries them: the voice WebSocket (``GET /v1/audio/stream``, ``gateway/doors/ws.py``)
and gRPC's ``Listen`` call (``gateway/doors/grpc_server.py``) each hold one ``VoiceConnection``.

A voice connection holds no inference slot while its client is silent. Every binary
frame goes through the connection's voice activity segmenter (``gateway/services/vad.py``); only
an utterance — speech onset, its pre-roll, the voiced audio, until enough silence —
becomes work: one ``SpeechTask`` on the speech model's lanes (same admission, lanes,
priorities and deadlines as text, through ``gateway.requests.lifecycle.ClientRequest``), whose audio
is appended to ``sf:audio:{request_id}`` as the client speaks. The worker that takes it
publishes ``TranscriptEvent``s (the partials, then the final) and the utterance's end on
the connection's reply channel, the way text events travel, and ``RequestStream`` makes
them exactly-once and in order.

The connection itself — Origin, connection caps, the API key, revocation, idle and age
limits, drain — is its door's (the WebSocket door's, as for a text WebSocket); only what
its frames mean lives here, and what keeps it from being idle: a started session that
sends no audio for ``SF_WS_IDLE_TIMEOUT_S`` is closed as a text one with no request is.

Fairness (docs/voice.md, "Limits" and "Fair slots"): ``AudioProtocol`` drops audio that
comes faster than ``SF_AUDIO_MAX_REALTIME``, and an utterance takes its tenant's turn
for a decoder slot (``gateway.admission.voiceslots.VoiceSlots``) before its task is enqueued.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from streamfleet.gateway.admission.kinds import SpeechRequest
from streamfleet.gateway.protocols.audio_protocol import (
    Audio,
    AudioConfig,
    AudioProtocol,
    Output as AudioOutput,
    Start,
    Stop,
)
from streamfleet.gateway.protocols.frames import Send
from streamfleet.gateway.requests.observe import stop_events
from streamfleet.gateway.requests.request_stream import Tick
from streamfleet.gateway.services.silero import SileroDetector
from streamfleet.gateway.services.vad import (
    Segmenter,
    SpeechAudio,
    SpeechStarted,
    SpeechStopped,
    UtteranceEnd,
    VadEvent,
)
from streamfleet.gateway.services.vad_detectors import AlwaysSpeech, Detector, make_detector
from streamfleet.shared.errors import StreamfleetError
from streamfleet.shared.logging import get_logger
from streamfleet.shared.metrics import gateway as metrics
from streamfleet.shared.schema import AudioChunk, AudioInput, DoneEvent, ErrorEvent, Event, TranscriptEvent

if TYPE_CHECKING:
    from streamfleet.gateway.admission.auth import Identity
    from streamfleet.gateway.hub import Hub
    from streamfleet.gateway.requests.reply_channel import ReplyChannel
    from streamfleet.gateway.services.session import Session

__all__ = ["VoiceConnection", "new_detector"]

log = get_logger("gateway.voice")


def new_detector(kind: str) -> Detector:
    """The detector ``SF_VAD`` names, one per voice session; ``off`` is ``AlwaysSpeech``."""
    return AlwaysSpeech() if kind == "off" else make_detector(kind)


class Utterance:
    """One utterance of a voice connection: its task, its audio on the way to Redis, and
    its transcript on the way back."""

    def __init__(self, session: VoiceConnection, config: AudioConfig, index: int, start_ms: int,
                 previous: Utterance | None) -> None:
        self.session = session
        self.created = time.monotonic()  # its wait for a slot counts from here (high_load)
        self.warned = False
        self.grant: str | None = None  # its fair slot (gateway.admission.voiceslots), until its final
        # finals go out in utterance order: another worker may finish a later utterance first
        self.previous = previous
        self.over = asyncio.Event()  # this utterance's final (or error) went out, or never will
        self.config = config
        self.index = index
        self.start_ms = start_ms
        self.end_ms: int | None = None
        self.audio: asyncio.Queue[bytes | None] = asyncio.Queue()  # None: the end
        self.req = session.hub.request(config.client_id, identity=session.identity, channel=session.channel)
        self.task = asyncio.create_task(self.run())
        session.track(self.task)  # cancelled with the connection's other tasks

    def push(self, pcm: bytes) -> None:
        self.audio.put_nowait(pcm)

    def end(self, end_ms: int) -> None:
        self.end_ms = end_ms
        self.audio.put_nowait(None)

    def frame(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "id": self.config.client_id, "utterance": self.index, **fields}

    def error_frame(self, error: StreamfleetError) -> dict[str, Any]:
        """The text protocol's ``error`` frame, naming this utterance."""
        return error.to_frame(self.config.client_id) | {"utterance": self.index}

    async def run(self) -> None:
        cfg, s = self.config, self.session.hub.settings
        request = SpeechRequest(client_id=cfg.client_id, model=cfg.model, lane=cfg.lane, timeout_s=s.request_timeout_s,
                                audio=AudioInput(sample_rate=cfg.sample_rate, encoding=cfg.encoding,
                                                 language=cfg.language, utterance=self.index, start_ms=self.start_ms))
        writer = None
        try:
            try:
                await self.req.submit(request, trace_id=self.session.trace_id, before_enqueue=self._take_slot)
            except StreamfleetError as exc:
                metrics.refusals.labels("voice", str(exc.code)).inc()
                await self._release_slot()
                await self._in_turn()
                await self.session.emit(self.error_frame(exc))
                return
            writer = asyncio.create_task(self._write_audio(s.request_timeout_s + s.log_ttl_s))
            await self._transcript(s.voice_slot_warning_s)
        finally:
            self.over.set()
            if writer is not None:
                writer.cancel()
            await self._release_slot()
            await self.req.close()

    async def _take_slot(self) -> None:
        """Wait for the tenant's turn for a decoder slot (docs/voice.md, "Fair slots"):
        admitted, not yet enqueued; the audio meanwhile waits here, in ``audio``."""
        slots, s = self.session.hub.voice_slots, self.session.hub.settings
        if slots is None:
            return
        identity = self.session.identity
        cap = identity.tier.max_utterances if identity is not None else None
        self.grant = await slots.acquire(self.config.model, self.session.tenant, cap, timeout_s=s.request_timeout_s,
                                         warn_after_s=max(0.0, s.voice_slot_warning_s - self._waited()),
                                         on_warn=self._warn)

    async def _release_slot(self) -> None:
        """Give the fair slot back (once): the worker is done with the utterance."""
        grant, self.grant = self.grant, None
        slots = self.session.hub.voice_slots
        if grant is not None and slots is not None:
            await slots.release(self.config.model, grant)

    def _waited(self) -> float:
        return time.monotonic() - self.created

    async def _warn(self) -> None:
        """The ``high_load`` warning, once per utterance."""
        if self.warned:
            return
        self.warned = True
        await self.session.emit(self.frame(
            "warning", code="high_load", message=f"this utterance has waited "
            f"{self.session.hub.settings.voice_slot_warning_s:g} s for a speech worker; it stays queued until its "
            f"deadline"))

    async def _in_turn(self) -> None:
        """Wait until every earlier utterance of the connection has had its final or error."""
        if self.previous is not None:
            await self.previous.over.wait()
            self.previous = None  # (and let it go)

    async def _write_audio(self, ttl_s: float) -> None:
        """Append the audio as it comes, whatever has queued since the last append in one
        entry (about one per round trip), then the end marker."""
        stream = self.req.stream
        assert stream is not None  # (submitted)
        rid = stream.request_id
        while True:
            pieces = [await self.audio.get()]
            while not self.audio.empty():
                pieces.append(self.audio.get_nowait())
            ended = pieces[-1] is None
            pcm = b"".join(p for p in pieces if p)
            chunks = ([AudioChunk(pcm=pcm)] if pcm else []) + ([AudioChunk(end=True)] if ended else [])
            try:
                await self.session.hub.broker.append_audio(rid, stream.model, chunks, ttl_s)
            except StreamfleetError as exc:
                stream.fail(exc)
                return
            if ended:
                return

    async def _transcript(self, warn_after_s: float) -> None:
        stream = self.req.stream
        assert stream is not None  # (submitted)
        events = self.req.events("voice")
        pending: asyncio.Future[Event | Tick] | None = None
        transcript = ""  # the final one; none when the gateway ended the utterance itself
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(anext(events))
                timeout = None
                if not self.warned and not stream.started:
                    timeout = max(0.0, warn_after_s - self._waited())
                done, _ = await asyncio.wait({pending}, timeout=timeout)
                if not done:
                    await self._warn()
                    continue
                ev, pending = pending.result(), None
                if isinstance(ev, TranscriptEvent):
                    if ev.final:  # sent with the utterance's end, in its turn
                        transcript = ev.text
                    elif ev.text:
                        await self.session.emit(self.frame("partial", text=ev.text))
                elif isinstance(ev, DoneEvent):
                    await self._release_slot()  # the worker is done: the next turn need not wait for ours
                    await self._in_turn()
                    await self.session.emit(self.frame(
                        "final", request_id=self.req.request_id, text=transcript, start_ms=self.start_ms,
                        end_ms=self.end_ms if self.end_ms is not None else self.start_ms,
                        finish_reason=ev.finish_reason))
                    self.req.delivered()
                    return
                elif isinstance(ev, ErrorEvent):
                    await self._release_slot()
                    await self._in_turn()
                    await self.session.emit(self.error_frame(ev.error()))
                    self.req.delivered()
                    return
        finally:
            await stop_events(pending, events)


class VoiceConnection:
    """What a voice connection's frames mean, whatever carries them (the voice WebSocket,
    ``gateway/doors/ws.py``; gRPC's ``Listen`` call, ``gateway/doors/grpc_server.py``): its
    door holds one beside its ``Session`` (``gateway.services.session``: the connection's
    ``hub``, ``identity``, ``channel``, ``trace_id``, its writes ``send``/``emit`` and its
    tasks) and hands it every frame. Frames come in as the WebSocket's (``receive_text``:
    JSON, ``receive_bytes``: PCM) and go out as its frames (dicts) through the session's
    ``send``/``emit``."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.audio_proto = AudioProtocol(session.hub.validator, session.hub.settings)
        self.segmenter: Segmenter | None = None
        self.config: AudioConfig | None = None
        self.current: Utterance | None = None
        self.utterances: list[Utterance] = []
        self.count = 0  # utterances of this connection so far
        #: monotonic time of the client's last frame (audio, silent or not, included). 0: none
        self.last_activity = 0.0

    # -- the connection's, as its session holds them ------------------------------------
    @property
    def hub(self) -> Hub:
        return self.session.hub

    @property
    def identity(self) -> Identity | None:
        return self.session.identity

    @property
    def channel(self) -> ReplyChannel:
        return self.session.channel

    @property
    def trace_id(self) -> str | None:
        return self.session.trace_id

    def send(self, frame: dict[str, Any]) -> None:
        self.session.send(frame)

    async def emit(self, frame: dict[str, Any]) -> None:
        await self.session.emit(frame)

    def track(self, task: asyncio.Task[None]) -> None:
        self.session.track(task)

    # the door's read loop hands every frame here and reads the next one only once this
    # one is handled: a connection's frames stay in order
    async def receive_text(self, text: str) -> None:
        await self._handle(self.audio_proto.receive_text(text))

    async def receive_bytes(self, data: bytes) -> None:
        await self._handle(self.audio_proto.receive_bytes(data))

    @property
    def busy(self) -> bool:
        """Something is running: a session started, or utterances still transcribing (a
        drain waits for it)."""
        return self.config is not None or self.in_flight

    @property
    def in_flight(self) -> bool:
        """Utterances still transcribing: the connection is not idle. A started session
        with none is idle unless audio keeps coming (``last_activity``)."""
        return any(not u.task.done() for u in self.utterances)

    def idle_reason(self, timeout_s: float) -> str | None:
        """The close reason of a started session closed for idleness; None when none is
        started (the door's own reason then)."""
        if self.config is not None:
            return f"idle: no audio for {timeout_s:g} s"
        return None

    @property
    def tenant(self) -> str:
        """Whose turn an utterance takes for a slot (gateway.admission.voiceslots): its API key, or
        with auth off this connection."""
        if self.identity is not None:
            return f"key:{self.identity.key_id}"
        return f"conn:{self.channel.connection_id}"

    async def _handle(self, outputs: list[AudioOutput]) -> None:
        for out in outputs:
            if isinstance(out, Send):
                self.send(out.frame)
            elif isinstance(out, Start):
                self.last_activity = time.monotonic()
                self._start(out.config)
            elif isinstance(out, Audio):
                self.last_activity = time.monotonic()  # audio, silent or not, is activity
                await self._audio(out.pcm)
            elif isinstance(out, Stop):
                self.last_activity = time.monotonic()
                assert self.segmenter is not None and self.config is not None  # (AudioProtocol: started)
                self._segment(self.segmenter.flush())
                self.track(asyncio.create_task(self._stopped(self.config, list(self.utterances))))
                self.segmenter, self.config = None, None

    def _start(self, config: AudioConfig) -> None:
        s = self.hub.settings
        self.config = config
        self.segmenter = Segmenter(new_detector(s.vad), hangover_ms=s.vad_hangover_ms, preroll_ms=s.vad_preroll_ms,
                                   end_silence_ms=s.vad_end_silence_ms,
                                   max_utterance_ms=int(s.max_utterance_s * 1000))
        self.send({"type": "started", "id": config.client_id, "model": config.model,
                   "sample_rate": config.sample_rate, "encoding": config.encoding, "vad": s.vad})

    async def _audio(self, pcm: bytes) -> None:
        seg = self.segmenter
        assert seg is not None  # (AudioProtocol: audio only once started)
        if isinstance(seg.detector, SileroDetector):
            frames = seg.frames(pcm)
            flags = await self.hub.silero.decide(seg.detector, frames)
            self._segment(seg.decide(frames, flags))
        else:
            self._segment(seg.feed(pcm))

    def _segment(self, events: list[VadEvent]) -> None:
        config = self.config
        assert config is not None  # (started)
        cid = config.client_id
        for ev in events:
            if isinstance(ev, SpeechStarted):
                self.send({"type": "speech_started", "id": cid, "offset_ms": ev.offset_ms})
                if self.current is None:
                    # its final waits for the newest one still running (finals end in order, so
                    # every utterance before that one has had its final)
                    running = [u for u in self.utterances if not u.task.done()]
                    self.current = Utterance(self, config, self.count, ev.offset_ms,
                                             running[-1] if running else None)
                    self.count += 1
                    self.utterances = running + [self.current]
                self.current.push(ev.audio)
            elif isinstance(ev, SpeechAudio):
                if self.current is not None:
                    self.current.push(ev.audio)
            elif isinstance(ev, SpeechStopped):
                self.send({"type": "speech_stopped", "id": cid, "offset_ms": ev.offset_ms})
            elif isinstance(ev, UtteranceEnd) and self.current is not None:
                self.current.start_ms = ev.start_ms
                self.current.end(ev.end_ms)
                self.current = None

    async def _stopped(self, config: AudioConfig, utterances: list[Utterance]) -> None:
        """After ``stop``: once every utterance has its final, say so."""
        await asyncio.gather(*(u.task for u in utterances), return_exceptions=True)
        await self.emit({"type": "stopped", "id": config.client_id, "utterances": len(utterances)})
