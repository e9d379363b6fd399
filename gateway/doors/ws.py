"""The WebSocket door: ``GET /v1/stream`` (docs/websocket.md) and the voice WebSocket,
``GET /v1/audio/stream`` (docs/voice.md). It forwards frames between the socket and the
connection's ``gateway.services.session.Session`` (its protocol state and its requests, one
``gateway.requests.lifecycle.ClientRequest`` per request id, all answered on the connection's reply
channel); decisions live in ``gateway.protocols.frames``, ``gateway.requests.lifecycle``,
``gateway.requests.request_stream`` and ``gateway.requests.reply_channel``; a voice
WebSocket's frames mean what ``gateway.services.voice.VoiceConnection`` says, its
connection handling (Origin, caps, the key, idle and age limits, drain) is the text
WebSocket's."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING, Any

import orjson
import structlog
from starlette.websockets import WebSocket, WebSocketDisconnect

from streamfleet.gateway.admission.gate import revoked_error
from streamfleet.gateway.edge import guard
from streamfleet.gateway.edge.origin import origin_allowed
from streamfleet.gateway.requests.observe import trace_id_from
from streamfleet.gateway.services.session import Session
from streamfleet.gateway.services.voice import VoiceConnection
from streamfleet.shared import aio
from streamfleet.shared.errors import ErrorCode, StreamfleetError
from streamfleet.shared.logging import get_logger
from streamfleet.shared.metrics import gateway as metrics

if TYPE_CHECKING:
    from streamfleet.gateway.hub import Hub

__all__ = ["websocket_stream", "audio_stream", "WebSocketSession", "VoiceSession"]

log = get_logger("gateway.ws")

#: queued by a failed direct write: the sender stops and the session ends
_BROKEN: dict[str, Any] = {}


class _QuietInvalidUtf8(logging.Filter):
    """uvicorn's WebSocket protocol decodes text frames before the app sees them; on
    invalid UTF-8 it closes with 1007, as RFC 6455 asks, but logs the UnicodeDecodeError
    with a full traceback at ERROR. A client's bad bytes are not a gateway fault: one
    debug line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, UnicodeDecodeError) and record.getMessage().startswith("Invalid UTF-8"):
            log.debug("text frame is not valid UTF-8; closed with 1007", error=str(exc))
            return False
        return True


logging.getLogger("uvicorn.error").addFilter(_QuietInvalidUtf8())


class _Interrupt:
    """Cancels a task's read of its socket when called (a done callback), once: ``take``
    says whether a ``CancelledError`` the task caught was this one (and only this one)."""

    __slots__ = ("task", "armed", "fired")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.armed = False
        self.fired = False

    def __call__(self, _future: object = None) -> None:
        if self.armed and not self.fired:
            self.fired = True
            self.task.cancel()

    def take(self) -> bool:
        if not self.fired:
            return False
        self.fired = False
        return self.task.uncancel() == 0


class WebSocketSession(Session):
    def __init__(self, ws: WebSocket, hub: Hub) -> None:
        super().__init__(hub, "ws")
        self.ws = ws
        # (an asyncio.Queue holds ~3 KiB per connection)
        self.outbox: aio.LightQueue[dict[str, Any] | None] = aio.LightQueue()
        self.broken = False  # a write failed: the socket is gone
        #: writes a JSON frame's bytes as one text frame (the server's direct writer,
        #: ``gateway.server.LeanWebSocketProtocol.send_text_frame``, where it has one)
        self.write = ws.scope.get("streamfleet.send_text_frame") or self._send_text
        #: monotonic time of the client's last frame that counts as activity though no
        #: request is in flight: the voice WebSocket's audio (``VoiceSession``). 0: none
        self.last_activity = 0.0

    def send(self, frame: dict[str, Any]) -> None:
        """Queue a frame for the sender task (frames decided while reading the socket)."""
        self.outbox.put_nowait(frame)

    async def emit(self, frame: dict[str, Any]) -> None:
        """Write a request's frame from that request's own task: its frames keep their order
        (``accepted`` first) and a token takes no extra hop through the outbox. A failed
        write ends the session the way a failed queued one does."""
        if self.broken:
            return
        try:
            await self.write(orjson.dumps(frame))
        except Exception:
            self.broken = True
            self.outbox.put_nowait(_BROKEN)

    async def _send_text(self, payload: bytes) -> None:
        await self.ws.send_text(payload.decode())

    # -- what the frames mean (the voice WebSocket, ``VoiceSession``, reads them otherwise) --
    async def receive_text(self, text: str) -> None:
        self.dispatch(self.proto.receive_text(text))

    async def receive_bytes(self, data: bytes) -> None:
        self.dispatch(self.proto.receive_bytes(data))

    @property
    def busy(self) -> bool:
        """Requests are in flight: the connection is not idle, and a drain waits for them."""
        return bool(self.proto.in_flight)

    @property
    def in_flight(self) -> bool:
        """The connection is not idle (the voice WebSocket's is ``busy`` otherwise)."""
        return self.busy

    def idle_reason(self, timeout_s: float) -> str:
        """The close reason of a connection closed for idleness."""
        return f"idle: no request for {timeout_s:g} s"

    async def _send_loop(self) -> None:
        while True:
            frame = await self.outbox.get()
            if frame is None or frame is _BROKEN:
                return
            await self.write(orjson.dumps(frame))

    async def _refuse(self, error: StreamfleetError, code: int, reason: str) -> None:
        await self.ws.accept()
        await self.ws.send_text(orjson.dumps(error.to_frame(None)).decode())
        await self.ws.close(code=code, reason=reason)

    async def run(self) -> None:
        s = self.hub.settings
        origin = self.ws.headers.get("origin")
        if not origin_allowed(origin, self.ws.headers.get("host"), self.ws.scope.get("scheme", "ws"),
                              s.allowed_origins):
            await self._refuse(StreamfleetError(f"origin {origin!r} is not allowed", code=ErrorCode.forbidden),
                               1008, "origin not allowed")
            return
        full = self.at_capacity()
        if full is not None:
            await self._refuse(full, 1013, "too many connections; try again later")
            return
        admission = self.hub.admission
        try:
            self.identity = await admission.authenticate(self.ws.headers.get("authorization"),
                                                         self.ws.query_params.get("api_key"))
        except StreamfleetError as exc:
            await self._refuse(exc, 1008, "unauthorized" if exc.status == 401 else exc.code)
            return
        if self.identity is not None:  # every log line of this connection names its key
            structlog.contextvars.bind_contextvars(key_id=self.identity.key_id)
            guard.authenticated(self.ws.scope)  # off its address's count before auth (gateway/edge/guard.py)
        self.trace_id = trace_id_from(self.ws.headers.get("traceparent"))
        try:
            await self.connect()
        except StreamfleetError as exc:
            metrics.refusals.labels("ws", str(exc.code)).inc()
            reason = "too many connections for this API key" if exc.code == ErrorCode.too_many_requests \
                else "broker unavailable"
            await self._refuse(exc, 1013, reason)
            return
        try:
            await self._serve()
        finally:
            await self.disconnect()

    async def _serve(self) -> None:
        s = self.hub.settings
        await self.ws.accept()
        try:
            await self.channel.open()
        except StreamfleetError as exc:
            await self.ws.send_text(orjson.dumps(exc.to_frame(None)).decode())
            await self.ws.close(code=1011, reason="broker unavailable")
            return
        sender = asyncio.create_task(self._send_loop())
        opened = time.monotonic()
        age_limit = opened + s.ws_max_age_s if s.ws_max_age_s > 0 else math.inf
        hard_limit = age_limit + s.ws_max_age_grace_s
        idle_since = opened
        close: tuple[int, str] | None = None
        dropped = False
        # this task reads the socket itself (no reader task, no asyncio.wait or timeout
        # object per turn: an idle connection holds ~4 KiB less); a timer tick (the checks
        # above, at least once a second), a failed sender or a revoked key interrupt its read
        # by cancelling it (docs/operations.md, "Idle connections")
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        assert me is not None  # (the connection's own task)
        interrupt = _Interrupt(me)
        sender.add_done_callback(interrupt)
        self.revoked.add_done_callback(interrupt)
        try:
            while True:
                now = time.monotonic()
                if sender.done():  # the socket failed while sending
                    break
                if self.revoked.done():
                    self.send(revoked_error().to_frame(None))
                    close = (1008, "API key revoked")
                    break
                if self.hub.draining and (not self.busy or self.hub.drain_expired):
                    close = (1001, "gateway shutting down; reconnect to another")
                    break
                if self.in_flight:
                    idle_since = now
                    deadline = age_limit if now < age_limit else hard_limit
                else:
                    deadline = min(max(idle_since, self.last_activity) + s.ws_idle_timeout_s, age_limit)
                if now >= deadline:
                    if now >= age_limit:
                        close = (1001, "maximum connection age reached; please reconnect")
                    else:
                        close = (1000, self.idle_reason(s.ws_idle_timeout_s))
                    break
                interrupt.armed = True
                tick = loop.call_later(min(deadline - now, 1.0), interrupt)
                try:
                    msg = await self.ws.receive()
                except asyncio.CancelledError:
                    if interrupt.take():  # ours (the tick, the sender, the key): look again
                        continue
                    raise
                finally:
                    tick.cancel()
                    interrupt.armed = False
                if msg["type"] == "websocket.disconnect":
                    # the connection dropped without a close frame (uvicorn reports 1005 or 1006):
                    # the client may come back and resume; a close frame with a code cancels at once
                    dropped = msg.get("code") in (1005, 1006)
                    break
                if msg.get("text") is not None:
                    await self.receive_text(msg["text"])
                elif msg.get("bytes") is not None:
                    await self.receive_bytes(msg["bytes"])
                if self.in_flight:
                    idle_since = time.monotonic()
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            sender.remove_done_callback(interrupt)
            self.revoked.remove_done_callback(interrupt)
            await self.close_requests(s.ws_resume_grace_s if dropped else 0.0)
            self.cancel_tasks()
            self.outbox.put_nowait(None)
            if close is not None:
                try:  # flush what is queued, then close with the reason
                    await asyncio.wait_for(sender, 2.0)
                    await self.ws.close(code=close[0], reason=close[1])
                except BaseException:
                    pass
            sender.cancel()
            try:
                await sender
            except BaseException:
                pass


async def websocket_stream(ws: WebSocket) -> None:
    await WebSocketSession(ws, ws.app.state.hub).run()


class VoiceSession(WebSocketSession):
    """A voice WebSocket: the text WebSocket's connection handling, its frames read by
    the connection's ``VoiceConnection`` (gateway/services/voice.py)."""

    voice: VoiceConnection

    def __init__(self, ws: WebSocket, hub: Hub) -> None:
        super().__init__(ws, hub)
        self.transport = "voice"
        self.voice = VoiceConnection(self)

    @property
    def last_activity(self) -> float:
        return self.voice.last_activity

    @last_activity.setter
    def last_activity(self, value: float) -> None:
        pass  # (the voice connection keeps it: its audio is the activity)

    async def receive_text(self, text: str) -> None:
        await self.voice.receive_text(text)

    async def receive_bytes(self, data: bytes) -> None:
        await self.voice.receive_bytes(data)

    @property
    def busy(self) -> bool:
        return self.voice.busy

    @property
    def in_flight(self) -> bool:
        return self.voice.in_flight

    def idle_reason(self, timeout_s: float) -> str:
        return self.voice.idle_reason(timeout_s) or super().idle_reason(timeout_s)


async def audio_stream(ws: WebSocket) -> None:
    await VoiceSession(ws, ws.app.state.hub).run()
