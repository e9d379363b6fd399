"""One request's events, as the gateway delivers them: each once, in order, then its end.

A ``RequestStream`` is one request as seen by the gateway. Worker events reach it over
pub/sub (at most once) and are also in the request's log ``sf:log:{request_id}``; the
stream delivers them exactly once and in order. There is one event vocabulary, the
wire's (``shared.schema``), which every protocol adapter (``gateway/doors/ws.py``,
``gateway/doors/openai.py``, gRPC, voice) consumes and only renders:

* ``TokenEvent(request_id, index, text, logprobs)``  a piece of the completion
* ``PromptEvent(request_id, start, logprobs)``       the log probabilities of prompt tokens
                                                     ``start``…, before the first token (only
                                                     to a request that asked for them)
* ``TranscriptEvent(request_id, index, text, final)`` a speech utterance's transcript so
                                                     far (the voice door's requests)
* ``DoneEvent(request_id, finish_reason, …)``        the request finished (``cancelled``
                                                     after an interrupt)
* ``ErrorEvent(request_id, code, message)``          the request failed (``ev.error()``:
                                                     the typed ``StreamfleetError``)
* ``TICK``                                           ``tick_s`` passed without an event (only
                                                     when it is set): a keepalive marker, no event

The stream adds no event types of its own: what it adds is guarantees (exactly once, in
order, complete; ``RequestStream`` lists them) and the ends the gateway decides itself.
It also takes one it never yields: ``StartedEvent(request_id, prefilled, prompt_tokens)``,
a worker took the request and computes its prompt, after which the request runs under the
rules of a running one (its stall limit), no longer under its queue deadline.

A gap, or silence, makes the stream catch up from the log, read incrementally. A resumed
stream first replays the log from the client's index, then is followed live. Who feeds
the stream, follows its request and cancels it is its reply channel
(``gateway.requests.reply_channel``); the stream knows only how to read its log. Each request's
lifecycle around its stream (admission, submit or resume, cancel, the slot it gives back)
is a ``gateway.requests.lifecycle.ClientRequest``.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Final, Literal

from streamfleet.shared import aio
from streamfleet.shared.errors import ErrorCode, GenerationError, StreamfleetError, UnavailableError
from streamfleet.shared.logging import get_logger
from streamfleet.shared.schema import (
    PROGRESS,
    DoneEvent,
    EmbeddingEvent,
    ErrorEvent,
    Event,
    FinishReason,
    PromptEvent,
    StartedEvent,
    TokenEvent,
    TranscriptEvent,
)

__all__ = ["TICK", "Tick", "RequestStream", "LogReader"]

log = get_logger("gateway.request_stream")

#: seconds a worker is given to answer before the gateway decides itself: a queued
#: request past its deadline fails with ``timeout`` this much later, and a cancel may go
#: unanswered this long before the reply channel ends the request itself
CANCEL_GRACE_S = 5.0
#: seconds of silence from a running request before the stream checks its log
CATCH_UP_AFTER_S = 2.0
#: seconds between reads of a log that could not be read, while its shard fails over
OUTAGE_RETRY_S = 0.5
#: entries read from a log per XREAD
LOG_PAGE = 1000

#: ``await log_reader(after_entry_id, block_ms)``: the log's entries past an entry id
LogReader = Callable[[bytes, "int | None"], Awaitable[list[tuple[bytes, Event]]]]


class _Mark(enum.Enum):
    """What a stream queues besides its events; never yielded."""

    WAKE = "wake"
    TIMER = "timer"


#: queued to wake a waiting consumer (see ``RequestStream.resync``); never yielded
_WAKE: Final = _Mark.WAKE
#: queued by a stream's timer when the wait it was armed for may be over; never yielded
_TIMER: Final = _Mark.TIMER


class Tick:
    """Yielded by a stream with ``tick_s`` set when that long passed without an event
    (the SSE adapter sends a keepalive comment then)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "TICK"


TICK = Tick()


class RequestStream:
    """One request's events, in order, each index once, ending with a ``DoneEvent`` or an
    ``ErrorEvent``.

    What it guarantees, over the wire events as workers publish them (per message, at most
    once, possibly repeated or out of order):

    * Tokens once, in order. Each ``TokenEvent`` (a ``TranscriptEvent`` for speech, on the
      same rules) is delivered right after ``index - 1``:
      never a token a redelivered task regenerated (indices already delivered are
      dropped; a redelivered task regenerates from index 0), never one past a gap (held
      until the log fills it; a gap the log cannot fill fails the request).
    * Completeness. A ``DoneEvent`` is held back until every token before its
      ``completion_tokens`` was delivered.
    * The prompt first. A request that asked for its prompt's log probabilities
      (``prompt_positions``) gets ``PromptEvent``s covering positions 0, 1, … once each
      (a repeated position is dropped, an event that overlaps what was delivered is cut
      to its new part), and no token or end before the last of them; an event past a gap
      is held as a token is. Only a ``cancelled`` end (and an error) may come first: the
      worker stopped mid-prompt.
    * One end, then nothing: a ``DoneEvent`` or an ``ErrorEvent`` is the last event.
    * The gateway's own ends. ``end_cancelled`` ends the stream with a ``DoneEvent`` no
      worker sent: ``cancelled``, the completion tokens those delivered, no timings (all 0:
      ``DoneEvent.timed`` is false) and no model version, when no worker answered a cancel
      in time, or when its channel let a resumed request go. ``fail`` ends it with an
      ``ErrorEvent`` no worker sent, carrying the ``StreamfleetError``'s code, message,
      ``retry_after_ms`` and ``param`` (``ErrorEvent.error`` rebuilds it): a deadline or
      stall ``timeout``, the broker lost or its log unreadable past ``outage_grace_s``,
      events lost from the log (these three ``broker_unavailable``), or what an adapter
      ends it with (a revoked key, an utterance's audio the broker refused).

    Args:
        request_id: the fleet-wide id.
        client_id: the id the client chose.
        prompt_tokens: for a locally decided end (``end_cancelled``; 0 when unknown, as for a resume).
        deadline: unix time after which a request that has not started (no worker said it
            took it: ``StartedEvent``, or sent anything else) fails with ``timeout``.
        log_reader: ``await log_reader(after_entry_id, block_ms)`` reads the request's log.
        resumed: the stream continues a request submitted elsewhere (it replays the log
            first, and its client does not own the generation's life).
        next_index: first index the client still needs.
        prompt_positions: the prompt's tokens, when the request asked for their log
            probabilities (``PromptEvent``s); 0: none expected (a resume: the prompt's came
            before the tokens it resumes from), and any that come are dropped.
        stall_timeout_s: a started request silent this long (log included) fails with ``timeout``.
        outage_grace_s: how long a log that cannot be read is waited for before the request
            fails with ``broker_unavailable`` (on a Redis Cluster, a shard failing over:
            ``SF_REDIS_FAILOVER_S``; 0 on a single server, whose outage the pub/sub
            connection reports at once).
    """

    def __init__(self, request_id: str, client_id: str, *, prompt_tokens: int = 0, deadline: float,
                 log_reader: LogReader | None = None, resumed: bool = False, next_index: int = 0,
                 stall_timeout_s: float = 60.0, outage_grace_s: float = 0.0, prompt_positions: int = 0) -> None:
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
        self.started = False  # any event seen (a worker's StartedEvent, tokens or end)
        self.duplicates_dropped = 0
        self.gaps_repaired = 0
        self.gaps_skipped = 0
        self.trace_id = ""
        self.model = ""  # the request's model as recorded at submit (a resume learns it from the record)
        self._queue: aio.LightQueue[Event | Tick | _Mark] = aio.LightQueue()  # one consumer
        #: tokens past a gap, waiting for it to fill
        self._ahead: dict[int, TokenEvent | TranscriptEvent | EmbeddingEvent] = {}
        self._final: DoneEvent | None = None  # an end that arrived while a gap was open
        self.prompt_positions = prompt_positions
        self._prompt_next = 0  # the first prompt position not yet delivered
        self._prompt_ahead: dict[int, PromptEvent] = {}  # prompt events past a gap
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
        if type(ev) is StartedEvent:
            return  # a worker computes its prompt: no more a queue deadline (nothing to yield)
        if isinstance(ev, PROGRESS):
            if ev.index < self.next_index or ev.index in self._ahead:
                if not from_log:
                    self.duplicates_dropped += 1
            elif ev.index > self.next_index or self.prompt_open:
                self._ahead[ev.index] = ev
            else:
                self._deliver(ev)
        elif isinstance(ev, DoneEvent):
            if self.prompt_open and ev.finish_reason == FinishReason.cancelled:
                self._end(ev)  # stopped mid-prompt: no token follows
            elif self._ahead or self.next_index < ev.completion_tokens or self.prompt_open:
                self._final = ev  # tokens (or the prompt's log probabilities) are missing before it
            else:
                self._end(ev)
        elif isinstance(ev, ErrorEvent):
            self._end(ev)
        elif isinstance(ev, PromptEvent):
            self._feed_prompt(ev, from_log)

    @property
    def prompt_open(self) -> bool:
        """Prompt log probabilities are expected that have not all been delivered."""
        return self._prompt_next < self.prompt_positions

    def _feed_prompt(self, ev: PromptEvent, from_log: bool) -> None:
        """A prompt's log probabilities: delivered in position order, each position once;
        the tokens (and the end) held for them follow the last."""
        end = ev.start + len(ev.logprobs)
        if not self.prompt_open or end <= self._prompt_next or ev.start in self._prompt_ahead:
            if not from_log and self.prompt_positions:
                self.duplicates_dropped += 1
            return
        if ev.start > self._prompt_next:
            self._prompt_ahead[ev.start] = ev
            return
        self._deliver_prompt(ev)
        while self._prompt_ahead:
            first = min(self._prompt_ahead)
            if first > self._prompt_next:
                break  # a gap before it still
            held = self._prompt_ahead.pop(first)
            if held.start + len(held.logprobs) > self._prompt_next:
                self._deliver_prompt(held)
        if not self.prompt_open:
            self._prompt_ahead.clear()
            self._deliver_ahead()

    def _deliver_prompt(self, ev: PromptEvent) -> None:
        """Deliver ``ev`` (which reaches past ``_prompt_next``), cut to its new part if it
        overlaps what was delivered (another worker cut the prompt into other chunks)."""
        if ev.start < self._prompt_next:
            ev = PromptEvent(ev.request_id, self._prompt_next, ev.logprobs[self._prompt_next - ev.start:])
        self._queue.put_nowait(ev)
        self._prompt_next = ev.start + len(ev.logprobs)

    def _deliver(self, tok: TokenEvent | TranscriptEvent | EmbeddingEvent) -> None:
        self._queue.put_nowait(tok)
        self.next_index = tok.index + 1
        self._deliver_ahead()

    def _deliver_ahead(self) -> None:
        """Deliver the tokens held that follow on from ``next_index``, then the end held
        for them, if it is due."""
        while self.next_index in self._ahead:
            t = self._ahead.pop(self.next_index)
            self._queue.put_nowait(t)
            self.next_index = t.index + 1
        if self._final is not None and not self._ahead and self.next_index >= self._final.completion_tokens:
            self._end(self._final)

    def resync(self) -> None:
        """Read the log before waiting again (pub/sub may have dropped events)."""
        self._resync = True
        self._queue.put_nowait(_WAKE)

    @property
    def gap_open(self) -> bool:
        return bool(self._ahead) or self._final is not None or bool(self._prompt_ahead)

    def _skip_gap(self) -> None:
        """The log could not fill a gap (expired, or lost with a Redis restart): end the
        request with an error rather than hand the client a stream with a hole in it."""
        self.gaps_skipped += 1
        log.warning("token gap could not be repaired", request_id=self.request_id, missing_from=self.next_index)
        self.fail(UnavailableError("events of this request were lost by the message broker and could not be "
                                   "recovered from its log", retry_after_ms=1000))

    def fail(self, error: StreamfleetError) -> None:
        """End the request with an error the gateway decided on: an ``ErrorEvent`` of its
        code and message, with its retry hint and param (``ErrorEvent.error`` rebuilds it)."""
        if not self.finished:
            self.ended_here = True
            self._end(ErrorEvent(self.request_id, str(error.code), error.message,
                                 retry_after_ms=error.retry_after_ms, param=error.param))

    def end_cancelled(self) -> None:
        if not self.finished:
            self.ended_here = True
            self._end(DoneEvent(self.request_id, "cancelled", self.prompt_tokens, self.next_index))

    def _end(self, ev: DoneEvent | ErrorEvent) -> None:
        self.finished = True
        self._ahead.clear()
        self._prompt_ahead.clear()
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
            if isinstance(self._queue.get_nowait(), (DoneEvent, ErrorEvent)):
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

    async def next(self) -> Event | Tick:
        """The next event; an ``ErrorEvent`` (``timeout``) when the deadline or stall limit passes;
        ``TICK`` when ``tick_s`` passed without one."""
        while True:
            ev = await self._next()
            if ev is not _WAKE and ev is not _TIMER:  # (a timer's mark that events overtook)
                if ev is not TICK:
                    self._wait_until = None  # an event ends the wait a tick interrupted
                if self.tick_s is not None:
                    self._yielded = time.monotonic()
                return ev

    async def _get(self, wait: float) -> Event | Tick | Literal[_Mark.WAKE] | None:
        """The next queued event within ``wait`` seconds (None: the wait passed), or
        ``TICK`` first when one falls due sooner; the wait it interrupted goes on from where
        it was at the next call.

        Every token is waited for, yet hardly any wait runs out: rather than a timer armed
        and cancelled per token (``asyncio.timeout``), the stream keeps one timer that,
        when it fires early (the wait it was armed for was met, and a later one begun),
        re-arms itself for the wait under way — one timer event per stream every few
        seconds instead of two heap operations per token."""
        now = time.monotonic()
        wait_until = self._wait_until
        if wait_until is None:
            self._wait_until = wait_until = now + wait
        tick_at = self._yielded + self.tick_s if self.tick_s is not None else None
        ticking = tick_at is not None and tick_at < wait_until
        self._due = due = tick_at if ticking and tick_at is not None else wait_until
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

    async def _next(self) -> Event | Tick | _Mark:
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
                if self.resumed or time.time() > self.deadline + CANCEL_GRACE_S:
                    await self._read_log()  # (a worker's StartedEvent, lost by pub/sub, is there)
                if not self.started and self._queue.empty() and time.time() > self.deadline + CANCEL_GRACE_S:
                    self.fail(GenerationError("the request timed out waiting in the queue", code=ErrorCode.timeout))
            else:  # silence: pub/sub may have lost a message; the log has it
                await self._read_log()
                if self._queue.empty() and not self.gap_open and \
                        time.monotonic() - self._last_event > self.stall_timeout_s:
                    self.fail(GenerationError("the request timed out without a token", code=ErrorCode.timeout))
        return self._queue.get_nowait()

    def __aiter__(self) -> AsyncIterator[Event | Tick]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Event | Tick]:
        while True:
            ev = await self.next()
            yield ev
            if isinstance(ev, (DoneEvent, ErrorEvent)):
                return
