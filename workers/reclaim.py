"""Reclaim: keeping this worker's deliveries its own, and taking over those of dead
workers (docs/architecture.md, "Invariants": nothing is lost).

Every ``reclaim_interval_s`` the reclaim loop

* refreshes the idle time of this worker's own deliveries, and drops those another
  worker has claimed meanwhile;
* claims the deliveries of workers whose heartbeat stood still (``Takeover``);
* as a fallback, claims deliveries idle past ``claim_idle_ms`` (``XAUTOCLAIM``);
* does the same for the affinity streams of prefix-aware routing (workers/affinity.py),
  found in the model's registry ``sf:{model}:affinity``: when a worker is dead (at once
  when one more is found, else every ``AFFINITY_SWEEP_S``) and every
  ``claim_idle_ms / 2``, and retires the empty streams of dead workers.

A claimed task continues from its request log (the token ids it generated replay
instead of being generated again), is acked at once if its log shows it already ended,
and is dead-lettered after ``max_deliveries``.
"""

from __future__ import annotations

import asyncio
import time

from redis.exceptions import ResponseError
from redis.typing import StreamIdT

from streamfleet.shared.aio import sleep_unless_cancelled
from streamfleet.shared.keys import GROUP, LANES, split_source
from streamfleet.shared.logging import get_logger
from streamfleet.shared.metrics import worker as metrics
from streamfleet.shared.redis import (
    BROKER_ERRORS,
    ConsumerInfo,
    as_bytes,
    as_str,
    autoclaimed_entries,
    claimed_entries,
    consumer_infos,
    pending_entries,
    stream_entries,
)
from streamfleet.shared.schema import ENDS, Heartbeat, LogEntry, TokenEvent, decode_task
from streamfleet.workers.affinity import Affinity
from streamfleet.workers.context import Part, WorkerContext
from streamfleet.workers.coreset import CoreSet
from streamfleet.workers.deadletters import DeadLetters
from streamfleet.workers.inflight import Delivery, InFlightTable

__all__ = ["Takeover", "Reclaimer"]

log = get_logger("worker")

#: seconds between two looks at the affinity streams while some worker is dead (a death
#: found since the last look is looked at in the next round)
AFFINITY_SWEEP_S = 1.0


class Takeover:
    """Which other workers are dead, judged by how their heartbeats look to this one
    (no I/O: the reclaim loop feeds it what it reads).

    A worker is dead when its heartbeat entry has not changed for ``dead_after_s`` while
    this worker kept reading it without a gap. A gap in this worker's own reading (a
    Redis stall, its own loop held up) restarts everyone's clock, so that a stall that
    held up every heartbeat alike never makes a live worker look dead. A worker seen
    for the first time (a consumer with no heartbeat entry at all) gets a clock from then.

    At this worker's first look (it just started, say to replace a worker that died) an
    entry's clock starts at the time its heartbeat says it was written: a worker whose
    heartbeat is already older than ``dead_after_s`` is dead as soon as this worker has
    seen the entry stand still for ``min_watch_s`` — not ``dead_after_s`` after this
    worker's own start. The short watch is what keeps a live worker safe whatever the
    clocks say (one whose clock runs behind, one whose beats a Redis stall just held
    up): a live worker rewrites its entry every ``SF_HEARTBEAT_INTERVAL_S``, which
    ``min_watch_s`` exceeds.

    Args:
        dead_after_s: silence after which a worker is dead.
        min_watch_s: how long an entry must be seen standing still before the age its
            heartbeat states counts (at most ``dead_after_s``; default: ``dead_after_s``,
            that is the heartbeat's own age never shortens the wait).
    """

    def __init__(self, dead_after_s: float, min_watch_s: float | None = None) -> None:
        self.dead_after_s = dead_after_s
        self.min_watch_s = dead_after_s if min_watch_s is None else min(max(min_watch_s, 0.0), dead_after_s)
        # worker -> (heartbeat, when its clock started, since when this worker watched it unchanged)
        self._seen: dict[str, tuple[bytes, float, float]] = {}
        self._last_look: float | None = None

    def observe(self, heartbeats: dict[str, bytes], now: float, wall: float | None = None) -> None:
        """Record one read of the heartbeat hash (worker id -> entry) made at ``now``
        (monotonic; ``wall``: the unix time of the read, by default now's)."""
        last = self._last_look
        first = last is None
        if last is None or now - last > self.dead_after_s / 2:
            self._seen = {w: (blob, now, now) for w, (blob, _, _) in self._seen.items()}
        self._last_look = now
        # (only the first look reads the heartbeats' own ages)
        read_at = (time.time() if wall is None else wall) if first else 0.0
        for worker, blob in heartbeats.items():
            prev = self._seen.get(worker)
            if prev is None or prev[0] != blob:
                start = now - self._age(blob, read_at) if first and prev is None else now
                self._seen[worker] = (blob, start, now)
        stale = now - 60 * self.dead_after_s
        for worker in [w for w, (_, t, _) in self._seen.items() if t < stale and w not in heartbeats]:
            del self._seen[worker]

    def _age(self, blob: bytes, wall: float) -> float:
        """How long ago the heartbeat says it was written (0 when it cannot say; at most
        ``dead_after_s``)."""
        try:
            written = Heartbeat.decode(blob).heartbeat
        except ValueError:
            return 0.0
        return min(max(wall - written, 0.0), self.dead_after_s)

    def dead(self, worker: str, now: float) -> bool:
        seen = self._seen.get(worker)
        if seen is None:
            self._seen[worker] = (b"", now, now)
            return False
        return now - seen[1] >= self.dead_after_s and now - seen[2] >= self.min_watch_s


class Reclaimer(Part):
    def __init__(self, ctx: WorkerContext, cores: CoreSet, table: InFlightTable, dead_letters: DeadLetters,
                 stopping: asyncio.Event, affinity: Affinity | None = None) -> None:
        super().__init__(ctx)
        self.cores = cores
        self.table = table
        self.dead_letters = dead_letters
        self.stopping = stopping
        self.affinity = affinity
        self._dead_seen: frozenset[str] = frozenset()  # the dead workers at the last look at affinity streams
        self._affinity_look = 0.0  # monotonic time of that look
        self._affinity_idle_look = 0.0  # ... and of the last idle-claim look at them
        # an entry seen standing still for one heartbeat interval and a look past it was
        # not rewritten by a live worker: its heartbeat's own age counts from then
        self.takeover = Takeover(ctx.settings.worker_dead_after_s,
                                 ctx.settings.heartbeat_interval_s + ctx.settings.reclaim_interval_s)

    async def run(self) -> None:
        """A round every ``reclaim_interval_s``, the first at once (a replacement worker's
        first look at the heartbeats starts its watch of a dead worker's)."""
        while True:
            if not self.stopping.is_set():
                try:
                    await self.refresh_own()
                    await self.take_over_dead()
                    await self.reclaim_idle()
                except BROKER_ERRORS as exc:
                    log.warning("reclaim failed", error=str(exc))
                except ResponseError as exc:
                    log.warning("reclaim failed", error=str(exc))
            await sleep_unless_cancelled(self.settings.reclaim_interval_s)

    def _free(self) -> int:
        """Slots not yet promised to a held delivery."""
        return self.cores.free_slots - len(self.table.held)

    async def refresh_own(self) -> None:
        """Reset the idle time of this worker's own deliveries (XCLAIM JUSTID does not
        count a delivery), so a long generation is never taken from a live worker by the
        idle fallback. A delivery no longer ours (another worker judged this one dead,
        say after a long pause) is dropped here without a word: its new holder
        regenerates it, and gateways drop the indices they already have."""
        by_lane = self.table.deliveries()
        if not by_lane:
            return
        lanes = list(by_lane)
        async with self.redis.pipeline(transaction=False) as pipe:
            for lane in lanes:
                pipe.xpending_range(self.lane_keys[lane], GROUP, "-", "+", len(by_lane[lane]) + 64,
                                    consumername=self.worker_id)
            owned = await pipe.execute()
        keep: dict[str, list[StreamIdT]] = {}
        for lane, pending in zip(lanes, owned):
            mine = {p.message_id for p in pending_entries(pending)}
            keep[lane] = [m for m in by_lane[lane] if m in mine]
            lost = set(by_lane[lane]) - mine
            if lost:
                for rid, fl in self.table.lost(lane, lost):
                    self.cores.abandon(rid)
                    log.warning("a task of this worker was taken over by another; dropping it", request_id=rid,
                                message_id=fl.message_id.decode())
        async with self.redis.pipeline(transaction=False) as pipe:
            for lane, ids in keep.items():
                if ids:
                    pipe.xclaim(self.lane_keys[lane], GROUP, self.worker_id, 0, ids, justid=True)
            await pipe.execute()

    async def take_over_dead(self) -> None:
        """Claim the deliveries of workers that stopped heartbeating (see ``Takeover``),
        as many as this worker has free slots for; the rest go to other workers or the
        next round."""
        now, wall = time.monotonic(), time.time()
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.keys.workers(self.model))
            for lane in LANES:
                pipe.xinfo_consumers(self.lane_keys[lane], GROUP)
            pipe.smembers(self.keys.affinity_streams(self.model))
            heartbeats, *consumers, members = await pipe.execute()
        beats = {as_str(k): as_bytes(v) for k, v in heartbeats.items()}
        self.takeover.observe(beats, now, wall)
        streams = {as_str(k) for k in members}
        if self.affinity is not None:
            self.affinity.seen(streams)
        for lane, infos in zip(LANES, consumers):
            if not await self._take_over(lane, consumer_infos(infos), now):
                break  # no free slot left (a dead worker's empty affinity streams are still retired)
        if streams:
            await self._look_at_affinity(streams, beats, now)

    async def _take_over(self, source: str, infos: list[ConsumerInfo], now: float) -> bool:
        """Claim what the dead consumers among ``infos`` (``XINFO CONSUMERS`` of the stream
        of ``source``: a lane, or an affinity stream) left pending, as free slots allow.
        Returns False once this worker has no free slot left."""
        min_idle = int(self.settings.worker_dead_after_s * 500)  # a racing claimer's XCLAIM just reset it to 0
        for info in infos:
            name = info.name
            if name == self.worker_id or not info.pending or not self.takeover.dead(name, now):
                continue
            free = self._free()
            if free <= 0:
                return False
            key = self.lane_keys[source]
            pending = pending_entries(await self.redis.xpending_range(key, GROUP, "-", "+", min(free, info.pending),
                                                                      consumername=name))
            if not pending:
                continue
            deliveries = {p.message_id: p.times_delivered + 1 for p in pending}
            ids: list[StreamIdT] = [*deliveries]
            claimed = claimed_entries(await self.redis.xclaim(key, GROUP, self.worker_id, min_idle, ids))
            if claimed:
                log.warning("took over the tasks of a dead worker", dead_worker=name, lane=source,
                            count=len(claimed))
            for mid, fields in claimed:
                await self._adopt(source, mid, fields, deliveries.get(mid, 2), "dead worker")
        return True

    async def _look_at_affinity(self, streams: set[str], beats: dict[str, bytes], now: float) -> None:
        """The affinity streams (``streams``: the registry) as the lanes are looked at:
        what dead consumers left pending in them is taken over, deliveries idle past
        ``claim_idle_ms`` are claimed, and the empty streams of dead workers retired.
        Bounded: only while some worker is dead (at once when another dies, else every
        ``AFFINITY_SWEEP_S``) or every ``claim_idle_ms / 2`` for the idle claims, and only
        the streams that hold something are looked into (one ``XLEN`` each first)."""
        sources = {key: src for key in streams if (src := self.keys.affinity_source_of(self.model, key)) is not None}
        owners = {key: split_source(src)[1] for key, src in sources.items()}
        dead = frozenset(w for w in {*beats, *owners.values()} if w != self.worker_id and self.takeover.dead(w, now))
        idle_due = now - self._affinity_idle_look >= self.settings.claim_idle_ms / 2000
        if not idle_due and not (dead and (dead - self._dead_seen or now - self._affinity_look >= AFFINITY_SWEEP_S)):
            self._dead_seen = dead
            return
        self._dead_seen, self._affinity_look = dead, now
        if idle_due:
            self._affinity_idle_look = now
        keys = sorted(owners)
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.xlen(key)
            lengths = await pipe.execute(raise_on_error=False)
        held = [k for k, n in zip(keys, lengths) if isinstance(n, int) and n > 0]
        if self.affinity is not None:
            for key, n in zip(keys, lengths):
                if n == 0 and owners[key] in dead and await self.affinity.retire(key):
                    log.info("retired the affinity stream of a dead worker", stream=key, worker=owners[key])
        if not held or self._free() <= 0:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in held:
                pipe.xinfo_consumers(key, GROUP)
            consumers = await pipe.execute(raise_on_error=False)
        for key, infos in zip(held, consumers):
            if isinstance(infos, Exception):
                continue
            if not await self._take_over(sources[key], consumer_infos(infos), now):
                return
        if idle_due:
            for key in held:
                if not await self._claim_idle(sources[key]):
                    return

    async def reclaim_idle(self) -> None:
        """Fallback: deliveries idle past ``claim_idle_ms`` (their holder stopped refreshing
        them, whatever its heartbeat says)."""
        for lane in LANES:
            if not await self._claim_idle(lane):
                return

    async def _claim_idle(self, source: str) -> bool:
        """Claim the deliveries of ``source``'s stream idle past ``claim_idle_ms``, as free
        slots allow; False when this worker had no free slot."""
        free = self._free()
        if free <= 0:
            return False
        key = self.lane_keys[source]
        res = await self.redis.xautoclaim(key, GROUP, self.worker_id, self.settings.claim_idle_ms, "0-0", count=free)
        for mid, fields in autoclaimed_entries(res):
            if fields is None:
                continue
            info = pending_entries(await self.redis.xpending_range(key, GROUP, min=mid, max=mid, count=1))
            deliveries = info[0].times_delivered if info else 1
            await self._adopt(source, mid, fields, deliveries, "silent worker")
        return True

    async def _adopt(self, lane: str, mid: bytes, fields: dict[bytes, bytes] | None, deliveries: int,
                     source: str) -> None:
        """A delivery this worker just claimed: hold it to run, ack it if it already ended,
        or dead-letter it after too many deliveries."""
        if fields is None:
            return
        if deliveries > self.settings.max_deliveries:
            await self.dead_letters.give_up(lane, mid, fields, deliveries)
            return
        try:
            task = decode_task(fields.get(b"task") or b"")
        except ValueError:
            task = None
        replay: list[int] = []
        if task is not None:
            ended, replay = await self.read_progress(task.request_id)
            if ended:  # it finished, but its holder died before the ack got through
                log.info("reclaimed task had already ended; acknowledging it", request_id=task.request_id)
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.xack(self.lane_keys[lane], GROUP, mid)
                    pipe.xdel(self.lane_keys[lane], mid)
                    await pipe.execute()
                return
        log.warning("reclaimed a task", message_id=mid.decode(), lane=lane, deliveries=deliveries, source=source,
                    replay_tokens=len(replay))
        metrics.reclaimed.labels(self.model).inc()
        self.table.hold(Delivery(lane, mid, fields, replay or None))

    async def read_progress(self, rid: str) -> tuple[bool, list[int]]:
        """From the request's log: whether it already ended, and the ids of the tokens
        it generated (indices 0..n-1, as far as they run without a hole). Unreadable
        entries are skipped."""
        try:
            reply = await self.redis.xrange(self.keys.log(rid), "-", "+", count=self.settings.log_maxlen)
            entries = stream_entries(reply)
        except BROKER_ERRORS:
            return False, []
        by_index: dict[int, int] = {}
        for _, fields in entries:
            try:
                entry = LogEntry.decode(fields)
            except ValueError:
                continue
            if isinstance(entry.event, ENDS):
                return True, []
            if entry.token_id is None or not isinstance(entry.event, TokenEvent) or \
                    not isinstance(entry.event.index, int):
                continue
            by_index[entry.event.index] = entry.token_id
        replay: list[int] = []
        while len(replay) in by_index:
            replay.append(by_index[len(replay)])
        return False, replay
