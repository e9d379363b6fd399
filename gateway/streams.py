"""The one internal stream-event model that every protocol adapter consumes.

A ``RequestStream`` is one request as seen by the gateway. Worker events reach it over
pub/sub (at most once) and are also in the request's log ``sf:log:{request_id}``; the
stream turns them into exactly-once, in-order ``StreamEvent``s:

* ``Token(index, text)``             a piece of the completion
* ``End(finish_reason, usage, …)``   the request finished (``cancelled`` after an interrupt)
* ``Failed(error)``                  the request failed (a ``StreamfleetError``)

Indices already delivered are dropped (a redelivered task regenerates from index 0);
a gap, or silence, makes the stream catch up from the log; a resumed stream follows the
log alone. The adapters (``gateway/ws.py``, ``gateway/openai.py``) only render events.

A ``ReplyChannel`` is one subscribed ``sf:reply:{connection_id}``: it submits requests,
routes their events, resumes requests from their logs and cancels what its client
abandoned (at once, or after a resume grace period for connections that dropped).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Union

from shared.errors import ErrorCode, GenerationError, NotFoundError, StreamfleetError, UnavailableError, \
    error_from_code
from shared.logging import get_logger
from shared.schema import DoneEvent, ErrorEvent, Event, TokenEvent

__all__ = ["Token", "End", "Failed", "StreamEvent", "RequestStream", "ReplyChannel"]

log = get_logger("gateway.streams")

#: seconds a cancel may go unanswered before the gateway ends the request itself
CANCEL_GRACE_S = 5.0
#: seconds of silence from a running request before the stream checks its log
CATCH_UP_AFTER_S = 2.0
#: how long one blocking read of a followed log waits
FOLLOW_BLOCK_MS = 1000

LogReader = Callable[[bytes, "int | None"], Awaitable[list[tuple[bytes, Event]]]]


@dataclass(frozen=True, slots=True)
class Token:
    index: int
    text: str


@dataclass(frozen=True, slots=True)
class End:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    timing: dict[str, float] = field(default_factory=dict)
    model_version: str = ""

    @property
    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}


@dataclass(frozen=True, slots=True)
class Failed:
    error: StreamfleetError


StreamEvent = Union[Token, End, Failed]

#: queued to wake a waiting consumer (see ``RequestStream.resync``); never yielded
_WAKE = object()


class RequestStream:
    """One request's events, in order, each index once, ending with ``End`` or ``Failed``.

    Args:
        request_id: the fleet-wide id.
        client_id: the id the client chose.
        prompt_tokens: for a locally decided ``End`` (0 when unknown, as for a resume).
        deadline: unix time after which a request that has not started fails with ``timeout``.
        log_reader: ``await log_reader(after_entry_id, block_ms)`` reads the request's log.
        follow: take events from the log only (a resumed request).
        next_index: first index the client still needs.
        stall_timeout_s: a started request silent this long (log included) fails with ``timeout``.
    """

    def __init__(self, request_id: str, client_id: str, *, prompt_tokens: int = 0, deadline: float,
                 log_reader: LogReader | None = None, follow: bool = False, next_index: int = 0,
                 stall_timeout_s: float = 60.0) -> None:
        self.request_id = request_id
        self.client_id = client_id
        self.prompt_tokens = prompt_tokens
        self.deadline = deadline
        self.log_reader = log_reader
        self.follow = follow
        self.next_index = next_index
        self.stall_timeout_s = stall_timeout_s
        self.finished = False  # the final event is queued
        self.cancel_requested = False
        self.started = False  # any event seen (tokens or end)
        self.duplicates_dropped = 0
        self.gaps_repaired = 0
        self.gaps_skipped = 0
        self.trace_id = ""
        self._queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self._ahead: dict[int, Token] = {}  # tokens past a gap, waiting for it to fill
        self._final: StreamEvent | None = None  # an end that arrived while a gap was open
        self._log_pos = b"0-0"
        self._resync = False
        self.created = time.monotonic()
        self._last_event = self.created

    # -- feeding (synchronous: from the pub/sub reader or a log read) -------------------
    def feed(self, ev: Event) -> None:
        if self.finished:
            return
        self.started = True
        self._last_event = time.monotonic()
        if isinstance(ev, TokenEvent):
            if ev.index < self.next_index or ev.index in self._ahead:
                self.duplicates_dropped += 1
            elif ev.index > self.next_index:
                self._ahead[ev.index] = Token(ev.index, ev.text)
            else:
                self._deliver(Token(ev.index, ev.text))
        elif isinstance(ev, DoneEvent):
            end = End(ev.finish_reason, ev.prompt_tokens, ev.completion_tokens, ev.timing(), ev.model_version)
            if self._ahead or self.next_index < ev.completion_tokens:
                self._final = end  # tokens are missing before it
            else:
                self._end(end)
        elif isinstance(ev, ErrorEvent):
            self._end(Failed(error_from_code(ev.code, ev.message)))

    def _deliver(self, tok: Token) -> None:
        self._queue.put_nowait(tok)
        self.next_index = tok.index + 1
        while self.next_index in self._ahead:
            t = self._ahead.pop(self.next_index)
            self._queue.put_nowait(t)
            self.next_index = t.index + 1
        if self._final is not None and not self._ahead and isinstance(self._final, End) \
                and self.next_index >= self._final.completion_tokens:
            self._end(self._final)

    def resync(self) -> None:
        """Read the log before waiting again (pub/sub may have dropped events)."""
        self._resync = True
        self._queue.put_nowait(_WAKE)

    @property
    def gap_open(self) -> bool:
        return bool(self._ahead) or self._final is not None

    def _skip_gap(self) -> None:
        """The log could not fill a gap (expired, or lost with a Redis restart): end the
        request with an error rather than hand the client a stream with a hole in it."""
        self.gaps_skipped += 1
        log.warning("token gap could not be repaired", request_id=self.request_id, missing_from=self.next_index)
        self.fail(UnavailableError("events of this request were lost by the message broker and could not be "
                                   "recovered from its log", retry_after_ms=1000))

    def fail(self, error: StreamfleetError) -> None:
        """End the request with an error the gateway decided on."""
        if not self.finished:
            self._end(Failed(error))

    def end_cancelled(self) -> None:
        if not self.finished:
            self._end(End("cancelled", self.prompt_tokens, self.next_index))

    def _end(self, ev: StreamEvent) -> None:
        self.finished = True
        self._ahead.clear()
        self._final = None
        self._queue.put_nowait(ev)

    # -- consuming -----------------------------------------------------------------------
    async def _read_log(self, block_ms: int | None) -> None:
        if self.log_reader is None:
            return
        try:
            entries = await self.log_reader(self._log_pos if self.follow else b"0-0", block_ms)
        except UnavailableError as exc:
            self.fail(exc)
            return
        before = self.gap_open
        for entry_id, ev in entries:
            if self.follow:
                self._log_pos = entry_id
            self.feed(ev)
        if before and not self.gap_open:
            self.gaps_repaired += 1

    async def next(self) -> StreamEvent:
        """The next event; ``Failed(timeout)`` when the deadline or stall limit passes."""
        while True:
            ev = await self._next()
            if ev is not _WAKE:
                return ev

    async def _next(self) -> StreamEvent:
        if self._resync and not self.finished:
            self._resync = False
            await self._read_log(None)
        while self._queue.empty():
            if self.follow:
                await self._read_log(FOLLOW_BLOCK_MS)
                if self._queue.empty() and time.monotonic() - self._last_event > self.stall_timeout_s:
                    self.fail(GenerationError("the request timed out without a token", code=ErrorCode.timeout))
                continue
            if self.gap_open:
                await self._read_log(None)
                if self._queue.empty() and self.gap_open:
                    self._skip_gap()
                continue
            if not self.started:
                wait = max(0.0, self.deadline - time.time()) + CANCEL_GRACE_S
            else:
                wait = min(CATCH_UP_AFTER_S, self.stall_timeout_s)
            try:  # asyncio.timeout, not wait_for: no extra task per token
                async with asyncio.timeout(wait):
                    return await self._queue.get()
            except TimeoutError:
                pass
            if not self.started:
                self.fail(GenerationError("the request timed out waiting in the queue", code=ErrorCode.timeout))
            else:  # silence: pub/sub may have lost a message; the log has it
                await self._read_log(None)
                if self._queue.empty() and not self.gap_open and \
                        time.monotonic() - self._last_event > self.stall_timeout_s:
                    self.fail(GenerationError("the request timed out without a token", code=ErrorCode.timeout))
        return self._queue.get_nowait()

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        while True:
            ev = await self.next()
            yield ev
            if isinstance(ev, (End, Failed)):
                return


class ReplyChannel:
    """A subscribed ``sf:reply:{connection_id}`` and the requests answered on it.

    Args:
        broker: the process's ``gateway.broker.Broker``.
        connection_id: names the channel; fresh per WebSocket or HTTP request.
    """

    def __init__(self, broker: Any, connection_id: str | None = None, *, stall_timeout_s: float = 60.0) -> None:
        self.broker = broker
        self.connection_id = connection_id or uuid.uuid4().hex
        self.stall_timeout_s = stall_timeout_s
        self.streams: dict[str, RequestStream] = {}
        self._tasks: set[asyncio.Task] = set()
        self.closed = False

    async def open(self) -> "ReplyChannel":
        """Subscribe. Raises ``UnavailableError`` when Redis is unreachable."""
        await self.broker.register(self.connection_id, self)
        return self

    # -- called by the broker's reader ----------------------------------------------------
    def route(self, events: list[Event]) -> None:
        for ev in events:
            stream = self.streams.get(ev.request_id)
            if stream is not None and not stream.follow:
                stream.feed(ev)

    def resync(self) -> None:
        """The subscription was re-established: events may have been missed; check the logs."""
        for stream in list(self.streams.values()):
            stream.resync()

    def broker_lost(self) -> None:
        for stream in list(self.streams.values()):
            stream.fail(UnavailableError("lost the connection to the message broker; the request was "
                                         "interrupted", retry_after_ms=1000))

    # -- requests -----------------------------------------------------------------------------
    def _reader(self, request_id: str) -> LogReader:
        async def read(after: bytes, block_ms: int | None) -> list[tuple[bytes, Event]]:
            return await self.broker.read_log(request_id, after, block_ms)
        return read

    async def submit(self, request: Any, request_id: str | None = None) -> tuple[RequestStream, int]:
        """Enqueue a validated request; returns its stream and the lane depth.

        Raises:
            StreamfleetError: refused (overload, broker down).
        """
        rid = request_id or uuid.uuid4().hex
        task = request.to_task(self.connection_id, request_id=rid)
        stream = RequestStream(rid, request.client_id, prompt_tokens=len(request.prompt_ids),
                               deadline=task.deadline or (time.time() + 3600), log_reader=self._reader(rid),
                               stall_timeout_s=self.stall_timeout_s)
        stream.trace_id = task.trace_id
        self.streams[rid] = stream  # before XADD: a fast worker may answer before XADD returns
        try:
            depth = await self.broker.submit(task)
        except StreamfleetError:
            self.streams.pop(rid, None)
            raise
        extra = {"prompt": request.prompt_text} if self.broker.settings.log_prompts else {}
        log.info("request accepted", request_id=rid, trace_id=task.trace_id, model=task.model, lane=task.lane,
                 prompt_tokens=len(task.prompt_ids), queue_depth=depth, connection_id=self.connection_id, **extra)
        return stream, depth

    async def resume(self, request_id: str, client_id: str, from_index: int) -> RequestStream:
        """Follow a request started on any connection of any gateway, from ``from_index``.

        Raises:
            NotFoundError: no log for it (unknown id, or the log expired).
        """
        if not await self.broker.log_exists(request_id):
            raise NotFoundError(f"no request {request_id!r} to resume (unknown, or its log expired)",
                                code=ErrorCode.unknown_request, param="request_id")
        stream = RequestStream(request_id, client_id, deadline=time.time() + 3600,
                               log_reader=self._reader(request_id), follow=True, next_index=from_index,
                               stall_timeout_s=self.stall_timeout_s)
        self.streams[request_id] = stream
        self._spawn(self._keep_attached(stream))
        log.info("request resumed", request_id=request_id, from_index=from_index, connection_id=self.connection_id)
        return stream

    async def _keep_attached(self, stream: RequestStream) -> None:
        while not stream.finished:
            await self.broker.mark_attached(stream.request_id, 15.0)
            await asyncio.sleep(5.0)

    def release(self, stream: RequestStream) -> None:
        """The adapter delivered the stream's final event."""
        if self.streams.get(stream.request_id) is stream:
            del self.streams[stream.request_id]

    def cancel(self, stream: RequestStream, reason: str = "client") -> None:
        """Interrupt a request: workers stop it within one decode step; if no worker answers
        in ``CANCEL_GRACE_S`` (say the task is still queued with no live worker) the
        gateway ends it as cancelled itself."""
        if stream.finished or stream.cancel_requested:
            return
        stream.cancel_requested = True
        self._spawn(self._cancel(stream, reason))

    async def _cancel(self, stream: RequestStream, reason: str) -> None:
        await self.broker.cancel(stream.request_id, reason)
        await asyncio.sleep(CANCEL_GRACE_S)
        stream.end_cancelled()

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def close(self, reason: str = "disconnect", grace_s: float = 0.0) -> None:
        """The client is gone: cancel what it still has running (after ``grace_s``, during
        which it may resume elsewhere; a request followed elsewhere is left alone), then
        unsubscribe."""
        if self.closed:
            return
        self.closed = True
        for t in list(self._tasks):
            t.cancel()
        own = [s for s in self.streams.values() if not s.finished and not s.follow]
        if own and grace_s > 0:
            self._spawn_detached(self._close_later(own, reason, grace_s))
            return
        await self._cancel_all(own, reason)
        await self.broker.unregister(self.connection_id)

    async def _cancel_all(self, streams: list[RequestStream], reason: str) -> None:
        await asyncio.gather(*(self.broker.cancel(s.request_id, reason) for s in streams), return_exceptions=True)
        for s in streams:
            s.cancel_requested = True
            s.end_cancelled()

    def _spawn_detached(self, coro) -> None:
        # outlives the connection's own tasks; kept referenced until done
        t = asyncio.create_task(coro)
        _DETACHED.add(t)
        t.add_done_callback(_DETACHED.discard)

    async def _close_later(self, streams: list[RequestStream], reason: str, grace_s: float) -> None:
        """Keep the channel subscribed (so workers see a listener) while the requests may
        still be resumed; then cancel those nobody took over."""
        try:
            deadline = time.monotonic() + grace_s
            while True:
                await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
                for s in streams:  # drain what arrived: only the log matters now
                    while not s._queue.empty():
                        ev = s._queue.get_nowait()
                        if isinstance(ev, (End, Failed)):
                            s.finished = True
                streams = [s for s in streams if not s.finished]
                if not streams:
                    break
                if time.monotonic() >= deadline:
                    attached = [s for s in streams if await self.broker.is_attached(s.request_id)]
                    abandoned = [s for s in streams if s not in attached]
                    if abandoned:
                        log.info("resume grace over; cancelling", count=len(abandoned))
                        await self._cancel_all(abandoned, reason)
                    streams = attached
                    if not streams:
                        break
                    deadline = time.monotonic() + grace_s
        finally:
            await self.broker.unregister(self.connection_id)


_DETACHED: set[asyncio.Task] = set()
