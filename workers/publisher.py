"""Publishing a step's output: one ``RawBatch`` per step that appends every event to
its request log, publishes each connection's events and acks the finished tasks, in
that order (docs/architecture.md, "A request's path", step 5, and "Log before
publish"). A batch that fails is kept and goes out first next time.

On a Redis Cluster a step's batch reaches each shard on its own (docs/cluster.md, "When
a shard fails"): what went to a shard that cannot be reached (a primary that died and
whose replica is not yet elected) is kept, command by command, and goes out first next
time, while the rest of the step — the events of connections on the other shards —
goes out now. So a failing shard pauses only the streams whose channels live on it.
An ack waits for its request's log entries, a follower's publish for the entries it
announces (``RawBatch``, ``after``), across steps as within one. A request whose events
have not reached its shard for ``SF_REDIS_FAILOVER_S`` is cancelled (its gateway ends
the stream then, for the same reason), so what is kept stays bounded; what was kept still
goes out, in order, if the shard comes back.

The PUBLISH replies count a request's listeners: one that nobody hears is looked up in
``sf:attach:{id}`` (a client may have resumed it elsewhere) and cancelled once nobody
has listened for ``orphan_grace_s``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Coroutine

from streamfleet.shared.keys import GROUP, split_source
from streamfleet.shared.logging import get_logger
from streamfleet.shared.metrics import worker as metrics
from streamfleet.shared.redis import BROKER_ERRORS, RawBatch, RawScript
from streamfleet.shared.schema import (
    ENDS,
    AnyTask,
    Attach,
    DoneEvent,
    Event,
    LogEntry,
    PromptEvent,
    SpeechTask,
    StartedEvent,
    Task,
    TokenEvent,
    encode_events,
)
from streamfleet.shared.tiers import AUDIO_TOKENS_PER_S
from streamfleet.shared.tokenbucket import TOKEN_BUCKET_LUA, bucket_args
from streamfleet.workers.context import Part, WorkerContext
from streamfleet.workers.coreset import CoreSet
from streamfleet.workers.inflight import InFlight, InFlightTable

__all__ = ["Publisher"]

log = get_logger("worker")

#: the token bucket's script (shared/tokenbucket.py), for the generated tokens' charges
TOKEN_BUCKET = RawScript(TOKEN_BUCKET_LUA)

#: what a kept command of a cluster's batch does once it went out: a publish, the set of
#: the request ids it carries; an ack, ``(request id, its InFlight, its outcome)``
_Tag = set[str] | tuple[str, InFlight, str]
#: the events whose log entry always refreshes the log's expiry (a token's, every 64th)
_EXPIRE_EACH = (*ENDS, PromptEvent, StartedEvent)


def served(task: object, done: DoneEvent | None) -> float:
    """The tokens a request that ended was served, charged to its tenant's fair share and
    its key's token rate limit at its end: a text request's generated tokens, an
    utterance's seconds of audio at ``AUDIO_TOKENS_PER_S``; nothing for one that failed."""
    if done is None:
        return 0.0
    if type(task) is Task:
        return float(done.completion_tokens)
    if type(task) is SpeechTask:
        return done.audio_s * AUDIO_TOKENS_PER_S
    return 0.0


class Publisher(Part):
    def __init__(self, ctx: WorkerContext, cores: CoreSet, table: InFlightTable,
                 spawn: Callable[[Coroutine], None]) -> None:
        super().__init__(ctx)
        self.cores = cores
        self.table = table
        self.spawn = spawn
        self.unsent: list = []  # (version, StepOutput) whose publish failed: first out next time
        # a cluster's commands that could not reach their shard: first out next time, and
        # what to do once each publish or ack among them went out (index -> the set of
        # the request ids a publish carries, or an ack's (request id, InFlight, outcome))
        self._kept: RawBatch | None = None
        self._kept_tags: dict[int, _Tag] = {}
        self._stuck: dict[str, float] = {}  # request id -> since when its events do not reach its shard
        #: request id -> when its events reached its shard again after a failover: its
        #: gateways re-subscribe on the new primary meanwhile (a longer orphan grace)
        self._recovered: dict[str, float] = {}
        self._sharded = ctx.keys.cluster
        #: (bucket key, args) of the token rate limits to charge for the tokens of the
        #: requests that ended in the batch being built (``_charge_tokens``)
        self._token_charges: list[tuple[list[str], list[str | int]]] = []

    @property
    def pending(self) -> bool:
        """Events (or acks) wait to go out: a failed step, or a shard's share of one."""
        return bool(self.unsent) or self._kept is not None

    async def publish_all(self, outs: list) -> None:
        """Publish steps (``(version, StepOutput)``) in order. A step whose batch failed
        (Redis stalled past the socket timeout, or down) stays queued and goes out first
        next time, so no event is ever skipped; repeating part of one is harmless
        (gateways drop indices they have). On a cluster, only a failing shard's share
        of a step stays queued (``publish_sharded``)."""
        if self._sharded:
            if not outs and self._kept is not None:
                await self.publish_sharded(None)
            for version, out in outs:
                await self.publish_sharded(out, version)
            return
        self.unsent.extend(outs)
        while self.unsent:
            version, out = self.unsent[0]
            await self.publish(out, version)
            self.unsent.pop(0)

    def _build(self, batch: RawBatch, out, version: str, tags: dict[int, _Tag] | None = None):
        """Append one step's commands to ``batch``: its log entries, each channel's
        publish, the finished tasks' acks. Returns ``(channels, rids_by_channel, acked,
        first_publish)``; with ``tags``, each publish's index maps to the set of the
        request ids it carries there, and each ack's to ``(request id, InFlight, outcome)``."""
        by_channel: dict[str, list[Event]] = defaultdict(list)
        rids_by_channel: dict[str, set[str]] = defaultdict(set)
        # ``StartedEvent``s go in a message of their own: a gateway older than them drops
        # a message with a type it does not know, and the tokens beside them with it
        started: dict[str, list[Event]] = {}
        for reply_to, ev in out.events:
            if isinstance(ev, DoneEvent):
                ev.model_version = version
            for ch in self.table.channels(reply_to, ev.request_id):
                if type(ev) is StartedEvent:
                    started.setdefault(ch, []).append(ev)
                else:
                    by_channel[ch].append(ev)
                rids_by_channel[ch].add(ev.request_id)
        channels = list(rids_by_channel)
        acked = [(rid, fl) for rid in out.finished if (fl := self.table.get(rid)) is not None]
        self.log_events(batch, [ev for _, ev in out.events], out.token_ids)
        keys = self.keys
        # on a cluster a request's log shares its connection's shard (shared/keys.py), so its
        # publish goes out in the same pipeline as its log entries; a follower's channel on
        # another shard, and the ack on the lanes' shard, wait for them (RawBatch, "after").
        # One server runs the batch in order: no list of keys to build per step.
        cluster = keys.cluster
        for ch, evs in started.items():  # beside other events: a message before theirs
            if ch in by_channel:
                batch.add(keys.publish, keys.reply(ch), encode_events(evs),
                          after=[keys.log(ev.request_id) for ev in evs] if cluster else ())
        first_publish = len(batch)
        for ch in channels:  # one message a channel: its reply counts the listeners (``_check_heard``)
            i = batch.add(keys.publish, keys.reply(ch), encode_events(by_channel.get(ch) or started[ch]),
                          after=[keys.log(rid) for rid in rids_by_channel[ch]] if cluster else ())
            if tags is not None:
                tags[i] = rids_by_channel[ch]
        if acked:
            ends = {ev.request_id: (ev.finish_reason if isinstance(ev, DoneEvent) else "error")
                    for _, ev in out.events if isinstance(ev, ENDS)} if tags is not None else {}
            done = {ev.request_id: ev for _, ev in out.events if type(ev) is DoneEvent}
            for rid, fl in acked:
                after = (keys.log(rid),) if cluster else ()
                i = batch.add(b"XACK", self.lane_keys[fl.lane], GROUP, fl.message_id, after=after)
                batch.add(b"XDEL", self.lane_keys[fl.lane], fl.message_id, after=after)
                task = fl.task
                tokens = served(task, done.get(rid))
                if tokens and isinstance(task, (Task, SpeechTask)):
                    if task.tenant and task.token_cost > 0:
                        # its tenant's counter grows by what it was served (shared/fairshare.py):
                        # in the waiting set or among those served lately, wherever it is
                        fair = keys.fair(task.model, split_source(fl.lane)[0])
                        inc = repr(tokens * task.token_cost)
                        batch.add(b"ZADD", fair.waiting, b"XX", b"INCR", inc, task.tenant, after=after)
                        batch.add(b"ZADD", fair.seen, b"XX", b"INCR", inc, task.tenant, after=after)
                    if task.token_limit and task.token_rate > 0:
                        # the key's token rate limit takes them, into debt if need be
                        # (shared/tokenbucket.py: a forced take)
                        self._token_charges.append(([keys.token_ratelimit(task.token_limit)], bucket_args(
                            task.token_rate, max(1, task.token_burst), tokens, force=True)))
                fl.acking = True
                if tags is not None:
                    tags[i] = (rid, fl, ends.get(rid, "unknown"))
        return channels, rids_by_channel, acked, first_publish

    async def publish(self, out, version: str = "") -> None:
        """One batch for one step: log every event, PUBLISH each connection's events (the
        request's own connection and any that resumed it elsewhere), XACK + XDEL finished
        tasks. The log entries go first, so a gateway that sees a message can already find
        it (and anything before it) in the log.

        Raises:
            BROKER_ERRORS: the batch did not get through; nothing was acknowledged.
        """
        batch = RawBatch()
        channels, rids_by_channel, acked, first_publish = self._build(batch, out, version)
        try:
            results = await batch.execute(self.redis)
        except BaseException:
            for _, fl in acked:
                fl.acking = False
            self._token_charges.clear()  # (built again with the step when it is sent again)
            raise
        self._charge_tokens()
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:
            metrics.redis_errors.labels("publish").inc()
            log.warning("commands of a publish batch failed", failed=len(failed), first=str(failed[0]))
        ends = {ev.request_id: (ev.finish_reason if isinstance(ev, DoneEvent) else "error")
                for _, ev in out.events if isinstance(ev, ENDS)}
        for rid, fl in acked:
            self._finished(rid, fl, ends.get(rid, "unknown"))
        self._check_heard(zip([rids_by_channel[ch] for ch in channels],
                              results[first_publish:first_publish + len(channels)]))

    def _charge_tokens(self) -> None:
        """Charge the token rate limits of the requests that ended (their generated
        tokens) in a round trip of its own, off the step's path; a charge that cannot be
        made is logged and dropped (the key is charged less, never more)."""
        if not self._token_charges:
            return
        calls, self._token_charges = self._token_charges, []

        async def charge() -> None:
            try:
                results = await TOKEN_BUCKET.run(self.redis, calls, partial=True)
            except BROKER_ERRORS as exc:
                results = [exc]
            failed = [r for r in results if isinstance(r, Exception)]
            if failed:
                log.warning("could not charge generated tokens to token rate limits", failed=len(failed),
                            first=str(failed[0]))
        self.spawn(charge())

    def _finished(self, rid: str, fl, outcome: str) -> None:
        self.table.finish(rid, fl)
        metrics.finished.labels(self.model, outcome).inc()
        log.info("task finished", request_id=rid, trace_id=fl.task.trace_id, outcome=outcome)

    async def publish_sharded(self, out, version: str = "") -> None:
        """One step on a Redis Cluster (``out`` None: only what was kept): the commands
        kept from earlier steps first, then this step's, split per shard by the batch.
        What reached its shard is done; what could not (its shard unreachable, or what it
        must follow did not run) is kept, in order, for next time.

        Raises:
            BROKER_ERRORS: no shard could be tried at all (the slot map cannot be read);
                everything is kept.
        """
        batch, tags = self._kept or RawBatch(), self._kept_tags
        self._kept, self._kept_tags = None, {}
        if out is not None:
            self._build(batch, out, version, tags)
        self._charge_tokens()  # (built once: kept commands are sent again, not built again)
        try:
            results = await batch.execute(self.redis, partial=True)
        except BaseException:
            self._kept, self._kept_tags = batch, tags
            raise
        errors = [i for i, r in enumerate(results) if isinstance(r, Exception)]
        kept = [i for i in errors if isinstance(results[i], BROKER_ERRORS)]  # (its shard not reached)
        if len(kept) < len(errors):
            refused = [results[i] for i in errors if not isinstance(results[i], BROKER_ERRORS)]
            metrics.redis_errors.labels("publish").inc()
            log.warning("commands of a publish batch failed", failed=len(refused), first=str(refused[0]))
        not_sent = set(kept)
        answered: list[tuple[set[str], object]] = []  # (requests, receivers) of each publish that went out
        stuck = self._stuck
        now = time.monotonic()
        for i, tag in tags.items():
            if isinstance(tag, tuple):  # an ack: (request id, its InFlight, its outcome)
                if i not in not_sent:
                    if stuck:
                        stuck.pop(tag[0], None)
                    self._finished(*tag)
            elif i in not_sent:  # a publish (the set of its request ids) kept for later
                for rid in tag:
                    stuck.setdefault(rid, now)
            else:
                if stuck:
                    for rid in tag:
                        if stuck.pop(rid, None) is not None:
                            self._recovered[rid] = now
                answered.append((tag, results[i]))
        if kept:
            metrics.redis_errors.labels("publish").inc()
            self._kept = batch.take(kept)
            self._kept_tags = {j: tags[i] for j, i in enumerate(kept) if i in tags}
        if answered:
            self._check_heard(answered)
        if stuck:
            self._give_up_stuck(now)

    def _give_up_stuck(self, now: float) -> None:
        """Cancel the requests whose events have not reached their shard for
        ``redis_failover_s`` (their gateways end them with ``broker_unavailable`` then):
        they stop generating into what is kept."""
        limit = self.settings.redis_failover_s
        for rid, since in list(self._stuck.items()):
            if rid not in self.table:
                self._stuck.pop(rid, None)  # (ended; its end may still be kept)
            elif now - since >= limit:
                self._stuck[rid] = float("inf")  # (once)
                if self.cores.cancel(rid):
                    log.warning("events of a request have not reached its shard; cancelling it", request_id=rid,
                                stuck_s=round(now - since, 2))

    async def announce(self, task: AnyTask, ev: Event) -> None:
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
                   tasks: dict[str, AnyTask] | None = None) -> None:
        """Append events to their request logs (``sf:log:{request_id}``, one
        ``shared.schema.LogEntry`` each) in ``batch``; a token's entry also carries its id,
        for a takeover's replay. A request's end also gives back the API key's stream slot
        it holds (docs/security.md, "Tenants"), whatever became of its client."""
        s = self.settings
        maxlen, ttl = s.log_maxlen, int(s.log_ttl_s)
        ids = token_ids or {}
        for ev in events:
            key = self.keys.log(ev.request_id)
            tid = ids.get((ev.request_id, ev.index)) if isinstance(ev, TokenEvent) else None
            batch.add(b"XADD", key, b"MAXLEN", b"~", maxlen, b"*", *LogEntry(ev, tid).fields())
            if isinstance(ev, _EXPIRE_EACH) or ev.index % 64 == 0:
                batch.add(b"EXPIRE", key, ttl)
            if isinstance(ev, ENDS):  # the request's record lives as long as its log
                batch.add(b"EXPIRE", self.keys.request(ev.request_id), ttl)
                task = (tasks or {}).get(ev.request_id)
                if task is None and (fl := self.table.get(ev.request_id)) is not None:
                    task = fl.task
                if task is not None and task.slot:
                    batch.add(b"ZREM", self.keys.streams(task.slot), ev.request_id)

    def _check_heard(self, answered) -> None:
        """A request whose PUBLISHes reach nobody on any of its channels: its connection
        (or its whole gateway) is gone, or a gateway is re-subscribing after its pub/sub
        socket dropped (it then repairs the gap from the log). First see whether a client
        follows it elsewhere (a resume this worker did not hear of); stop it once nobody
        has listened for ``orphan_grace_s``."""
        heard: set[str] = set()
        unheard: set[str] = set()
        for rids, n in answered:  # (the requests a publish carried, its reply: how many heard it)
            if isinstance(n, BROKER_ERRORS):  # its shard not reached (cluster): no answer either way
                continue
            (heard if n and not isinstance(n, Exception) else unheard).update(rids)
        now = time.monotonic()
        grace = self.settings.orphan_grace_s
        recovered = self._recovered
        for rid in heard:
            self.table.heard(rid)
            if recovered:
                recovered.pop(rid, None)
        for rid in unheard - heard:
            if rid not in self.table:
                recovered.pop(rid, None)
                continue
            since, first = self.table.unheard(rid, now)
            if first and self.table.begin_look_up(rid):  # maybe a resume this worker did not hear of
                self.spawn(self._look_up_followers(rid))
            # its shard just failed over: give its gateways twice the grace to re-subscribe
            if (back := recovered.get(rid)) is not None and now - back < 2 * grace:
                continue
            if now - since >= grace:
                recovered.pop(rid, None)
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
