"""The one internal stream-event model that every protocol adapter consumes.

A ``RequestStream`` is one request as seen by the gateway. Worker events reach it over
pub/sub (at most once) and are also in the request's log ``sf:log:{request_id}``; the
stream turns them into exactly-once, in-order ``StreamEvent``s:

* ``Token(index, text)``             a piece of the completion
* ``End(finish_reason, usage, …)``   the request finished (``cancelled`` after an interrupt)
* ``Failed(error)``                  the request failed (a ``StreamfleetError``)

Indices already delivered are dropped (a redelivered task regenerates from index 0);
a gap, or silence, makes the stream catch up from the log, read incrementally. A resumed
stream first replays the log from the client's index, then is followed live: its
connection is registered as a follower (``sf:attach:{request_id}`` and a ``Follow``
message), so the worker publishes the request's events to it as well. The adapters
(``gateway/ws.py``, ``gateway/openai.py``) only render events; each request's lifecycle
around its stream (admission, submit or resume, cancel, the slot it gives back) is a
``gateway.requests.ClientRequest``.

A ``ReplyChannel`` is one subscribed ``sf:reply:{connection_id}``: it submits requests,
routes their events, resumes requests and cancels what its client abandoned (at once, or
after a resume grace period for connections that dropped), unless another connection
follows it (docs/failures.md).
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Union

from streamfleet.shared import aio
from streamfleet.shared.errors import ErrorCode, GenerationError, NotFoundError, StreamfleetError, UnavailableError, \
    error_from_code
from streamfleet.shared.logging import get_logger
from streamfleet.shared.schema import DoneEvent, ErrorEvent, Event, TokenEvent

__all__ = ["Token", "End", "Failed", "StreamEvent", "RequestStream", "ReplyChannel", "TICK"]

log = get_logger("gateway.streams")

#: seconds a cancel may go unanswered before the gateway ends the request itself
CANCEL_GRACE_S = 5.0
#: seconds between two publishes of a cancel for one request (an unanswered cancel, or
#: one of a request still running after its stream ended here: ``ReplyChannel._unheard``)
CANCEL_RESEND_S = 1.0
#: seconds of silence from a running request before the stream checks its log
CATCH_UP_AFTER_S = 2.0
#: seconds between reads of a log that could not be read, while its shard fails over
OUTAGE_RETRY_S = 0.5
#: a follower registration lasts this long unless renewed (renewed every third of it)
FOLLOW_TTL_S = 15.0
#: entries read from a log per XREAD
LOG_PAGE = 1000
#: a shared channel's memory of requests it let go of while they may still run
#: (``ReplyChannel._unheard``): at most this many, each for at most this long
LET_GO_REMEMBERED = 4096
LET_GO_REMEMBER_S = 600.0

LogReader = Callable[[bytes, "int | None"], Awaitable[list[tuple[bytes, Event]]]]


@dataclass(frozen=True, slots=True)
class Token:
    index: int
    text: str
    #: the token and its log probability, when the request asked (``TokenEvent.logprobs``)
    logprobs: dict | None = None


@dataclass(frozen=True, slots=True)
class End:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    timing: dict[str, float] = field(default_factory=dict)
    model_version: str = ""
    #: a speech request's final transcript
    text: str = ""

    @property
    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}


@dataclass(frozen=True, slots=True)
class Failed:
    error: StreamfleetError


StreamEvent = Union[Token, End, Failed]

#: queued to wake a waiting consumer (see ``RequestStream.resync``); never yielded
_WAKE = object()
#: queued by a stream's timer when the wait it was armed for may be over; never yielded
_TIMER = object()


class Tick:
    """Yielded by a stream with ``tick_s`` set when that long passed without an event
    (the SSE adapter sends a keepalive comment then)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "TICK"


TICK = Tick()


class RequestStream:
    """One request's events, in order, each index once, ending with ``End`` or ``Failed``.

    Args:
        request_id: the fleet-wide id.
        client_id: the id the client chose.
        prompt_tokens: for a locally decided ``End`` (0 when unknown, as for a resume).
        deadline: unix time after which a request that has not started fails with ``timeout``.
        log_reader: ``await log_reader(after_entry_id, block_ms)`` reads the request's log.
        resumed: the stream continues a request submitted elsewhere (it replays the log
            first, and its client does not own the generation's life).
        next_index: first index the client still needs.
        stall_timeout_s: a started request silent this long (log included) fails with ``timeout``.
        outage_grace_s: how long a log that cannot be read is waited for before the request
            fails with ``broker_unavailable`` (on a Redis Cluster, a shard failing over:
            ``SF_REDIS_FAILOVER_S``; 0 on a single server, whose outage the pub/sub
            connection reports at once).
    """

    def __init__(self, request_id: str, client_id: str, *, prompt_tokens: int = 0, deadline: float,
                 log_reader: LogReader | None = None, resumed: bool = False, next_index: int = 0,
                 stall_timeout_s: float = 60.0, outage_grace_s: float = 0.0) -> None:
        self.request_id = request_id
        self.client_id = client_id
        self.prompt_tokens = prompt_tokens
        self.deadline = deadline
        self.log_reader = log_reader
        self.resumed = resumed
        self.next_index = next_index
        self.stall_timeout_s = stall_timeout_s
        self.outage_grace_s = outage_grace_s
        self._unreadable_since: float | None = None  # the log's first failed read of an outage
        self.finished = False  # the final event is queued
        self.cancel_requested = False
        #: the gateway ended the stream itself (``fail``, ``end_cancelled``), not a worker's
        #: ``done`` or ``error``: the worker may still be running the request
        self.ended_here = False
        self.started = False  # any event seen (tokens or end)
        self.duplicates_dropped = 0
        self.gaps_repaired = 0
        self.gaps_skipped = 0
        self.trace_id = ""
        self.model = ""  # the request's model as recorded at submit (a resume learns it from the record)
        self._queue = aio.LightQueue()  # StreamEvent, _WAKE or _TIMER; one consumer
        self._ahead: dict[int, Token] = {}  # tokens past a gap, waiting for it to fill
        self._final: StreamEvent | None = None  # an end that arrived while a gap was open
        self._log_pos = b"0-0"
        self._resync = resumed  # a resume replays the log before anything else
        self.created = time.monotonic()
        self._last_event = self.created
        #: yield ``TICK`` after this many seconds without an event (None: never). A tick is
        #: checked in the wait the stream does anyway, so it costs nothing per token (no
        #: task or timer of its own)
        self.tick_s: float | None = None
        self._yielded = self.created  # when the consumer last got something
        self._wait_until: float | None = None  # the wait a tick interrupted, resumed after it
        self._due: float | None = None  # when the consumer's current wait ends (None: not waiting)
        self._timer: asyncio.TimerHandle | None = None  # armed for ``_timer_at``, or later
        self._timer_at = 0.0

    # -- feeding (synchronous: from the pub/sub reader or a log read) -------------------
    def feed(self, ev: Event, from_log: bool = False) -> None:
        """One event, from pub/sub or (``from_log``) the request's log. A token index seen
        before is dropped; only pub/sub duplicates are counted (``duplicates_dropped``:
        tokens a redelivered task regenerated), since a log read overlaps pub/sub by design."""
        if self.finished:
            return
        self.started = True
        self._last_event = time.monotonic()
        if isinstance(ev, TokenEvent):
            if ev.index < self.next_index or ev.index in self._ahead:
                if not from_log:
                    self.duplicates_dropped += 1
            elif ev.index > self.next_index:
                self._ahead[ev.index] = Token(ev.index, ev.text, ev.logprobs)
            else:
                self._deliver(Token(ev.index, ev.text, ev.logprobs))
        elif isinstance(ev, DoneEvent):
            end = End(ev.finish_reason, ev.prompt_tokens, ev.completion_tokens, ev.timing(), ev.model_version,
                      ev.text)
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
            self.ended_here = True
            self._end(Failed(error))

    def end_cancelled(self) -> None:
        if not self.finished:
            self.ended_here = True
            self._end(End("cancelled", self.prompt_tokens, self.next_index))

    def _end(self, ev: StreamEvent) -> None:
        self.finished = True
        self._ahead.clear()
        self._final = None
        self._queue.put_nowait(ev)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def drop_pending(self) -> bool:
        """Drop the events queued for a consumer that is gone (a closed connection's
        stream kept running through its resume grace: only the log matters now).
        Returns ``finished``."""
        while not self._queue.empty():
            if isinstance(self._queue.get_nowait(), (End, Failed)):
                self.finished = True
        return self.finished

    # -- consuming -----------------------------------------------------------------------
    async def _read_log(self) -> bool:
        """Feed what the log holds past the last entry read (the log is read once over,
        however many times a gap or silence sends the stream to it). Returns False when
        the log could not be read and is waited for (``outage_grace_s``)."""
        if self.log_reader is None:
            return True
        before = self.gap_open
        while not self.finished:
            try:
                entries = await self.log_reader(self._log_pos, None)
            except UnavailableError as exc:
                now = time.monotonic()
                if self._unreadable_since is None:
                    self._unreadable_since = now
                if now - self._unreadable_since < self.outage_grace_s:
                    return False  # a shard failing over: its replica takes over within the grace
                self.fail(exc)
                return True
            self._unreadable_since = None
            for entry_id, ev in entries:
                self._log_pos = entry_id
                self.feed(ev, from_log=True)
            if len(entries) < LOG_PAGE:
                break
        if before and not self.gap_open:
            self.gaps_repaired += 1
        return True

    async def next(self) -> StreamEvent | Tick:
        """The next event; ``Failed(timeout)`` when the deadline or stall limit passes;
        ``TICK`` when ``tick_s`` passed without one."""
        while True:
            ev = await self._next()
            if ev is not _WAKE and ev is not _TIMER:  # (a timer's mark that events overtook)
                if ev is not TICK:
                    self._wait_until = None  # an event ends the wait a tick interrupted
                if self.tick_s is not None:
                    self._yielded = time.monotonic()
                return ev

    async def _get(self, wait: float) -> StreamEvent | Tick | None:
        """The next queued event within ``wait`` seconds (None: the wait passed), or
        ``TICK`` first when one falls due sooner; the wait it interrupted goes on from where
        it was at the next call.

        Every token is waited for, yet hardly any wait runs out: rather than a timer armed
        and cancelled per token (``asyncio.timeout``), the stream keeps one timer that,
        when it fires early (the wait it was armed for was met, and a later one begun),
        re-arms itself for the wait under way — one timer event per stream every few
        seconds instead of two heap operations per token."""
        now = time.monotonic()
        if self._wait_until is None:
            self._wait_until = now + wait
        tick_at = self._yielded + self.tick_s if self.tick_s is not None else None
        ticking = tick_at is not None and tick_at < self._wait_until
        self._due = due = tick_at if ticking else self._wait_until
        if self._timer is None or self._timer_at > due:
            self._arm(due)
        try:
            while True:
                ev = await self._queue.get()
                if ev is not _TIMER:
                    return ev
                if time.monotonic() >= due:
                    break
                self._arm(due)  # a mark from a wait already over
        finally:
            self._due = None
        if ticking:
            return TICK
        self._wait_until = None
        return None

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = asyncio.get_running_loop().call_later(max(0.0, at - time.monotonic()), self._fire)

    def _fire(self) -> None:
        self._timer = None
        due = self._due
        if due is None:  # nobody waits: the next wait arms it again
            return
        if time.monotonic() >= due:
            self._queue.put_nowait(_TIMER)
        else:  # the wait it was armed for was met; this one ends later
            self._arm(due)

    async def _next(self) -> StreamEvent:
        if self._resync and not self.finished:
            self._resync = False
            await self._read_log()
        while self._queue.empty():
            if self.gap_open:
                if not await self._read_log():  # wait for the broker (or a live event)
                    try:
                        async with asyncio.timeout(OUTAGE_RETRY_S):
                            return await self._queue.get()
                    except TimeoutError:
                        continue
                if self._queue.empty() and self.gap_open:
                    self._skip_gap()
                continue
            if not self.started:
                wait = max(0.0, self.deadline - time.time()) + CANCEL_GRACE_S
                if self.resumed:  # events may reach only the log until the worker hears the follow
                    wait = min(wait, CATCH_UP_AFTER_S)
            else:
                wait = min(CATCH_UP_AFTER_S, self.stall_timeout_s)
            ev = await self._get(wait)
            if ev is not None:
                return ev
            if not self.started:
                if self.resumed:
                    await self._read_log()
                if self._queue.empty() and time.time() > self.deadline + CANCEL_GRACE_S:
                    self.fail(GenerationError("the request timed out waiting in the queue", code=ErrorCode.timeout))
            else:  # silence: pub/sub may have lost a message; the log has it
                await self._read_log()
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
        connection_id: names the channel; fresh per connection (WebSocket, gRPC
            ``Stream``), per resumed HTTP or gRPC call, and per gateway process for the
            requests it submits (``gateway.hub.Hub.shared_channel``).
        shared: the process's shared channel. Its subscription outlives every request,
            so a worker's "nobody listening" check (docs/failures.md) never fires for a
            request whose stream the gateway ended by itself (a broker outage, a lost
            log, a cancel that could not be delivered); the channel stops such a request
            itself when its events keep arriving (``_unheard``).
    """

    def __init__(self, broker: Any, connection_id: str | None = None, *, stall_timeout_s: float = 60.0,
                 shared: bool = False) -> None:
        self.broker = broker
        self.connection_id = connection_id or uuid.uuid4().hex
        self.stall_timeout_s = stall_timeout_s
        self.shared = shared
        self.streams: dict[str, RequestStream] = {}
        self._tasks: dict[asyncio.Task, None] = {}  # (a dict as a set: lighter when empty)
        self.closed = False
        #: request id -> [model, when let go, next cancel at]: requests this shared channel
        #: ended itself, whose worker may not know (oldest first)
        self._let_go_ids: dict[str, list] = {}

    async def open(self) -> "ReplyChannel":
        """Subscribe. Raises ``UnavailableError`` when Redis is unreachable."""
        await self.broker.register(self.connection_id, self)
        return self

    # -- called by the broker's reader ----------------------------------------------------
    def route(self, events: list[Event]) -> None:
        streams = self.streams
        for ev in events:
            stream = streams.get(ev.request_id)
            if stream is not None:
                stream.feed(ev)
            elif self._let_go_ids:
                self._unheard(ev)

    def _unheard(self, ev: Event) -> None:
        """An event of a request this shared channel ended by itself: the worker still
        runs it (it never heard a cancel, or none could be sent). Cancel it, at most once
        every ``CANCEL_RESEND_S``, until its end arrives; unless a client follows
        it elsewhere (a resume), which then owns its life."""
        rid = ev.request_id
        entry = self._let_go_ids.get(rid)
        if entry is None:
            return
        if not isinstance(ev, TokenEvent):  # its end: the worker is done with it
            del self._let_go_ids[rid]
            return
        now = time.monotonic()
        if now < entry[2]:
            return
        entry[2] = now + CANCEL_RESEND_S
        self._spawn_detached(self._cancel_unheard(rid, entry[0]))

    async def _cancel_unheard(self, rid: str, model: str) -> None:
        if await self.broker.followed_elsewhere(rid, self.connection_id):
            return  # (or Redis cannot say: asked again at the next event past the interval)
        log.info("request still running after its stream ended here; cancelling", request_id=rid,
                 connection_id=self.connection_id)
        await self.broker.cancel(rid, model, "no_listener")

    def _remember_let_go(self, stream: RequestStream) -> None:
        ids = self._let_go_ids
        now = time.monotonic()
        while ids:  # forget the oldest past the bounds
            first = next(iter(ids))
            if len(ids) < LET_GO_REMEMBERED and now - ids[first][1] < LET_GO_REMEMBER_S:
                break
            del ids[first]
        ids[stream.request_id] = [stream.model, now, 0.0]

    def resync(self) -> None:
        """The subscription was re-established: events may have been missed; check the logs."""
        for stream in list(self.streams.values()):
            stream.resync()

    def broker_lost(self) -> None:
        for stream in list(self.streams.values()):
            stream.fail(UnavailableError("lost the connection to the message broker; the request was "
                                         "interrupted", retry_after_ms=1000))

    # -- requests -----------------------------------------------------------------------------
    def _reader(self, request_id: str, replay: bool = False) -> LogReader:
        async def read(after: bytes, block_ms: int | None) -> list[tuple[bytes, Event]]:
            return await self.broker.read_log(request_id, after, block_ms, replay=replay)
        return read

    async def submit(self, request: Any, request_id: str | None = None, owner: str = "", slot: str = "",
                     trace_id: str | None = None) -> tuple[RequestStream, int]:
        """Enqueue a validated request; returns its stream and the lane depth.

        Args:
            owner: the tenant the request belongs to (recorded with it; a resume must match).
            slot: the API key id whose stream slot the request holds ("" for none); the
                worker gives it back when the request ends.

        Raises:
            StreamfleetError: refused (overload, broker down).
        """
        rid = request_id or self.broker.keys.new_request_id(self.connection_id)
        task = request.to_task(self.connection_id, request_id=rid, slot=slot, trace_id=trace_id)
        stream = RequestStream(rid, request.client_id, prompt_tokens=len(request.prompt_ids),
                               deadline=task.deadline or (time.time() + 3600), log_reader=self._reader(rid),
                               stall_timeout_s=self.stall_timeout_s, outage_grace_s=self.broker.outage_grace_s)
        stream.trace_id = task.trace_id
        stream.model = task.model
        self.streams[rid] = stream  # before XADD: a fast worker may answer before XADD returns
        try:
            depth = await self.broker.submit(task, owner)
        except StreamfleetError:
            self.streams.pop(rid, None)
            raise
        except BaseException:  # cancelled (the caller left) mid-enqueue: the task may be queued,
            self.streams.pop(rid, None)  # and on a channel others keep listening to nobody would stop it
            self._spawn_detached(self.broker.cancel(rid, task.model, "disconnect"))
            raise
        extra = {"prompt": request.prompt_text} if self.broker.settings.log_prompts else {}
        log.info("request accepted", request_id=rid, trace_id=task.trace_id, model=task.model, lane=task.lane,
                 prompt_tokens=len(task.prompt_ids), queue_depth=depth, connection_id=self.connection_id, **extra)
        return stream, depth

    async def resume(self, request_id: str, client_id: str, from_index: int, *, owner: str) -> RequestStream:
        """Follow a request started on any connection of any gateway, from ``from_index``:
        the log is replayed from there, then the request is followed live. Works from the
        moment the request was accepted, also while it still waits for a worker.

        Args:
            owner: the request must belong to it (else it is "not found"): the API key's
                owner, or with auth off the one its resume token names
                (``gateway.admission``).

        Raises:
            NotFoundError: no such request (unknown id, another tenant's, or expired).
            UnavailableError: Redis is unreachable.
        """
        record = await self.broker.read_request(request_id)
        if record is None or not record.owner or not hmac.compare_digest(record.owner.encode(), owner.encode()):
            raise NotFoundError(f"no request {request_id!r} to resume (unknown, or its log expired)",
                                code=ErrorCode.unknown_request, param="request_id")
        stream = RequestStream(request_id, client_id, prompt_tokens=record.prompt_tokens, deadline=record.deadline,
                               log_reader=self._reader(request_id, replay=True), resumed=True, next_index=from_index,
                               stall_timeout_s=self.stall_timeout_s, outage_grace_s=self.broker.outage_grace_s)
        stream.model = record.model
        self.streams[request_id] = stream  # before the follow: live events may come at once
        try:
            await self.broker.follow(request_id, record.model, self.connection_id, FOLLOW_TTL_S)
        except StreamfleetError:
            self.streams.pop(request_id, None)
            raise
        self._spawn(self._keep_following(stream))
        log.info("request resumed", request_id=request_id, from_index=from_index, connection_id=self.connection_id)
        return stream

    async def _keep_following(self, stream: RequestStream) -> None:
        while not stream.finished:
            await asyncio.sleep(FOLLOW_TTL_S / 3)
            if stream.finished:
                break
            try:
                await self.broker.follow(stream.request_id, stream.model, self.connection_id, FOLLOW_TTL_S)
            except StreamfleetError:
                pass  # the stream itself notices an outage
        await self.broker.unfollow(stream.request_id, self.connection_id)

    def release(self, stream: RequestStream) -> None:
        """The adapter delivered the stream's final event (or, on the shared channel, its
        client left)."""
        if self.streams.get(stream.request_id) is stream:
            del self.streams[stream.request_id]
            if self.shared and stream.ended_here and stream.model:
                self._remember_let_go(stream)

    def cancel(self, stream: RequestStream, reason: str = "client") -> None:
        """Interrupt a request: workers stop it within one decode step; if no worker answers
        in ``CANCEL_GRACE_S`` (say the task is still queued with no live worker) the
        gateway ends it as cancelled itself."""
        if stream.finished or stream.cancel_requested:
            return
        stream.cancel_requested = True
        self._spawn(self._cancel(stream, reason))

    async def _cancel(self, stream: RequestStream, reason: str) -> None:
        """Publish the cancel, again every ``CANCEL_RESEND_S`` while no end arrives (a cancel
        is heard at most once: one published while a worker's control socket reconnects
        is lost), and end the stream here after ``CANCEL_GRACE_S``."""
        deadline = time.monotonic() + CANCEL_GRACE_S
        while not stream.finished:
            await self.broker.cancel(stream.request_id, stream.model, reason)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await asyncio.sleep(min(CANCEL_RESEND_S, left))
            if time.monotonic() >= deadline:
                break
        stream.end_cancelled()

    def _forget(self, task: asyncio.Task) -> None:
        self._tasks.pop(task, None)

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self._tasks[t] = None
        t.add_done_callback(self._forget)

    async def close(self, reason: str = "disconnect", grace_s: float = 0.0) -> None:
        """The client is gone. Requests it submitted here are cancelled unless another
        connection follows them (after ``grace_s``, during which the client may resume them
        anywhere); resumed ones are let go, not cancelled. Then unsubscribe."""
        if self.closed:
            return
        self.closed = True
        for t in list(self._tasks):
            t.cancel()
        live = [s for s in self.streams.values() if not s.finished]
        if live and grace_s > 0:
            self._spawn_detached(self._close_later(live, reason, grace_s))
            return
        try:
            await self._let_go(live, reason)
        finally:
            await self.broker.unregister(self.connection_id)

    async def _let_go(self, streams: list[RequestStream], reason: str) -> list[RequestStream]:
        """Stop following resumed streams; cancel own ones nobody follows elsewhere.
        Returns the own streams left running because someone follows them."""
        resumed = [s for s in streams if s.resumed]
        own = [s for s in streams if not s.resumed]
        await asyncio.gather(*(self.broker.unfollow(s.request_id, self.connection_id) for s in resumed),
                             return_exceptions=True)
        followed = await asyncio.gather(*(self.broker.followed_elsewhere(s.request_id, self.connection_id)
                                          for s in own))
        abandoned = [s for s, f in zip(own, followed) if not f]
        if abandoned:
            await asyncio.gather(*(self.broker.cancel(s.request_id, s.model, reason) for s in abandoned),
                                 return_exceptions=True)
        for s in abandoned:
            s.cancel_requested = True
            s.end_cancelled()
        for s in resumed:
            s.end_cancelled()
        return [s for s, f in zip(own, followed) if f]

    def _spawn_detached(self, coro) -> None:
        # outlives the connection's own tasks; kept referenced until done
        t = asyncio.create_task(coro)
        _DETACHED.add(t)
        t.add_done_callback(_DETACHED.discard)

    async def leave(self, stream: RequestStream, reason: str = "disconnect", grace_s: float = 0.0) -> None:
        """The client of one request on a channel many share (``gateway.hub.Hub.shared_channel``)
        is gone: for this request what ``close`` does for all of a connection's, and the
        channel stays subscribed. A request that ended is just forgotten."""
        if stream.finished:
            self.release(stream)
        elif grace_s > 0:
            self._spawn_detached(self._leave_later(stream, reason, grace_s))
        else:
            try:
                await self._let_go([stream], reason)
            finally:
                self.release(stream)

    async def _leave_later(self, stream: RequestStream, reason: str, grace_s: float) -> None:
        try:
            await self._let_go_later([stream], reason, grace_s)
        finally:
            self.release(stream)

    async def _close_later(self, streams: list[RequestStream], reason: str, grace_s: float) -> None:
        """Keep the channel subscribed (so workers see a listener) while the requests may
        still be resumed (``_let_go_later``), then unsubscribe."""
        try:
            await self._let_go_later(streams, reason, grace_s)
        finally:
            await self.broker.unregister(self.connection_id)

    async def _let_go_later(self, streams: list[RequestStream], reason: str, grace_s: float) -> None:
        """Keep following the resumed requests while they may still be resumed
        elsewhere; then let them go (see ``_let_go``). Own requests followed elsewhere
        are held until they end or nobody follows them any more."""
        deadline = time.monotonic() + grace_s
        renew_at = time.monotonic() + FOLLOW_TTL_S / 3
        while True:
            await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            streams = [s for s in streams if not s.drop_pending()]
            if not streams:
                break
            if time.monotonic() >= renew_at:
                renew_at = time.monotonic() + FOLLOW_TTL_S / 3
                for s in streams:
                    if s.resumed:
                        try:
                            await self.broker.follow(s.request_id, s.model, self.connection_id, FOLLOW_TTL_S, False)
                        except StreamfleetError:
                            pass
            if time.monotonic() >= deadline:
                streams = await self._let_go(streams, reason)
                if streams:
                    log.info("resume grace over; requests followed elsewhere keep running", count=len(streams))
                else:
                    break
                deadline = time.monotonic() + grace_s


_DETACHED: set[asyncio.Task] = set()
