"""The one internal stream-event model that every protocol adapter consumes.

A ``RequestStream`` is one accepted request as seen by the gateway. The pub/sub reader
feeds it worker events; it drops token indices already delivered (a redelivered task
regenerates from index 0), notices gaps, and turns everything into four kinds of
``StreamEvent``:

* ``Token(index, text)``             a piece of the completion
* ``End(finish_reason, usage, …)``   the request finished (``cancelled`` after an interrupt)
* ``Failed(error)``                  the request failed (a ``StreamfleetError``)

and the adapters (``gateway/ws.py``, ``gateway/openai.py``) only render them. A
``ReplyChannel`` is one subscribed ``sf:reply:{connection_id}``: it submits requests and
routes their events; a WebSocket has one for all its requests, an HTTP request has its
own.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Union

from shared.errors import ErrorCode, GenerationError, StreamfleetError, error_from_code
from shared.logging import get_logger
from shared.schema import DoneEvent, ErrorEvent, Event, TokenEvent

__all__ = ["Token", "End", "Failed", "StreamEvent", "RequestStream", "ReplyChannel"]

log = get_logger("gateway.streams")

#: seconds a cancel may go unanswered before the gateway ends the request itself
CANCEL_GRACE_S = 5.0


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

    @property
    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}


@dataclass(frozen=True, slots=True)
class Failed:
    error: StreamfleetError


StreamEvent = Union[Token, End, Failed]


class RequestStream:
    """One request's events, in order, each index once, ending with ``End`` or ``Failed``.

    Args:
        request_id: the fleet-wide id.
        request: the ``ValidRequest`` it was made from.
        stall_timeout_s: end with ``timeout`` when a started request goes this long
            without an event (a queued one waits for its deadline instead).
    """

    def __init__(self, request_id: str, request: Any, *, deadline: float, stall_timeout_s: float = 60.0) -> None:
        self.request_id = request_id
        self.request = request
        self.deadline = deadline
        self.stall_timeout_s = stall_timeout_s
        self.next_index = 0
        self.finished = False
        self.cancel_requested = False
        self.duplicates_dropped = 0
        self.gaps_seen = 0
        self.trace_id = ""
        self._queue: asyncio.Queue[StreamEvent] = asyncio.Queue()

    @property
    def client_id(self) -> str:
        return self.request.client_id

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    # -- feeding (synchronous, from the pub/sub reader) ---------------------------------
    def feed(self, ev: Event) -> None:
        if self.finished:
            return
        if isinstance(ev, TokenEvent):
            if ev.index < self.next_index:
                self.duplicates_dropped += 1
                return
            if ev.index > self.next_index:
                self.gaps_seen += 1
                log.warning("token gap", request_id=self.request_id, expected=self.next_index, got=ev.index)
            self.next_index = ev.index + 1
            self._queue.put_nowait(Token(ev.index, ev.text))
        elif isinstance(ev, DoneEvent):
            self._end(End(ev.finish_reason, ev.prompt_tokens, ev.completion_tokens, ev.timing()))
        elif isinstance(ev, ErrorEvent):
            self._end(Failed(error_from_code(ev.code, ev.message)))

    def fail(self, error: StreamfleetError) -> None:
        """End the request with an error the gateway decided on."""
        if not self.finished:
            self._end(Failed(error))

    def end_cancelled(self) -> None:
        if not self.finished:
            self._end(End("cancelled", self.prompt_tokens, self.next_index))

    def _end(self, ev: StreamEvent) -> None:
        self.finished = True
        self._queue.put_nowait(ev)

    # -- consuming -----------------------------------------------------------------------
    async def next(self) -> StreamEvent:
        """The next event; ``Failed(timeout)`` when the deadline or stall limit passes."""
        if self._queue.empty():
            if self.next_index == 0:
                wait = max(0.0, self.deadline - time.time()) + CANCEL_GRACE_S
            else:
                wait = self.stall_timeout_s
            try:
                return await asyncio.wait_for(self._queue.get(), wait)
            except asyncio.TimeoutError:
                what = "waiting in the queue" if self.next_index == 0 else "without a token"
                self.fail(GenerationError(f"the request timed out {what}", code=ErrorCode.timeout))
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
        await self.broker.register(self.connection_id, self._route)
        return self

    def _route(self, events: list[Event]) -> None:
        for ev in events:
            stream = self.streams.get(ev.request_id)
            if stream is not None:
                stream.feed(ev)
                if stream.finished:
                    self.streams.pop(ev.request_id, None)

    async def submit(self, request: Any) -> tuple[RequestStream, int]:
        """Enqueue a validated request; returns its stream and the lane depth.

        Raises:
            StreamfleetError: refused (overload, broker down).
        """
        rid = uuid.uuid4().hex
        task = request.to_task(self.connection_id, request_id=rid)
        stream = RequestStream(rid, request, deadline=task.deadline or (time.time() + 3600),
                               stall_timeout_s=self.stall_timeout_s)
        stream.trace_id = task.trace_id
        self.streams[rid] = stream  # before XADD: a fast worker may answer before XADD returns
        try:
            depth = await self.broker.submit(task)
        except StreamfleetError:
            self.streams.pop(rid, None)
            raise
        log.info("request accepted", request_id=rid, trace_id=task.trace_id, model=task.model, lane=task.lane,
                 prompt_tokens=len(task.prompt_ids), queue_depth=depth, connection_id=self.connection_id)
        return stream, depth

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
        self.streams.pop(stream.request_id, None)

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def close(self, reason: str = "disconnect") -> None:
        """Unsubscribe and cancel whatever is still running."""
        if self.closed:
            return
        self.closed = True
        pending = [s for s in self.streams.values() if not s.finished]
        for s in pending:
            s.cancel_requested = True
        await asyncio.gather(*(self.broker.cancel(s.request_id, reason) for s in pending), return_exceptions=True)
        for s in pending:
            s.end_cancelled()
        self.streams.clear()
        for t in list(self._tasks):
            t.cancel()
        await self.broker.unregister(self.connection_id)
