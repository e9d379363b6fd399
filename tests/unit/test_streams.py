"""RequestStream: exactly-once, in-order delivery from at-most-once pub/sub plus the log."""

from __future__ import annotations

import asyncio
import time

from streamfleet.gateway.requests.request_stream import TICK, RequestStream
from streamfleet.shared.errors import UnavailableError, ValidationError
from streamfleet.shared.schema import (
    DoneEvent,
    ErrorEvent,
    StartedEvent,
    TokenEvent,
    decode_events,
    encode_event,
    encode_events,
)


def tok(i: int, text: str | None = None) -> TokenEvent:
    return TokenEvent("r", i, text if text is not None else f"t{i}")


def done(n: int, reason: str = "length") -> DoneEvent:
    return DoneEvent("r", reason, 3, n)


async def drain(stream: RequestStream) -> list:
    return [ev async for ev in stream]


def make(log=None, **kw) -> RequestStream:
    async def reader(after: bytes, block_ms):
        return list(log or [])

    return RequestStream("r", "c", prompt_tokens=3, deadline=time.time() + 60, log_reader=reader, **kw)


async def test_in_order_and_duplicates_dropped():
    s = make()
    for i in (0, 1, 0, 1, 2):  # a redelivered task starts again at 0
        s.feed(tok(i))
    s.feed(done(3))
    evs = await drain(s)
    assert [e.index for e in evs if isinstance(e, TokenEvent)] == [0, 1, 2]
    assert isinstance(evs[-1], DoneEvent) and evs[-1].completion_tokens == 3
    assert s.duplicates_dropped == 2


async def test_gap_is_repaired_from_the_log():
    log = [(f"{i}-0".encode(), tok(i)) for i in range(5)] + [(b"5-0", done(5))]
    s = make(log)
    s.feed(tok(0))
    s.feed(tok(1))
    s.feed(tok(4))  # 2 and 3 were lost by pub/sub
    s.feed(done(5))
    evs = await drain(s)
    assert [e.index for e in evs if isinstance(e, TokenEvent)] == [0, 1, 2, 3, 4]
    assert [e.text for e in evs if isinstance(e, TokenEvent)] == ["t0", "t1", "t2", "t3", "t4"]
    assert isinstance(evs[-1], DoneEvent) and s.gaps_repaired == 1


async def test_done_waits_for_missing_tokens():
    log = [(b"1-0", tok(0)), (b"2-0", tok(1)), (b"3-0", done(2))]
    s = make(log)
    s.feed(done(2))  # both tokens were lost; the end must not overtake them
    evs = await drain(s)
    assert [type(e).__name__ for e in evs] == ["TokenEvent", "TokenEvent", "DoneEvent"]


async def test_unrepairable_gap_fails_the_request_instead_of_a_hole():
    s = make([])  # the log expired (or Redis restarted empty)
    s.feed(tok(0))
    s.feed(tok(2))
    s.feed(done(3))
    evs = await drain(s)
    assert [e.index for e in evs if isinstance(e, TokenEvent)] == [0]  # never index 2 after 0
    assert isinstance(evs[-1], ErrorEvent) and evs[-1].code == "broker_unavailable"
    assert s.gaps_skipped == 1


async def test_resync_reads_the_log_for_missed_events():
    log = [(b"1-0", tok(0)), (b"2-0", tok(1)), (b"3-0", done(2))]
    s = make(log)
    s.feed(tok(0))
    s.resync()  # the subscription was re-established: token 1 and the end were missed
    evs = await asyncio.wait_for(drain(s), 5)
    assert [type(e).__name__ for e in evs] == ["TokenEvent", "TokenEvent", "DoneEvent"]


async def test_lost_final_event_found_in_the_log_after_silence(monkeypatch):
    monkeypatch.setattr("streamfleet.gateway.requests.request_stream.CATCH_UP_AFTER_S", 0.05)
    log = [(b"1-0", tok(0)), (b"2-0", done(1))]
    s = make(log)
    s.feed(tok(0))  # the done message was lost
    evs = await asyncio.wait_for(drain(s), 5)
    assert isinstance(evs[-1], DoneEvent)


def log_reader(entries: list, calls: list, page: int | None = None):
    """A log reader over ``entries`` (which may grow) that honours the position it is given
    and records it in ``calls``."""
    async def read(after: bytes, block_ms):
        calls.append(after)
        return [e for e in entries if e[0] > after][:page]
    return read


async def test_resumed_stream_replays_the_log_from_an_index_then_goes_live(monkeypatch):
    monkeypatch.setattr("streamfleet.gateway.requests.request_stream.LOG_PAGE", 2)
    entries = [(f"{i}-0".encode(), tok(i)) for i in range(6)]
    calls = []
    s = RequestStream("r", "c", deadline=time.time() + 60, log_reader=log_reader(entries, calls, page=2),
                      resumed=True, next_index=4)
    assert await asyncio.wait_for(s.next(), 5) == tok(4)
    assert await asyncio.wait_for(s.next(), 5) == tok(5)
    s.feed(tok(6))  # live, from pub/sub
    s.feed(done(7))
    evs = await asyncio.wait_for(drain(s), 5)
    assert [e.index for e in evs if isinstance(e, TokenEvent)] == [6]
    assert isinstance(evs[-1], DoneEvent)
    assert calls[:3] == [b"0-0", b"2-0", b"4-0"]  # one replay, page after page


async def test_log_reads_are_incremental_and_not_counted_as_duplicates():
    entries = [(f"{i}-0".encode(), tok(i)) for i in range(5)] + [(b"5-0", done(5))]
    s = RequestStream("r", "c", deadline=time.time() + 60, log_reader=log_reader(entries, []))
    s.feed(tok(0))
    s.feed(tok(2))  # a gap: read the log
    s.feed(tok(1))  # pub/sub lost nothing after all; the log repeats what pub/sub gave
    s.feed(tok(0))  # a real redelivery (the task started again on another worker)
    s.feed(tok(3))
    s.feed(tok(4))
    s.feed(done(5))
    evs = await asyncio.wait_for(drain(s), 5)
    assert [e.index for e in evs if isinstance(e, TokenEvent)] == [0, 1, 2, 3, 4]
    assert s.duplicates_dropped == 1  # only the redelivered token, not what the log repeated
    growing = entries[:4]  # the log as it stands at the first gap: indices 0..3
    reads = []
    s2 = RequestStream("r", "c", deadline=time.time() + 60, log_reader=log_reader(growing, reads))
    s2.feed(tok(0))
    s2.feed(tok(3))  # gap: 1 and 2 come from the log
    assert [(await s2.next()).index for _ in range(3)] == [0, 1, 2]
    assert (await s2.next()).index == 3
    growing.extend(entries[4:])
    s2.feed(done(5))  # index 4 is missing: the second read starts where the first ended
    evs = await asyncio.wait_for(drain(s2), 5)
    assert [e.index for e in evs if isinstance(e, TokenEvent)] == [4]
    assert reads == [b"0-0", b"3-0"]
    assert s2.duplicates_dropped == 0


async def test_errors_and_local_decisions():
    s = make()
    s.feed(ErrorEvent("r", "engine_error", "boom"))
    evs = await drain(s)
    assert isinstance(evs[0], ErrorEvent) and evs[0].code == "engine_error"

    s = make()
    s.feed(tok(0))
    s.end_cancelled()
    evs = await drain(s)
    assert isinstance(evs[-1], DoneEvent) and evs[-1].finish_reason == "cancelled" and evs[-1].completion_tokens == 1

    s = make()
    s.fail(UnavailableError("down"))
    s.feed(tok(0))  # nothing after the end
    evs = await drain(s)
    assert len(evs) == 1 and isinstance(evs[0], ErrorEvent)


async def test_the_stream_delivers_the_wire_events_themselves():
    """One event vocabulary: what a worker published is what the adapters get (once, in
    order), the worker's end with its timings and model version."""
    s = make()
    t0, end = tok(0), DoneEvent("r", "stop", 3, 1, queue_ms=1.25, ttft_ms=2.0, total_ms=3.0, model_version="v2")
    s.feed(t0)
    s.feed(end)
    evs = await drain(s)
    assert evs[0] is t0 and evs[-1] is end and end.timed
    err = ErrorEvent("r", "no_such_code", "boom")
    s = make()
    s.feed(err)
    [got] = await drain(s)
    assert got is err and got.error().code == "internal" and got.error().status == 500  # an unknown code


async def test_the_gateways_own_ends_are_wire_events_that_keep_what_the_error_carried():
    s = make()
    s.feed(tok(0))
    s.feed(tok(1))
    s.end_cancelled()
    evs = await drain(s)
    assert evs[-1] == DoneEvent("r", "cancelled", 3, 2) and not evs[-1].timed and evs[-1].model_version == ""
    assert evs[-1].usage() == {"prompt_tokens": 3, "completion_tokens": 2} and s.ended_here

    s = make()
    s.fail(ValidationError("bad", code="out_of_range", param="top_p", retry_after_ms=250))
    [ev] = await drain(s)
    assert ev == ErrorEvent("r", "out_of_range", "bad", retry_after_ms=250, param="top_p")
    err = ev.error()
    assert (type(err), err.status, err.param, err.retry_after_ms) == (ValidationError, 400, "top_p", 250)

    s = make([])  # a gap the log cannot fill: the retry hint of the gateway's own failure reaches the client
    s.feed(tok(1))
    [ev] = await drain(s)
    assert isinstance(ev, ErrorEvent) and ev.code == "broker_unavailable" and ev.error().retry_after_ms == 1000
    assert ev.error().to_frame("c")["retry_after_ms"] == 1000


def test_an_error_events_retry_hint_and_param_are_on_the_wire_only_when_set():
    """A worker's error encodes as it always did; one that carries them keeps them."""
    plain = ErrorEvent("r", "engine_error", "boom")
    assert encode_events([plain]) == b'[{"request_id":"r","code":"engine_error","message":"boom","type":"error"}]'
    assert encode_event(plain) == b'{"request_id":"r","code":"engine_error","message":"boom","type":"error"}'
    hinted = ErrorEvent("r", "broker_unavailable", "down", retry_after_ms=1000)
    assert decode_events(encode_events([plain, hinted])) == [plain, hinted]


async def test_queued_request_times_out_at_its_deadline(monkeypatch):
    monkeypatch.setattr("streamfleet.gateway.requests.request_stream.CANCEL_GRACE_S", 0.0)
    s = RequestStream("r", "c", deadline=time.time() + 0.05)
    evs = await asyncio.wait_for(drain(s), 5)
    assert isinstance(evs[0], ErrorEvent) and evs[0].code == "timeout"


async def test_a_request_its_worker_took_runs_past_its_queue_deadline(monkeypatch):
    """A worker's ``StartedEvent`` (it computes the prompt) ends the queue deadline: the
    request then runs under the running rules (its stall limit), and nothing is yielded
    for it; the word found only in the log at the deadline counts as well."""
    monkeypatch.setattr("streamfleet.gateway.requests.request_stream.CANCEL_GRACE_S", 0.0)
    monkeypatch.setattr("streamfleet.gateway.requests.request_stream.CATCH_UP_AFTER_S", 0.05)
    s = make(stall_timeout_s=0.4)
    s.deadline = time.time() + 0.05
    s.feed(StartedEvent("r", 64, 4000))
    t0 = time.monotonic()
    task = asyncio.ensure_future(drain(s))
    # a witness with the same deadline that no worker took: once it has timed out, the
    # deadline has passed for both
    witness = make()
    witness.deadline = s.deadline
    [ev] = await asyncio.wait_for(drain(witness), 5)
    assert isinstance(ev, ErrorEvent) and ev.code == "timeout"
    await asyncio.sleep(0)
    assert not task.done()  # past the deadline: still running
    s.feed(StartedEvent("r", 128, 4000))  # the worker says so again: the stall clock restarts
    s.feed(tok(0))
    s.feed(done(1))
    evs = await asyncio.wait_for(task, 5)
    assert [type(e) for e in evs] == [TokenEvent, DoneEvent] and time.monotonic() - t0 < 2

    # silent past the stall limit after it: a running request's ``timeout``
    s = make(stall_timeout_s=0.2)
    s.deadline = time.time() + 0.01
    s.feed(StartedEvent("r", 64, 4000))
    [ev] = await asyncio.wait_for(drain(s), 5)
    assert isinstance(ev, ErrorEvent) and ev.code == "timeout" and "without a token" in ev.message

    # pub/sub lost it; the log has it: read before the queue deadline fails the request
    async def reader(after: bytes, block_ms):
        return [] if after == b"1-0" else [(b"1-0", StartedEvent("r", 64, 4000))]

    s = RequestStream("r", "c", deadline=time.time() + 0.05, log_reader=reader, stall_timeout_s=0.3)
    [ev] = await asyncio.wait_for(drain(s), 5)
    assert s.started and "without a token" in ev.message
    assert decode_events(encode_events([StartedEvent("r", 64, 4000)])) == [StartedEvent("r", 64, 4000)]


async def test_drop_pending_discards_what_nobody_reads_and_tells_the_end():
    s = make()
    s.feed(tok(0))
    s.feed(tok(1))
    assert s.drop_pending() is False  # two tokens dropped, still running
    s.feed(tok(2))
    s.feed(done(3))
    assert s.drop_pending() is True and s.next_index == 3
    assert s.drop_pending() is True  # nothing left: still finished


async def test_ticks_come_when_nothing_else_does_and_never_postpone_the_catch_up(monkeypatch):
    """``tick_s`` (the SSE keepalive): a stream silent that long yields TICK; ticks more
    frequent than the catch-up read do not hold the read off (the lost final event is
    still found in the log), and events delivered in between reset the tick."""
    monkeypatch.setattr("streamfleet.gateway.requests.request_stream.CATCH_UP_AFTER_S", 0.3)
    log = [(b"1-0", tok(0)), (b"2-0", done(1))]
    s = make(log)
    s.tick_s = 0.05
    s.feed(tok(0))  # the done message was lost: only the log has it
    t0 = time.monotonic()
    evs = await asyncio.wait_for(drain(s), 5)
    assert isinstance(evs[0], TokenEvent) and isinstance(evs[-1], DoneEvent)
    ticks = [e for e in evs if e is TICK]
    assert 3 <= len(ticks) <= 8, evs  # about one per 0.05 s of the 0.3 s wait
    assert time.monotonic() - t0 < 1.0


async def test_a_busy_stream_keeps_one_timer_not_one_per_token(monkeypatch):
    """Waiting for each token arms no timer of its own (``asyncio.timeout`` would arm and
    cancel one per token): a stream that waits for each of 200 tokens schedules a
    handful of timers."""
    loop = asyncio.get_running_loop()
    timers = []
    for name in ("call_later", "call_at"):
        real = getattr(loop, name)
        monkeypatch.setattr(loop, name, lambda *a, _real=real, **k: timers.append(a) or _real(*a, **k))
    s = make()
    s.tick_s = 15.0
    fed = []

    def feed_one() -> None:  # one token per loop turn: the consumer waits for every one
        i = len(fed)
        fed.append(i)
        s.feed(tok(i) if i < 200 else done(200))
        if i < 200:
            loop.call_soon(feed_one)

    loop.call_soon(feed_one)
    evs = await asyncio.wait_for(drain(s), 10)
    assert [e.index for e in evs if isinstance(e, TokenEvent)] == list(range(200))
    assert len(timers) <= 5, len(timers)  # wait_for's own, the first wait's, one re-arm when it shortens


async def test_a_shared_channel_remembers_what_it_ended_itself_within_bounds(monkeypatch):
    """Only streams the gateway ended by itself are remembered (a worker's own end is
    not), on the shared channel only, at most ``LET_GO_REMEMBERED`` of them and each for
    ``LET_GO_REMEMBER_S``; an end arriving afterwards forgets the request."""
    from streamfleet.gateway.requests import reply_channel as mod

    monkeypatch.setattr(mod, "LET_GO_REMEMBERED", 3)
    now = [1000.0]
    monkeypatch.setattr(mod.time, "monotonic", lambda: now[0])

    def stream(rid: str, *, here: bool) -> RequestStream:
        s = RequestStream(rid, "c", deadline=time.time() + 60)
        s.model = "m"
        if here:
            s.fail(UnavailableError("down"))
        else:
            s.feed(DoneEvent(rid, "length", 3, 0))
        return s

    own = mod.ReplyChannel(None, "conn")  # a connection's channel: the worker's check covers it
    for ch in (own, mod.ReplyChannel(None, "proc", shared=True)):
        for rid, here in (("a", True), ("b", False), ("c", True), ("d", True)):
            s = ch.streams[rid] = stream(rid, here=here)
            ch.release(s)
            now[0] += 1
    assert own._let_go_ids == {}
    assert list(ch._let_go_ids) == ["a", "c", "d"]
    s = ch.streams["e"] = stream("e", here=True)
    ch.release(s)
    assert list(ch._let_go_ids) == ["c", "d", "e"]  # the oldest made room
    now[0] += mod.LET_GO_REMEMBER_S
    s = ch.streams["f"] = stream("f", here=True)
    ch.release(s)
    assert list(ch._let_go_ids) == ["f"]  # the others expired
    ch.route([DoneEvent("f", "cancelled", 3, 2)])
    assert ch._let_go_ids == {}
