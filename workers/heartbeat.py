"""The heartbeat: every ``heartbeat_interval_s`` the worker rewrites its entry in
``sf:workers:{model}`` (one ``shared.schema.Heartbeat``), which gateways read for
readiness and other workers for takeover (docs/architecture.md, "Redis keys"). Every
tenth of ``STREAM_SLOT_TTL_S`` it also extends the stream slots of the requests it runs,
so a request that runs longer than the slot's lifetime keeps its key's slot to its end.
With the heartbeat it advertises its prefix cache's blocks (``PrefixAdvert``), and on a
clean stop removes its advert and its empty affinity streams with its entry.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from streamfleet.shared.aio import sleep_unless_cancelled
from streamfleet.shared.logging import get_logger
from streamfleet.shared.metrics import worker as metrics
from streamfleet.shared.redis import BROKER_ERRORS, refresh_members
from streamfleet.shared.schema import Heartbeat
from streamfleet.shared.tiers import STREAM_SLOT_TTL_S
from streamfleet.workers.affinity import Affinity
from streamfleet.workers.context import Part, WorkerContext
from streamfleet.workers.inflight import InFlightTable
from streamfleet.workers.prefixadvert import PrefixAdvert

__all__ = ["HeartbeatLoop", "TokenRate"]

log = get_logger("worker")


class TokenRate:
    """Tokens generated per second over the last ``window_s`` (for the heartbeat)."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._window: list[tuple[float, int]] = []

    def add(self, n: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._window.append((now, n))
        while self._window and self._window[0][0] < now - self.window_s:
            self._window.pop(0)

    def per_s(self, now: float | None = None) -> float:
        if not self._window:
            return 0.0
        now = time.monotonic() if now is None else now
        span = max(now - self._window[0][0], 1.0)
        return sum(n for _, n in self._window) / span


class HeartbeatLoop(Part):
    """The heartbeat loop, and the worker's deregistration when it stops.

    Args:
        beat: the worker's heartbeat as of now.
    """

    def __init__(self, ctx: WorkerContext, table: InFlightTable, beat: Callable[[], Heartbeat],
                 advert: PrefixAdvert | None = None, affinity: Affinity | None = None) -> None:
        super().__init__(ctx)
        self.table = table
        self.beat = beat
        self.advert = advert
        self.affinity = affinity
        #: a write of the entry and its removal never overlap, and none follows the removal
        #: (a beat sent just before ``deregister`` would otherwise put the entry back)
        self._write = asyncio.Lock()
        self._deregistered = False

    async def run(self) -> None:
        key = self.keys.workers(self.model)
        slots_due = time.monotonic() + STREAM_SLOT_TTL_S / 10
        while True:
            if time.monotonic() >= slots_due:
                slots_due = time.monotonic() + STREAM_SLOT_TTL_S / 10
                await self.refresh_slots()
            hb = self.beat()
            metrics.slots_in_use.labels(self.model).set(hb.slots_used)
            metrics.slots.labels(self.model).set(hb.max_batch)
            async with self._write:
                if self._deregistered:
                    return
                if self.advert is not None:  # (rewritten only when the cache changed)
                    try:
                        await self.advert.write()
                    except Exception as exc:  # never the heartbeat's end: the next beat tries again
                        log.warning("prefix advert failed", error=str(exc) or type(exc).__name__)
                try:
                    async with self.redis.pipeline(transaction=False) as pipe:
                        pipe.hset(key, self.worker_id, hb.encode())
                        pipe.expire(key, int(self.settings.worker_ttl_s * 3) + 1)
                        advertised = self.advert is not None and self.advert.refresh(pipe)
                        results = await pipe.execute()
                    if advertised and self.advert is not None:
                        self.advert.refreshed(results[-1])
                except BROKER_ERRORS as exc:
                    log.warning("heartbeat failed", error=str(exc))
            await sleep_unless_cancelled(self.settings.heartbeat_interval_s)  # a cancel a Redis call swallowed stops it

    async def refresh_slots(self) -> None:
        """Push the expiry of the stream slots of the requests running here."""
        held = [(self.keys.streams(slot), rid) for slot, rid in self.table.slots()]
        try:
            await refresh_members(self.redis, held, int((time.time() + STREAM_SLOT_TTL_S) * 1000),
                                  int(STREAM_SLOT_TTL_S * 1000))
        except BROKER_ERRORS as exc:
            log.warning("could not refresh stream slots", count=len(held), error=str(exc))

    async def deregister(self) -> None:
        """Remove this worker's entry, its prefix advert and its empty affinity streams (a
        clean stop), after any beat being written; no beat is written after it."""
        try:
            async with self._write:
                self._deregistered = True
                await self.redis.hdel(self.keys.workers(self.model), self.worker_id)
            if self.advert is not None:
                await self.advert.remove()
            if self.affinity is not None:
                await self.affinity.retire_own()
        except BROKER_ERRORS:
            pass
