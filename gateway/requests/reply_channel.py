"""The reply channel: one subscribed ``sf:reply:{connection_id}`` and the requests answered on it.

A ``ReplyChannel`` is the gateway's side of a connection's pub/sub subscription (a
WebSocket, a gRPC ``Stream``, a resumed HTTP or gRPC call, or the process's shared channel
for the requests it submits: ``gateway.hub.Hub.shared_channel``). The broker's reader hands
it each message's events and it routes them to their requests' streams
(``gateway.requests.request_stream.RequestStream``, which makes them exactly-once and in order). It
submits requests, resumes requests started on any connection of any gateway (registering
itself as a follower, ``sf:attach:{request_id}`` and a ``Follow`` message, so the worker
publishes the request's events to it as well), and cancels what its client abandoned: at
once, or after a resume grace period for connections that dropped, unless another
connection follows it (docs/failures.md).
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from streamfleet.gateway.admission.kinds import TextRequest
from streamfleet.gateway.requests.request_stream import CANCEL_GRACE_S, LogReader, RequestStream
from streamfleet.shared.errors import ErrorCode, NotFoundError, StreamfleetError, UnavailableError
from streamfleet.shared.logging import get_logger
from streamfleet.shared.schema import ENDS, Event, RequestRecord, SpeechTask, Task

if TYPE_CHECKING:
    from streamfleet.gateway.admission.kinds import AnyRequest
    from streamfleet.gateway.requests.broker import Broker
    from streamfleet.shared.tiers import Tier

__all__ = ["ReplyChannel"]

log = get_logger("gateway.reply_channel")

#: seconds between two publishes of a cancel for one request (an unanswered cancel, or
#: one of a request still running after its stream ended here: ``ReplyChannel._unheard``);
#: ``CANCEL_GRACE_S`` (``gateway.requests.request_stream``) is how long a cancel may go unanswered
CANCEL_RESEND_S = 1.0
#: a follower registration lasts this long unless renewed (renewed every third of it)
FOLLOW_TTL_S = 15.0
#: a shared channel's memory of requests it let go of while they may still run
#: (``ReplyChannel._unheard``): at most this many, each for at most this long
LET_GO_REMEMBERED = 4096
LET_GO_REMEMBER_S = 600.0


@dataclass(slots=True)
class _LetGo:
    """A request a shared channel ended by itself (``ReplyChannel._remember_let_go``)."""

    model: str
    #: monotonic time the channel let it go
    let_go: float
    #: monotonic time before which no cancel is sent again
    next_cancel: float


class ReplyChannel:
    """A subscribed ``sf:reply:{connection_id}`` and the requests answered on it.

    Args:
        broker: the process's ``gateway.requests.broker.Broker``.
        connection_id: names the channel; fresh per connection (WebSocket, gRPC
            ``Stream``), per resumed HTTP or gRPC call, and per gateway process for the
            requests it submits (``gateway.hub.Hub.shared_channel``).
        shared: the process's shared channel. Its subscription outlives every request,
            so a worker's "nobody listening" check (docs/failures.md) never fires for a
            request whose stream the gateway ended by itself (a broker outage, a lost
            log, a cancel that could not be delivered); the channel stops such a request
            itself when its events keep arriving (``_unheard``).
    """

    def __init__(self, broker: Broker, connection_id: str | None = None, *, stall_timeout_s: float = 60.0,
                 shared: bool = False) -> None:
        self.broker = broker
        self.connection_id = connection_id or uuid.uuid4().hex
        self.stall_timeout_s = stall_timeout_s
        self.shared = shared
        self.streams: dict[str, RequestStream] = {}
        self._tasks: dict[asyncio.Task[Any], None] = {}  # (a dict as a set: lighter when empty)
        self.closed = False
        #: request id -> [model, when let go, next cancel at]: requests this shared channel
        #: ended itself, whose worker may not know (oldest first)
        self._let_go_ids: dict[str, _LetGo] = {}

    async def open(self) -> ReplyChannel:
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
        if isinstance(ev, ENDS):  # its end: the worker is done with it
            del self._let_go_ids[rid]
            return
        now = time.monotonic()
        if now < entry.next_cancel:
            return
        entry.next_cancel = now + CANCEL_RESEND_S
        self._spawn_detached(self._cancel_unheard(rid, entry.model))

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
            if len(ids) < LET_GO_REMEMBERED and now - ids[first].let_go < LET_GO_REMEMBER_S:
                break
            del ids[first]
        ids[stream.request_id] = _LetGo(stream.model, now, 0.0)

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

    async def submit(self, request: AnyRequest, request_id: str | None = None, owner: str = "", slot: str = "",
                     trace_id: str | None = None, tenant: str = "", tier: Tier | None = None,
                     token_limit: str | None = None) -> tuple[RequestStream, int]:
        """Enqueue a prepared request (``Validator.finish``); returns its stream and the
        lane depth. Its task (``to_task``) is the one serialized form it takes.

        Args:
            owner: the tenant the request belongs to (recorded with it; a resume must match).
            slot: the API key id whose stream slot the request holds ("" for none); the
                worker gives it back when the request ends.
            tenant, tier: whose fair share inside the lane it counts against, and that
                tenant's tier (its weight and cap; ``Broker.submit``).
            token_limit: the API key id whose token rate limit (``tier``'s
                ``tokens_per_minute``, where it has one) a text request's generated
                tokens, or an utterance's audio, are charged to when it ends (the worker
                charges them), None for none.

        Raises:
            StreamfleetError: refused (overload, broker down).
        """
        rid = request_id or self.broker.keys.new_request_id(self.connection_id)
        task = request.to_task(self.connection_id, request_id=rid, slot=slot, trace_id=trace_id)
        if token_limit and tier is not None and tier.token_rate_per_s is not None and \
                isinstance(task, (Task, SpeechTask)):  # charged what it generated, or its audio, at its end
            task.token_limit, task.token_rate, task.token_burst = token_limit, tier.token_rate_per_s, \
                tier.token_capacity
        scored = isinstance(task, Task) and task.params.prompt_logprobs is not None
        stream = RequestStream(rid, request.client_id, prompt_tokens=task.prompt_tokens,
                               deadline=task.deadline or (time.time() + 3600), log_reader=self._reader(rid),
                               stall_timeout_s=self.stall_timeout_s, outage_grace_s=self.broker.outage_grace_s,
                               prompt_positions=task.prompt_tokens if scored else 0)
        stream.trace_id = task.trace_id
        stream.model = task.model
        self.streams[rid] = stream  # before XADD: a fast worker may answer before XADD returns
        try:
            depth = await self.broker.submit(task, owner, tenant, tier)
        except StreamfleetError:
            self.streams.pop(rid, None)
            raise
        except BaseException:  # cancelled (the caller left) mid-enqueue: the task may be queued,
            self.streams.pop(rid, None)  # and on a channel others keep listening to nobody would stop it
            self._spawn_detached(self.broker.cancel(rid, task.model, "disconnect"))
            raise
        extra = {"prompt": request.prompt_text} if self.broker.settings.log_prompts and \
            isinstance(request, TextRequest) else {}
        log.info("request accepted", request_id=rid, trace_id=task.trace_id, model=task.model, lane=task.lane,
                 prompt_tokens=task.prompt_tokens, queue_depth=depth, connection_id=self.connection_id, **extra)
        return stream, depth

    async def resume(self, request_id: str, client_id: str, from_index: int, *, owner: str,
                     check: Callable[[RequestRecord], None] | None = None) -> RequestStream:
        """Follow a request started on any connection of any gateway, from ``from_index``:
        the log is replayed from there, then the request is followed live. Works from the
        moment the request was accepted, also while it still waits for a worker.

        Args:
            owner: the request must belong to it (else it is "not found"): the API key's
                owner, or with auth off the one its resume token names
                (``gateway.admission.gate``).
            check: called with the owner's request record before anything is followed;
                raises to refuse the resume (``ClientRequest.resume``: an embeddings
                request cannot be resumed).

        Raises:
            NotFoundError: no such request (unknown id, another tenant's, or expired).
            UnavailableError: Redis is unreachable.
            StreamfleetError: what ``check`` raised.
        """
        record = await self.broker.read_request(request_id)
        if record is None or not record.owner or not hmac.compare_digest(record.owner.encode(), owner.encode()):
            raise NotFoundError(f"no request {request_id!r} to resume (unknown, or its log expired)",
                                code=ErrorCode.unknown_request, param="request_id")
        if check is not None:
            check(record)
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

    def _forget(self, task: asyncio.Task[Any]) -> None:
        self._tasks.pop(task, None)

    def _spawn(self, coro: Coroutine[Any, Any, object]) -> None:
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

    def _spawn_detached(self, coro: Coroutine[Any, Any, object]) -> None:
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


_DETACHED: set[asyncio.Task[Any]] = set()
