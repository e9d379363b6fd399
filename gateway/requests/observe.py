"""Metrics and end-of-request log lines for a stream, whatever the adapter."""

from __future__ import annotations

import asyncio
import functools
import re
import time
from collections.abc import AsyncGenerator
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from streamfleet.gateway.requests.request_stream import RequestStream, Tick
from streamfleet.shared.logging import get_logger
from streamfleet.shared.metrics import gateway as m
from streamfleet.shared.schema import PROGRESS, DoneEvent, EmbeddingEvent, ErrorEvent, Event

__all__ = ["observed", "stop_events", "trace_id_from"]

log = get_logger("gateway")

#: W3C Trace Context ``traceparent``: version-trace_id-parent_id-flags, lower-case hex
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:-.*)?")


def trace_id_from(traceparent: str | None) -> str | None:
    """The trace id of a W3C ``traceparent`` header or gRPC metadata entry, which then
    names the request in every log line of the gateway and the worker; None (a new trace
    id) when it is absent or malformed, which the specification says to ignore."""
    if not traceparent or len(traceparent) > 512:
        return None
    value = traceparent.strip()
    m = _TRACEPARENT.fullmatch(value)
    if m is None or m.group(1) == "ff" or m.group(2) == "0" * 32 or m.group(3) == "0" * 16:
        return None
    if m.group(1) == "00" and len(value) != 55:  # version 00 has no further fields
        return None
    return m.group(2)


# A label lookup (``labels()``: a lock and a dict per call) once per kind of stream, not seven per
# request; the caches hold no more label sets than the metrics themselves keep.
@functools.cache
def _children(transport: str, model: str, lane: str) -> tuple[Gauge, Histogram, Histogram, Counter, Histogram]:
    """The metric children a stream of ``(transport, model, lane)`` records into."""
    return (m.streams.labels(transport), m.ttft.labels(model, lane, transport), m.itl.labels(model, transport),
            m.tokens.labels(model, transport), m.queue_time.labels(model, lane))


@functools.cache
def _requests(model: str, lane: str, transport: str, outcome: str, code: str) -> Counter:
    """The ``requests`` child of a stream that ended so."""
    return m.requests.labels(model, lane, transport, outcome, code)


@functools.cache
def _tier(tier: str) -> tuple[Counter, Counter, Histogram]:
    """The per-tier children (fair share: what each tier is served, and how long it waits)."""
    return (m.tier_tokens.labels(tier, "prompt"), m.tier_tokens.labels(tier, "generated"),
            m.tier_queue_time.labels(tier))


async def observed(stream: RequestStream, *, transport: str, model: str, lane: str, tier: str = "none"
                   ) -> AsyncGenerator[Event | Tick, None]:
    """Yield the stream's events, recording TTFT, inter-token latency, tokens and the outcome,
    and per ``tier`` (its key's; ``"none"`` with auth off) the tokens served and the wait."""
    streams, ttft, itl, tokens, queue_time = _children(transport, model, lane)
    streams.inc()
    started = stream.created
    last: float | None = None
    outcome, code = "abandoned", ""
    try:
        async for ev in stream:
            now = time.monotonic()
            if isinstance(ev, PROGRESS):
                if last is None:
                    if not stream.resumed:
                        ttft.observe(now - started)
                else:
                    itl.observe(now - last)
                last = now
                if type(ev) is not EmbeddingEvent:  # an input's vector is no completion token
                    tokens.inc()
            elif isinstance(ev, DoneEvent):
                outcome = ev.finish_reason
                if not stream.ended_here and not stream.resumed:  # a worker's end: it timed the queue
                    waited = ev.timing()["queue_ms"] / 1000
                    queue_time.observe(waited)
                    prompt, generated, tier_wait = _tier(tier)
                    prompt.inc(ev.prompt_tokens)
                    generated.inc(ev.completion_tokens)
                    tier_wait.observe(waited)
            elif isinstance(ev, ErrorEvent):
                outcome, code = "error", str(ev.error().code)
            yield ev
    finally:
        streams.dec()
        _requests(model, lane, transport, outcome, code).inc()
        if stream.duplicates_dropped:
            m.duplicates.inc(stream.duplicates_dropped)
        if stream.gaps_repaired:
            m.gaps.labels("repaired").inc(stream.gaps_repaired)
        if stream.gaps_skipped:
            m.gaps.labels("skipped").inc(stream.gaps_skipped)
        log.info("request ended", request_id=stream.request_id, trace_id=stream.trace_id, outcome=outcome,
                 code=code or None, tokens=stream.next_index, transport=transport,
                 duration_ms=round((time.monotonic() - started) * 1000, 1))


async def stop_events(pending: asyncio.Future[Any] | None, events: AsyncGenerator[Any, None]) -> None:
    """Stop reading a stream's ``observed`` events (``pending``: a read still under way)
    and let the observer record the outcome."""
    if pending is not None and not pending.done():
        pending.cancel()
        try:
            await pending
        except BaseException:
            pass
    try:
        await events.aclose()
    except RuntimeError:
        pass
