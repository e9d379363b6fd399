"""Intake: reading tasks from the lanes and starting them in the cores.

A worker reads with ``XREADGROUP`` from every lane of its model as its free slots and
the lane weights allow (docs/architecture.md, "A request's path", step 3). A busy worker
reads only when a gateway announced an entry it has not read (``sf:wake:{model}``, see
``WakeState``) or ``READ_EVERY_S`` has passed; an idle one blocks on the read. Entries
read beyond the free slots, and deliveries reclaimed from other workers, wait in the
in-flight table as held and start first.

Once gateways route tasks to this worker for the prompt prefixes its cache holds
(prefix-aware routing, workers/affinity.py), each lane's share is read from the worker's
affinity stream of that lane first, then from the lane; a wake for another worker's
affinity stream goes to ``Affinity``, which may take the task if it waits too long there.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ReadOnlyError, ResponseError

from streamfleet.shared.command_socket import blocking_link
from streamfleet.shared.fairshare import FAIR_READ_LUA, read_call
from streamfleet.shared.keys import GROUP, LANES, split_source
from streamfleet.shared.logging import get_logger
from streamfleet.shared.metrics import worker as metrics
from streamfleet.shared.redis import BROKER_ERRORS, RawScript, raw_streams, read_streams
from streamfleet.shared.schema import Wake, decode_task, stream_entry_id
from streamfleet.workers.affinity import Affinity
from streamfleet.workers.context import Part, WorkerContext
from streamfleet.workers.coreset import CoreSet
from streamfleet.workers.deadletters import DeadLetters
from streamfleet.workers.inflight import Delivery, InFlightTable
from streamfleet.workers.lanes import LanePolicy

__all__ = ["Intake", "WakeState", "READ_EVERY_S"]

log = get_logger("worker")

#: a busy worker reads its lanes at least this often, even with no wake announced
READ_EVERY_S = 0.05


class WakeState:
    """When a busy worker reads (no I/O): after a gateway announced a task newer than
    any read so far, or ``READ_EVERY_S`` after the last read in case a wake was lost
    (say while the pub/sub connection was re-established)."""

    def __init__(self, worker_id: str = "") -> None:
        #: this worker's id: a wake naming another worker (its affinity stream) wakes nothing
        self.worker_id = worker_id
        #: called with a wake for another worker's affinity stream (``Affinity.on_wake``)
        self.on_other: Callable[[Wake], None] | None = None
        #: called with a wake for this worker's own affinity stream (``Affinity.activate``)
        self.on_own: Callable[[], None] | None = None
        #: a gateway announced a task (sf:wake:{model}) newer than any read so far
        self.woken = False
        self.read_at = 0.0  # monotonic time of the last read
        self.last_read: dict[str, tuple[int, int]] = {}  # lane -> newest entry id read
        self.announced: dict[str, tuple[int, int]] = {}  # lane -> newest entry id announced
        self._unreadable = False  # a wake that named no entry came since the last read
        self._announced_at_read: dict[str, tuple[int, int]] = {}  # ``announced`` when the last read began
        self._waiter: asyncio.Future | None = None  # ``next_wake``'s

    def on_wake(self, data: bytes) -> None:
        """A gateway's enqueue announced a task (``shared.schema.Wake``): wake unless it
        was already read. An unreadable message wakes too (reading costs little)."""
        try:
            wake = Wake.decode(data)
        except ValueError:
            log.warning("unreadable wake message", data=data[:64])
            self._unreadable = True
            self._wake()
            return
        worker = wake.worker
        if worker:  # routed to one worker (its affinity stream, "<lane>@<worker id>")
            if worker != self.worker_id:
                if self.on_other is not None:
                    self.on_other(wake)
                return
            if self.on_own is not None:
                self.on_own()
        if wake.is_new(self.last_read):
            if wake.entry_id > self.announced.get(wake.lane, (0, 0)):
                self.announced[wake.lane] = wake.entry_id
            self._wake()

    def _wake(self) -> None:
        self.woken = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def next_wake(self) -> asyncio.Future:
        """Resolved by the next wake (already, when woken)."""
        waiter = self._waiter
        if waiter is None or waiter.done():
            waiter = self._waiter = asyncio.get_running_loop().create_future()
        if self.woken:
            waiter.set_result(None)
        return waiter

    def should_read(self) -> bool:
        return self.woken or time.monotonic() - self.read_at >= READ_EVERY_S

    def reading(self) -> None:
        """A read starts: a wake that lands during it is kept."""
        self.woken = False
        self._unreadable = False
        self.read_at = time.monotonic()
        self._announced_at_read = dict(self.announced)

    def settle(self, short: bool) -> None:
        """A read returned (``short``: with fewer tasks than it asked for, so the lanes
        held nothing more for this worker when it ran). A wake that landed during it for an
        entry the read took, or for one announced before it began (another worker took
        it), leaves nothing to read: a burst of enqueues is read in a few reads, not one
        per wake."""
        if self.woken and not self._unreadable:
            last, before = self.last_read, self._announced_at_read if short else {}
            self.woken = any(entry > last.get(lane, (0, 0)) and entry > before.get(lane, (0, 0))
                             for lane, entry in self.announced.items())

    def read(self, lane: str, message_id: bytes) -> None:
        """The read returned ``message_id`` from ``lane`` (a lane, or this worker's
        affinity source of one)."""
        entry_id = stream_entry_id(message_id.decode())
        if entry_id > self.last_read.get(lane, (0, 0)):
            self.last_read[lane] = entry_id


class Intake(Part):
    def __init__(self, ctx: WorkerContext, policy: LanePolicy, cores: CoreSet, table: InFlightTable,
                 wake: WakeState, dead_letters: DeadLetters, spawn: Callable[[Coroutine], None],
                 affinity: Affinity | None = None) -> None:
        super().__init__(ctx)
        self.affinity = affinity
        if affinity is not None:
            affinity.on_active = self._read_own_beside
            wake.on_own = self._own_wake
        self.policy = policy
        self.cores = cores
        self.table = table
        self.wake = wake
        self.dead_letters = dead_letters
        self.spawn = spawn
        # each lane's admissions counter, looked up once (labels() is a lookup per call)
        self._admitted = {lane: metrics.admissions.labels(self.model, lane) for lane in LANES}
        #: a Redis Cluster: a read that does not block may fail without stopping the worker
        #: (its lanes' shard failing over, docs/cluster.md): the running sequences go on
        self._tolerant = ctx.keys.cluster
        #: monotonic time since when the lanes' shard could not be read (None: it can)
        self.unreachable_since: float | None = None
        self._idle_read: asyncio.Future[list[Delivery]] | None = None  # an idle worker's blocking read, still out
        self._idle_read_own = False  # ... and whether it waits on this worker's affinity streams too
        self._held_wake = asyncio.Event()  # a delivery was held: an idle wait ends
        self._fair_read = RawScript(FAIR_READ_LUA)
        table.on_hold = self._held_wake.set

    async def admit(self, block: bool, read: bool = True, block_ms: int | None = None) -> None:
        """Start held tasks (read earlier, or reclaimed), then, with ``read``, read more;
        ``block``: wait up to ``block_ms`` (default ``SF_BLOCK_MS``) for a task when there
        is nothing else.

        On a Redis Cluster a read that does not block and cannot reach the lanes' shard
        reads nothing (the held tasks still start): the worker's other sequences, on
        other shards, are not held up by it. A blocking read (an idle worker) raises.

        Raises:
            BROKER_ERRORS: Redis is unreachable (on a cluster: only a blocking read).
            ResponseError: a lane refused the read (NOGROUP, UNBLOCKED).
        """
        if self._idle_read is not None and self._idle_read.done():
            self._collect_idle_read(self._idle_read, tolerant=not block)
        free = self.cores.free_slots
        entries = self.table.take_held(free)
        free -= len(entries)
        if free > 0 and read:
            blocking = block and not entries
            if blocking:
                entries += await self._wait_idle(free, block_ms)
                entries += self.table.take_held(self.cores.free_slots - len(entries))
            elif not self._tolerant:
                entries += await self._read(free, False)
            else:
                try:
                    entries += await self._read(free, False)
                except (*BROKER_ERRORS, ReadOnlyError) as exc:
                    self._unreachable(exc)
                else:
                    self._reachable()
        for delivery in entries:
            self._start(delivery)

    async def _wait_idle(self, free: int, block_ms: int | None) -> list[Delivery]:
        """An idle worker's wait for a task: its blocking read, cut short when a delivery
        is held meanwhile (the reclaim loop took over a dead worker's tasks), so that those
        start at once instead of after ``block_ms``. A read cut short stays out, and what
        it returns later is held (``_collect_idle_read``)."""
        read = self._idle_read
        if read is None:
            self._idle_read_own = self.affinity is not None and self.affinity.active
            if self.affinity is not None and self._idle_read_own:
                await self.affinity.ready()
            read = self._idle_read = asyncio.ensure_future(self._read(free, True, block_ms))
        self._held_wake.clear()  # (a hold from now on ends the wait; one before is in ``held``)
        if self.table.held:
            return []
        waiter = asyncio.ensure_future(self._held_wake.wait())
        try:
            await asyncio.wait((read, waiter), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            self.close()  # (the worker stops: its read goes with it)
            raise
        finally:
            waiter.cancel()
        if not read.done():
            return []
        self._idle_read = None
        return read.result()

    def _collect_idle_read(self, read: asyncio.Future[list[Delivery]], tolerant: bool) -> None:
        """What a blocking read cut short (``read``, the one still out) returned since:
        held, to start first."""
        self._idle_read = None
        try:
            got = read.result()
        except (*BROKER_ERRORS, ReadOnlyError) as exc:
            if not (tolerant and self._tolerant):
                raise
            self._unreachable(exc)
            return
        for delivery in got:
            self.table.hold(delivery)

    @property
    def _routed(self) -> Affinity:
        """The affinity streams' part: the callbacks that use it (``_own_wake``,
        ``_read_own_beside``) are installed only with prefix-aware routing on."""
        if self.affinity is None:
            raise RuntimeError("prefix-aware routing is off: this worker has no affinity streams")
        return self.affinity

    def _own_wake(self) -> None:
        """A gateway routed a task to this worker (a wake naming it): from now on its reads
        take its affinity streams (``Affinity.activate``)."""
        if self._routed.active:
            self._read_own_beside()
        else:
            self._routed.activate()  # (calls _read_own_beside)

    def _read_own_beside(self) -> None:
        """An idle read under way that began before gateways routed tasks here covers the
        lanes only: this worker's affinity streams are read at once beside it (what comes
        is held, which ends the idle wait)."""
        if self._idle_read is not None and not self._idle_read.done() and not self._idle_read_own:
            self._routed.spawn_read_own(self.spawn)

    def close(self) -> None:
        """Cancel a blocking read still out (the worker stops)."""
        if self._idle_read is not None:
            self._idle_read.cancel()
            self._idle_read = None

    def _unreachable(self, exc: Exception) -> None:
        if self.unreachable_since is None:
            self.unreachable_since = time.monotonic()
            metrics.redis_errors.labels("intake").inc()
            log.warning("cannot read the lanes; running sequences go on", error=str(exc))

    def _reachable(self) -> None:
        if self.unreachable_since is not None:
            log.info("lanes readable again", after_s=round(time.monotonic() - self.unreachable_since, 2))
            self.unreachable_since = None

    async def _read(self, free: int, block: bool, block_ms: int | None = None) -> list[Delivery]:
        self.wake.reading()
        out = await self._read_lanes(free, block, block_ms)
        for d in out:
            self.wake.read(d.lane, d.message_id)
        self.wake.settle(short=len(out) < free)
        return out

    async def _read_lanes(self, free: int, block: bool, block_ms: int | None = None) -> list[Delivery]:
        """Each lane's share of ``free`` (``LanePolicy``), what a lane lacked given to the
        lanes that had more; an idle worker (``block``) waits on them all."""
        asked = self.policy.split(free)
        got: dict[str, list[tuple[str, bytes, dict[bytes, bytes]]]] = {lane: [] for lane in LANES}
        lanes = {lane: asked[lane] for lane in LANES if asked.get(lane, 0) > 0}
        if lanes:
            got.update(await self._read_new(lanes))
        n = sum(len(v) for v in got.values())
        if n < free:  # give unused share to lanes that still had backlog
            for lane in LANES:
                short = free - n
                if short <= 0:
                    break
                if asked.get(lane, 0) and len(got[lane]) < asked[lane]:
                    continue  # this lane is drained
                more = (await self._read_new({lane: short}))[lane]
                got[lane].extend(more)
                n += len(more)
        self.policy.record({lane: len(v) for lane, v in got.items()}, asked)
        out = [Delivery(source, mid, f) for lane in LANES for source, mid, f in got[lane]]
        if not out and block:
            sources = self._sources()
            for key, items in await self._read_blocking(block_ms, list(sources.values())):
                source = sources[key if isinstance(key, bytes) else key.encode()]
                out.extend(Delivery(source, mid, f) for mid, f in items)
            for extra in out[free:]:
                self.table.hold(extra)
            out = out[:free]
            shared = {d.lane for d in out if d.lane in LANES}
            if shared:  # it took a lane's unread entry: the next waiting task takes its place
                self.spawn(self._top_up(shared))
        return out

    async def _top_up(self, lanes: set[str]) -> None:
        """Move tasks that wait for their tenant's turn into ``lanes`` until each holds the
        fair-share window unread again (shared/fairshare.py), so that the other idle workers'
        blocking reads wake for them; off the path of the task just read. A failure is left
        to the next read, which tops up as well."""
        try:
            await self._read_new(dict.fromkeys(lanes, 0), plain=True)
        except (*BROKER_ERRORS, ReadOnlyError, ResponseError) as exc:
            log.debug("fair-share top-up failed; the next read does it", error=str(exc))

    def _sources(self) -> dict[bytes, str]:
        """Stream key -> source of what an idle worker waits on: the lanes, and this
        worker's affinity streams once gateways route tasks here."""
        if self.affinity is not None:
            return self.affinity.sources()
        return {self.lane_keys[lane].encode(): lane for lane in LANES}

    async def _read_blocking(self, block_ms: int | None = None, sources: list[str] | None = None,
                             ) -> list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]:
        """An idle worker's wait for a task on any lane (``XREADGROUP ... BLOCK``):
        ``[(stream, [(entry id, fields)])]``, empty when ``block_ms`` passed. On a single
        server it goes out on a socket of its own (``sf-worker-<id>-reads``), written and
        read raw like the command socket's batches: the wake of an idle worker is on the
        way of every request that finds it idle, and redis-py's pooled connection and
        reply callbacks would lengthen it. On a
        Redis Cluster redis-py routes it to the lanes' shard.

        Raises:
            ResponseError: a lane refused the read (NOGROUP).
            BROKER_ERRORS: Redis is unreachable.
        """
        block_ms = self.settings.block_ms if block_ms is None else block_ms
        streams = [self.lane_keys[source] for source in (sources or LANES)]
        if isinstance(self.redis, RedisCluster):
            res = await self.redis.xreadgroup(GROUP, self.worker_id, dict.fromkeys(streams, ">"),
                                              count=1, block=block_ms)
            return [(key, [(mid, fields or {}) for mid, fields in items]) for key, items in read_streams(res)]
        link = blocking_link(self.redis, f"sf-worker-{self.worker_id}-reads")
        res = await link.blocking(b"XREADGROUP", b"GROUP", GROUP, self.worker_id, b"COUNT", 1, b"BLOCK", block_ms,
                                  b"STREAMS", *streams, *(b">" for _ in streams),
                                  block_s=block_ms / 1000)
        return raw_streams(res)

    async def _read_new(self, counts: dict[str, int], plain: bool = False,
                        ) -> dict[str, list[tuple[str, bytes, dict[bytes, bytes]]]]:
        """New entries of each lane (up to its count), without blocking, as ``(source,
        entry id, fields)``: one ``FAIR_READ_LUA`` per lane (the tasks waiting for their
        tenant's turn moved into it first, then ``XREADGROUP``), all in one ``RawBatch``
        on the worker's command socket (their replies read raw: no redis-py pipeline and
        response callbacks for a burst of tasks at a step boundary). Once gateways route
        tasks here, one script instead, which reads each lane's share from this worker's
        affinity stream first (``Affinity.read``); ``plain``: the shared lanes' script
        all the same (``_top_up``).

        Raises:
            ResponseError: a lane refused the read (NOGROUP: its stream or group vanished).
            BROKER_ERRORS: Redis is unreachable.
        """
        if not plain and self.affinity is not None and self.affinity.active:
            return await self.affinity.read(counts)
        s = self.settings
        calls = [read_call(self.keys, self.model, lane, self.worker_id, n, window=s.fair_window, ttl_s=s.fair_ttl_s)
                 for lane, n in counts.items()]
        # (partial: on a cluster a lanes' shard found unreachable is not tried at every step)
        results = await self._fair_read.run(self.redis, calls, partial=True)
        out: dict[str, list[tuple[str, bytes, dict[bytes, bytes]]]] = {}
        for lane, res in zip(counts, results):
            if isinstance(res, Exception):
                raise res
            # RESP2: [[stream, entries]]; RESP3 (a cluster client's connections): {stream: entries}
            out[lane] = [(lane, mid, f) for _key, entries in raw_streams(res) for mid, f in entries]
        return out

    def _start(self, d: Delivery) -> None:
        raw = d.raw_task
        try:
            task = decode_task(raw)
        except ValueError as exc:
            log.error("malformed task; dead-lettering", message_id=d.message_id.decode(), error=str(exc))
            self.spawn(self.dead_letters.send(d.lane, d.message_id, raw, f"malformed task: {exc}"))
            return
        now = time.time()
        if task.request_id in self.cores:
            # the same request delivered twice to this worker (e.g. reclaimed while still running here):
            # the running copy answers; drop the extra delivery without acking the live one
            log.warning("duplicate delivery ignored", request_id=task.request_id, message_id=d.message_id.decode())
            return
        cancelled = self.table.admit(d.lane, d.message_id, task)
        self.cores.add(task, d.replay)
        lane, routed_to = split_source(d.lane)
        self._admitted[lane].inc()
        if cancelled:
            self.cores.cancel(task.request_id)
        log.info("task admitted", request_id=task.request_id, trace_id=task.trace_id, lane=lane,
                 queue_ms=round((now - task.created_at) * 1000, 2), **({"routed_to": routed_to} if routed_to else {}))

