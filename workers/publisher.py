"""Publishing a step's output: one ``RawBatch`` per step that appends every event to
its request log, publishes each connection's events and acks the finished tasks, in
that order (docs/architecture.md, "A request's path", step 5, and "Log before
publish"). A batch that fails is kept and goes out first next time.

The PUBLISH replies count a request's listeners: one that nobody hears is looked up in
``sf:attach:{id}`` (a client may have resumed it elsewhere) and cancelled once nobody
has listened for ``orphan_grace_s``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable, Coroutine


from streamfleet.shared.keys import GROUP
from streamfleet.shared.logging import get_logger
from streamfleet.shared.metrics import worker as metrics
from streamfleet.shared.redis import BROKER_ERRORS, RawBatch
from streamfleet.shared.schema import Attach, DoneEvent, Event, LogEntry, Task, TokenEvent, encode_events

from streamfleet.workers.context import Part, WorkerContext
from streamfleet.workers.coreset import CoreSet
from streamfleet.workers.inflight import InFlightTable

__all__ = ["Publisher"]

log = get_logger("worker")


class Publisher(Part):
    def __init__(self, ctx: WorkerContext, cores: CoreSet, table: InFlightTable,
                 spawn: Callable[[Coroutine], None]) -> None:
        super().__init__(ctx)
        self.cores = cores
        self.table = table
        self.spawn = spawn
        self.unsent: list = []  # (version, StepOutput) whose publish failed: first out next time

    async def publish_all(self, outs: list) -> None:
        """Publish steps (``(version, StepOutput)``) in order. A step whose batch failed
        (Redis stalled past the socket timeout, or down) stays queued and goes out first
        next time, so no event is ever skipped; repeating part of one is harmless
        (gateways drop indices they have)."""
        self.unsent.extend(outs)
        while self.unsent:
            version, out = self.unsent[0]
            await self.publish(out, version)
            self.unsent.pop(0)

    async def publish(self, out, version: str = "") -> None:
        """One batch for one step: log every event, PUBLISH each connection's events (the
        request's own connection and any that resumed it elsewhere), XACK + XDEL finished
        tasks. The log entries go first, so a gateway that sees a message can already find
        it (and anything before it) in the log.

        Raises:
            BROKER_ERRORS: the batch did not get through; nothing was acknowledged.
        """
        by_channel: dict[str, list[Event]] = defaultdict(list)
        rids_by_channel: dict[str, set[str]] = defaultdict(set)
        for reply_to, ev in out.events:
            if isinstance(ev, DoneEvent):
                ev.model_version = version
            for ch in self.table.channels(reply_to, ev.request_id):
                by_channel[ch].append(ev)
                rids_by_channel[ch].add(ev.request_id)
        channels = list(by_channel)
        acked = [(rid, fl) for rid in out.finished if (fl := self.table.get(rid)) is not None]
        batch = RawBatch()
        self.log_events(batch, [ev for _, ev in out.events], out.token_ids)
        first_publish = len(batch)
        keys = self.keys
        # on a cluster a request's log shares its connection's shard (shared/keys.py), so its
        # publish goes out in the same pipeline as its log entries; a follower's channel on
        # another shard, and the ack on the lanes' shard, wait for them (RawBatch, "after").
        # One server runs the batch in order: no list of keys to build per step.
        cluster = keys.cluster
        for ch in channels:
            batch.add(keys.publish, keys.reply(ch), encode_events(by_channel[ch]),
                      after=[keys.log(rid) for rid in rids_by_channel[ch]] if cluster else ())
        for rid, fl in acked:
            after = (keys.log(rid),) if cluster else ()
            batch.add(b"XACK", self.lane_keys[fl.lane], GROUP, fl.message_id, after=after)
            batch.add(b"XDEL", self.lane_keys[fl.lane], fl.message_id, after=after)
        for _, fl in acked:
            fl.acking = True
        try:
            results = await batch.execute(self.redis)
        except BaseException:
            for _, fl in acked:
                fl.acking = False
            raise
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:
            metrics.redis_errors.labels("publish").inc()
            log.warning("commands of a publish batch failed", failed=len(failed), first=str(failed[0]))
        ends = {ev.request_id: (ev.finish_reason if isinstance(ev, DoneEvent) else "error")
                for _, ev in out.events if not isinstance(ev, TokenEvent)}
        for rid, fl in acked:
            self.table.finish(rid, fl)
            outcome = ends.get(rid, "unknown")
            metrics.finished.labels(self.model, outcome).inc()
            log.info("task finished", request_id=rid, trace_id=fl.task.trace_id, outcome=outcome)
        self._check_heard(channels, rids_by_channel, results[first_publish:first_publish + len(channels)])

    async def announce(self, task: Task, ev: Event) -> None:
        """Log and publish the one event that ends a request not running here (a task
        given up on) to its connection and every follower.

        Raises:
            BROKER_ERRORS: Redis is unreachable.
        """
        batch = RawBatch()
        self.log_events(batch, [ev], tasks={task.request_id: task})
        for ch in {task.reply_to, *await self.followers_of(task.request_id)}:
            batch.add(self.keys.publish, self.keys.reply(ch), encode_events([ev]),
                      after=(self.keys.log(task.request_id),))
        await batch.execute(self.redis)

    def log_events(self, batch: RawBatch, events: list[Event], token_ids: dict | None = None,
                   tasks: dict[str, Task] | None = None) -> None:
        """Append events to their request logs (``sf:log:{request_id}``, one
        ``shared.schema.LogEntry`` each) in ``batch``; a token's entry also carries its id,
        for a takeover's replay. A request's end also gives back the API key's stream slot
        it holds (README: "Tenants"), whatever became of its client."""
        s = self.settings
        maxlen, ttl = s.log_maxlen, int(s.log_ttl_s)
        ids = token_ids or {}
        for ev in events:
            key = self.keys.log(ev.request_id)
            tid = ids.get((ev.request_id, ev.index)) if isinstance(ev, TokenEvent) else None
            batch.add(b"XADD", key, b"MAXLEN", b"~", maxlen, b"*", *LogEntry(ev, tid).fields())
            if not isinstance(ev, TokenEvent) or ev.index % 64 == 0:
                batch.add(b"EXPIRE", key, ttl)
            if not isinstance(ev, TokenEvent):  # the request's record lives as long as its log
                batch.add(b"EXPIRE", self.keys.request(ev.request_id), ttl)
                task = (tasks or {}).get(ev.request_id)
                if task is None and (fl := self.table.get(ev.request_id)) is not None:
                    task = fl.task
                if task is not None and task.slot:
                    batch.add(b"ZREM", self.keys.streams(task.slot), ev.request_id)

    def _check_heard(self, channels: list[str], rids_by_channel: dict[str, set[str]], receivers: list) -> None:
        """A request whose PUBLISHes reach nobody on any of its channels: its connection
        (or its whole gateway) is gone, or a gateway is re-subscribing after its pub/sub
        socket dropped (it then repairs the gap from the log). First see whether a client
        follows it elsewhere (a resume this worker did not hear of); stop it once nobody
        has listened for ``orphan_grace_s``."""
        heard: set[str] = set()
        unheard: set[str] = set()
        for ch, n in zip(channels, receivers):
            (heard if n and not isinstance(n, Exception) else unheard).update(rids_by_channel[ch])
        now = time.monotonic()
        grace = self.settings.orphan_grace_s
        for rid in heard:
            self.table.heard(rid)
        for rid in unheard - heard:
            if rid not in self.table:
                continue
            since, first = self.table.unheard(rid, now)
            if first and self.table.begin_look_up(rid):  # maybe a resume this worker did not hear of
                self.spawn(self._look_up_followers(rid))
            if now - since >= grace:
                self.table.heard(rid)
                metrics.cancelled_no_listener.labels(self.model).inc()
                log.info("nobody listening; cancelling", request_id=rid, unheard_s=round(now - since, 3))
                self.cores.cancel(rid)

    async def followers_of(self, rid: str) -> set[str]:
        """Connections that follow ``rid`` now (``sf:attach:{id}``, unexpired); empty when
        Redis cannot say."""
        try:
            members = await self.redis.zrangebyscore(self.keys.attach(rid),
                                                     *Attach.live_range(int(time.time() * 1000)))
        except BROKER_ERRORS:
            return set()
        return Attach.decode_members(members)

    async def _look_up_followers(self, rid: str) -> None:
        try:
            followers = await self.followers_of(rid)
        finally:
            self.table.end_look_up(rid)
        if followers and rid in self.table:
            self.table.add_followers(rid, followers)
