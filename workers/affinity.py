"""Affinity streams: the tasks gateways send to one worker for the prompt prefix its cache
holds (docs/architecture.md, "Prefix-aware routing").

A gateway that routes a task to worker ``w`` adds it to ``sf:{model}:tasks:{lane}:@w``
(same group ``workers``, same slot as the lane), registers that stream in
``sf:{model}:affinity`` and wakes the model's workers with the source ``<lane>@w``.
This module is the worker's side:

* **its own streams** (``read``): once a gateway has routed a task here (a wake naming
  this worker, or its stream found in the registry) each lane's share of the free slots
  is read from this worker's affinity stream first, then from the shared lane, in one
  script (``READ_LUA``), so the lane weights and priorities stay as they were;
* **the others' streams** (``run``): nothing waits on a busy, stopped or dead worker
  because of affinity. A worker with free slots takes the entries of other workers'
  affinity streams that have waited undelivered past their worker's bound (``STEAL_LUA``
  looks at the next undelivered entry of each stream, after the group's last-delivered
  id, and reads those that are overdue, atomically). The bound (``wait_of``) is
  ``SF_AFFINITY_WAIT_MS``, or twice the longest of that worker's recent steps when longer (its
  heartbeat's ``step_ms``: a busy worker reads between steps, and a task taken from it
  is prefilled cold), at most ``WAIT_CAP`` times ``SF_AFFINITY_WAIT_MS``. It looks when a wake for another
  worker's stream comes due, and every ``SWEEP_S`` over the whole registry (a lost
  wake); never while it has no free slot;
* **cleaning up** (``retire``): an affinity stream that is empty and whose worker is
  gone is deleted and leaves the registry (``RETIRE_LUA``), by its worker when it stops
  cleanly, else by whichever worker's reclaim round notices (workers/reclaim.py, which
  also takes over what a dead consumer left pending in these streams).

Deliveries from an affinity stream carry its source (``"normal@w1"``) where a lane's
carry the lane's name: acks, dead letters, takeover and the drain find its key from it
(``shared.keys.LaneKeys``), and the drain hands such a task back to the shared lane.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Coroutine

from redis.exceptions import ResponseError

from streamfleet.shared.fairshare import FAIR_LIB
from streamfleet.shared.keys import GROUP, LANES, affinity_source, split_source
from streamfleet.shared.logging import get_logger
from streamfleet.shared.metrics import worker as metrics
from streamfleet.shared.redis import BROKER_ERRORS, RawScript, raw_entries, read_streams
from streamfleet.shared.schema import Wake, live_workers
from streamfleet.workers.context import Part, WorkerContext
from streamfleet.workers.inflight import Delivery, InFlightTable

__all__ = ["Affinity", "READ_LUA", "STEAL_LUA", "RETIRE_LUA", "SWEEP_S"]

log = get_logger("worker")

#: seconds between two looks of a worker with free slots at every other worker's affinity
#: stream (the wakes tell it sooner; this catches a wake it missed)
SWEEP_S = 1.0
#: seconds between two checks of a due stream while this worker has no free slot (no I/O)
BUSY_RETRY_S = 0.05
#: a routed task waits for its worker this many times the longest of the worker's recent
#: steps (when that is longer than ``SF_AFFINITY_WAIT_MS``): the step under way, and a margin
STEP_WAITS = 2.0
#: ... but never more than this many times ``SF_AFFINITY_WAIT_MS``
WAIT_CAP = 4.0
#: seconds the other workers' step times (their heartbeats) are used before read again
STEPS_TTL_S = 0.5

#: Read each lane's share: this worker's affinity stream of the lane first, then the
#: shared lane for what is left, after moving tasks that wait for their tenant's turn into
#: it (fair share, shared/fairshare.py). KEYS, nine per lane i: its affinity stream, then
#: the lane's stream and fair-share keys (``FAIR_LIB``, o = 9(i-1) + 1); ARGV[1] group,
#: ARGV[2] consumer, ARGV[3] the fair-share window, ARGV[4] its ttl (s), ARGV[4 + i] how
#: many to read of lane i. Returns, per lane, {affinity entries, lane entries} (as
#: XREADGROUP gives them). An affinity stream that does not exist (cleaned up, or Redis
#: restarted) is skipped: the next routed task makes it again.
READ_LUA = FAIR_LIB + """
local out = {}
local window, ttl = tonumber(ARGV[3]), tonumber(ARGV[4])
for i = 1, #KEYS / 9 do
  local k = 9 * (i - 1)
  local n = tonumber(ARGV[4 + i])
  local own, shared = {}, {}
  if n > 0 and redis.call('EXISTS', KEYS[k + 1]) == 1 then
    local r = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', n, 'STREAMS', KEYS[k + 1], '>')
    if r then own = r[1][2] end
  end
  if #own < n then
    if redis.call('ZCARD', KEYS[k + 3]) > 0 then
      release(k + 1, ARGV[1], n - #own + window, ttl)
    end
    local r = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', n - #own, 'STREAMS', KEYS[k + 2], '>')
    if r then shared = r[1][2] end
  end
  out[i] = {own, shared}
end
return out
"""

#: Take the overdue entries of other workers' affinity streams. KEYS: the streams, in the
#: order to look at them; ARGV[1] group, ARGV[2] consumer, ARGV[3] the most entries to
#: take, ARGV[3 + i] the wait (ms) after which an undelivered entry of KEYS[i] may be
#: taken. For each stream: the entries after the group's last-delivered id whose id (its
#: ms, Redis's clock) is at least the wait old are read with XREADGROUP (exactly those:
#: the script is atomic). Returns, per stream, {entries taken, ms until its next
#: undelivered entry is overdue (0: now, this call took its fill) or -1 (none waits)}.
STEAL_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local left = tonumber(ARGV[3])
local out = {}
for i = 1, #KEYS do
  local cutoff = now - tonumber(ARGV[3 + i])
  local taken, wait = {}, -1
  if redis.call('XLEN', KEYS[i]) > 0 then
    local last = nil
    for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[i])) do
      local name, id = nil, nil
      for j = 1, #g, 2 do
        if g[j] == 'name' then name = g[j + 1] elseif g[j] == 'last-delivered-id' then id = g[j + 1] end
      end
      if name == ARGV[1] then last = id end
    end
    if last then
      local n = 0
      for _, e in ipairs(redis.call('XRANGE', KEYS[i], '(' .. last, '+', 'COUNT', left + 1)) do
        local ms = tonumber(string.match(e[1], '^(%d+)'))
        if ms > cutoff then wait = ms - cutoff; break end
        if n == left then wait = 0; break end
        n = n + 1
      end
      if n > 0 then
        local r = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', n, 'STREAMS', KEYS[i], '>')
        if r then taken = r[1][2] end
        left = left - #taken
      end
    end
  end
  out[i] = {taken, wait}
end
return out
"""

#: Delete an affinity stream that holds nothing (no entry queued or in flight, since
#: workers XDEL what they ack) and drop it from the registry. KEYS[1] the stream, KEYS[2]
#: the registry. Returns 1 when it was retired, 0 when it still holds entries.
RETIRE_LUA = """
if redis.call('XLEN', KEYS[1]) > 0 then
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], KEYS[1])
return 1
"""


class Affinity(Part):
    """This worker's affinity streams, and its taking of other workers' overdue ones.

    Args:
        cores: free slots (``free_slots``) of the worker's cores.
        table: where what is taken is held, to start first.
        stopping: set when the worker drains: it takes nothing more.
    """

    def __init__(self, ctx: WorkerContext, cores, table: InFlightTable, stopping: asyncio.Event) -> None:
        super().__init__(ctx)
        self.cores = cores
        self.table = table
        self.stopping = stopping
        #: lane -> this worker's source for it (``"normal@<worker id>"``) and its key
        self.own = {lane: affinity_source(lane, self.worker_id) for lane in LANES}
        self.own_keys = {lane: self.keys.affinity(self.model, lane, self.worker_id) for lane in LANES}
        self.registry = self.keys.affinity_streams(self.model)
        #: a gateway routed tasks here: this worker's reads take its affinity streams
        self.active = False
        #: called once when the worker becomes active (the intake's idle read covers no
        #: affinity stream yet)
        self.on_active: Callable[[], None] | None = None
        self.wait_ms = self.settings.affinity_wait_ms
        self._steps: dict[str, float] = {}  # another worker -> its heartbeat's step_ms
        self._steps_read_at = -math.inf
        #: every affinity stream of the model, as the last reclaim round read the registry
        self.streams: set[str] = set()
        self._due: dict[str, float] = {}  # another worker's stream -> monotonic time an entry is overdue
        self._kick = asyncio.Event()
        self._read = RawScript(READ_LUA)
        self._made = False  # this worker's affinity streams and their group were made (``ready``)
        self._steal = ctx.redis.register_script(STEAL_LUA) if ctx.redis is not None else None
        self._retire = ctx.redis.register_script(RETIRE_LUA) if ctx.redis is not None else None

    # -- this worker's streams ------------------------------------------------------------
    def activate(self) -> None:
        if not self.active:
            self.active = True
            log.info("reading this worker's affinity streams", streams=list(self.own_keys.values()))
            if self.on_active is not None:
                self.on_active()

    def sources(self) -> dict[bytes, str]:
        """Stream key -> source, of what this worker reads: the lanes, and its own affinity
        streams once active (an idle worker's blocking read)."""
        out = {key.encode(): lane for lane, key in self.lane_keys.items()}
        if self.active:
            out.update({key.encode(): self.own[lane] for lane, key in self.own_keys.items()})
        return out

    async def ensure(self) -> None:
        """Make this worker's affinity streams and their groups, registered (once active:
        a worker never routed to has none)."""
        if not self.active:
            return
        for key in self.own_keys.values():
            try:
                await self.redis.xgroup_create(key, GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        await self.redis.sadd(self.registry, *self.own_keys.values())
        self._made = True

    async def ready(self) -> None:
        """Once active, make this worker's affinity streams before a read waits on them (a
        gateway makes only the stream of the lane it routes a task to).

        Raises:
            BROKER_ERRORS, ResponseError: as ``ensure``.
        """
        if self.active and not self._made:
            await self.ensure()

    def seen(self, streams: set[str]) -> None:
        """The registry as a reclaim round read it: an affinity stream of this worker in
        it (a gateway routed a task here whose wake was missed) makes it active."""
        self.streams = streams
        if not self.active and any(key in streams for key in self.own_keys.values()):
            self.activate()

    async def read(self, counts: dict[str, int]) -> dict[str, list[tuple[str, bytes, dict[bytes, bytes]]]]:
        """Each lane's entries (up to its count): this worker's affinity stream first, then
        the shared lane; ``lane -> [(source, entry id, fields)]``. One script, one round
        trip on the command socket (as the plain reads of ``Intake._read_new``).

        Raises:
            ResponseError: a lane refused the read (NOGROUP).
            BROKER_ERRORS: Redis is unreachable.
        """
        lanes = list(counts)
        fair = {lane: self.keys.fair(self.model, lane) for lane in lanes}
        script_keys = [k for lane in lanes for k in (self.own_keys[lane], self.lane_keys[lane],
                                                     *fair[lane].script_keys)]
        args: tuple[bytes | str | int, ...] = (GROUP, self.worker_id, self.settings.fair_window,
                                                 self.settings.fair_ttl_s, *(counts[lane] for lane in lanes))
        [res] = await self._read.run(self.redis, [(script_keys, args)], partial=True)
        if isinstance(res, Exception):
            raise res
        out: dict[str, list[tuple[str, bytes, dict[bytes, bytes]]]] = {}
        for lane, (own, shared) in zip(lanes, res):
            out[lane] = [(self.own[lane], mid, f) for mid, f in raw_entries(own)] + \
                        [(lane, mid, f) for mid, f in raw_entries(shared)]
        return out

    async def read_own(self, free: int) -> list[Delivery]:
        """This worker's affinity entries, up to ``free``, high lane first, without waiting
        (what an idle read that began before this worker was active does not cover).

        Raises:
            ResponseError, BROKER_ERRORS: as ``read``.
        """
        out: list[Delivery] = []
        for lane in LANES:
            if free - len(out) <= 0:
                break
            res = await self.redis.xreadgroup(GROUP, self.worker_id, {self.own_keys[lane]: ">"},
                                              count=free - len(out))
            out += [Delivery(self.own[lane], mid, f or {}) for _key, items in read_streams(res) for mid, f in items]
        return out

    async def retire_own(self) -> None:
        """A clean stop: this worker's affinity streams go, if empty (what is left in them is
        taken by the others once it has waited ``SF_AFFINITY_WAIT_MS``)."""
        if not self.active:
            return
        for key in self.own_keys.values():
            try:
                await self.retire(key)
            except (*BROKER_ERRORS, ResponseError):
                return

    async def retire(self, key: str) -> bool:
        """Delete ``key`` (an affinity stream) and drop it from the registry if it is empty;
        returns whether it was (False: entries are left in it).

        Raises:
            BROKER_ERRORS: Redis is unreachable.
        """
        done = bool(await self._retire(keys=[key, self.registry]))
        if done:
            self.streams.discard(key)
            self._due.pop(key, None)
        return done

    # -- other workers' streams -----------------------------------------------------------
    def on_wake(self, wake: Wake) -> None:
        """A gateway routed a task to another worker: look at that stream once the task
        may have waited ``SF_AFFINITY_WAIT_MS`` there (the first such wake sets the time)."""
        lane, worker = split_source(wake.lane)
        if lane not in LANES or not worker or worker == self.worker_id:
            return
        key = self.keys.affinity(self.model, lane, worker)
        if key not in self._due:
            self._due[key] = time.monotonic() + self.wait_of(worker) / 1000
            self._kick.set()

    def _owner(self, key: str) -> str:
        """The worker an affinity stream's key belongs to ("" for another key)."""
        source = self.keys.affinity_source_of(self.model, key)
        return split_source(source)[1] if source else ""

    def wait_of(self, worker: str) -> int:
        """How long (ms) a task routed to ``worker`` waits for it before this worker may
        take it: ``SF_AFFINITY_WAIT_MS``, or ``STEP_WAITS`` times its longest recent step when longer
        (as its last heartbeat read said), at most ``WAIT_CAP`` times the setting."""
        step = self._steps.get(worker, 0.0)
        return int(min(max(self.wait_ms, STEP_WAITS * step), WAIT_CAP * self.wait_ms))

    async def _read_steps(self) -> None:
        """The other workers' recent step times, from their heartbeats (at most every
        ``STEPS_TTL_S``; on failure the last ones read are kept)."""
        now = time.monotonic()
        if now - self._steps_read_at < STEPS_TTL_S:
            return
        self._steps_read_at = now
        try:
            raw = await self.redis.hgetall(self.keys.workers(self.model))
        except BROKER_ERRORS as exc:
            log.debug("could not read the workers' heartbeats", error=str(exc))
            return
        # every readable entry, however old: a stopped worker's last step time still bounds its wait
        self._steps = {hb.worker_id: hb.step_ms for hb in live_workers(raw or {}, math.inf, 0.0)}

    def _free(self) -> int:
        return self.cores.free_slots - len(self.table.held)

    def _others(self) -> list[str]:
        mine = set(self.own_keys.values())
        return [k for k in self.streams if k not in mine]

    async def run(self) -> None:
        """Take overdue entries of other workers' affinity streams while this worker has
        free slots: a stream is looked at when a wake for it comes due, and every stream
        every ``SWEEP_S``."""
        next_sweep = time.monotonic() + SWEEP_S
        while True:
            now = time.monotonic()
            due = [k for k, t in self._due.items() if t <= now]
            sweep = now >= next_sweep
            busy = False
            if (due or sweep) and not self.stopping.is_set():
                free = self._free()
                if free > 0:
                    for k in due:
                        del self._due[k]
                    look = set(due)
                    if sweep:
                        next_sweep = now + SWEEP_S
                        look.update(self._others())
                    if look:
                        try:
                            await self._take(look, free)
                        except Exception:  # (never this loop's end: what is overdue waits for the next look)
                            log.exception("taking overdue affinity entries failed")
                    continue
                busy = bool(due)
                if sweep:
                    next_sweep = now + SWEEP_S
            elif sweep:
                next_sweep = now + SWEEP_S
            until = min([next_sweep, *self._due.values()])
            timeout = BUSY_RETRY_S if busy else max(until - time.monotonic(), 0.0)
            self._kick.clear()
            try:
                async with asyncio.timeout(timeout):
                    await self._kick.wait()
            except TimeoutError:
                pass

    async def _take(self, streams: set[str], free: int) -> None:
        """One look at ``streams`` (high lanes first): hold what is overdue, up to ``free``,
        and note when the next entry of each comes due."""
        order = sorted(streams, key=lambda k: (0 if ":tasks:high:@" in k else 1, k))
        await self._read_steps()
        waits = [self.wait_of(self._owner(k)) for k in order]
        try:
            res = await self._steal(keys=order, args=[GROUP, self.worker_id, free, *waits])
        except (*BROKER_ERRORS, ResponseError) as exc:
            log.warning("could not look at other workers' affinity streams", error=str(exc))
            return
        now = time.monotonic()
        for key, waited, (taken, wait) in zip(order, waits, res):
            source = self.keys.affinity_source_of(self.model, key)
            wait = int(wait)
            if wait >= 0:
                at = now + wait / 1000
                if at < self._due.get(key, math.inf):
                    self._due[key] = at
            if source is None:
                continue
            for mid, fields in raw_entries(taken):
                log.info("took a task routed to another worker", stream=key, message_id=mid.decode(),
                         waited_past_ms=waited)
                metrics.affinity_taken.labels(self.model).inc()
                self.table.hold(Delivery(source, mid, fields))

    def spawn_read_own(self, spawn: Callable[[Coroutine], None]) -> None:
        """Read this worker's own affinity streams now, holding what comes (for an idle
        worker whose blocking read began before it was active)."""
        spawn(self._read_own_held())

    async def _read_own_held(self) -> None:
        free = self._free()
        if free <= 0 or self.stopping.is_set():
            return
        try:
            await self.ready()
            for d in await self.read_own(free):
                self.table.hold(d)
        except (*BROKER_ERRORS, ResponseError) as exc:
            log.warning("could not read this worker's affinity streams", error=str(exc))
