"""Metrics and end-of-request log lines for a stream, whatever the adapter."""

from __future__ import annotations

import time
from typing import AsyncIterator

from streamfleet.shared.logging import get_logger
from streamfleet.shared.metrics import gateway as m

from streamfleet.gateway.streams import End, Failed, RequestStream, StreamEvent, Token

__all__ = ["observed"]

log = get_logger("gateway")


async def observed(stream: RequestStream, *, transport: str, model: str, lane: str) -> AsyncIterator[StreamEvent]:
    """Yield the stream's events, recording TTFT, inter-token latency, tokens and the outcome."""
    m.streams.labels(transport).inc()
    ttft, itl, tokens = m.ttft.labels(model, lane, transport), m.itl.labels(model, transport), \
        m.tokens.labels(model, transport)  # label lookups once per stream, not per token
    started = stream.created
    last: float | None = None
    outcome, code = "abandoned", ""
    try:
        async for ev in stream:
            now = time.monotonic()
            if isinstance(ev, Token):
                if last is None:
                    if not stream.resumed:
                        ttft.observe(now - started)
                else:
                    itl.observe(now - last)
                last = now
                tokens.inc()
            elif isinstance(ev, End):
                outcome = ev.finish_reason
                if ev.timing.get("queue_ms") is not None and not stream.resumed:
                    m.queue_time.labels(model, lane).observe(ev.timing["queue_ms"] / 1000)
            elif isinstance(ev, Failed):
                outcome, code = "error", str(ev.error.code)
            yield ev
    finally:
        m.streams.labels(transport).dec()
        m.requests.labels(model, lane, transport, outcome, code).inc()
        if stream.duplicates_dropped:
            m.duplicates.inc(stream.duplicates_dropped)
        if stream.gaps_repaired:
            m.gaps.labels("repaired").inc(stream.gaps_repaired)
        if stream.gaps_skipped:
            m.gaps.labels("skipped").inc(stream.gaps_skipped)
        log.info("request ended", request_id=stream.request_id, trace_id=stream.trace_id, outcome=outcome,
                 code=code or None, tokens=stream.next_index, transport=transport,
                 duration_ms=round((time.monotonic() - started) * 1000, 1))
