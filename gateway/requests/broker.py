"""The gateway's side of Redis: enqueue tasks, broadcast cancels, and one pub/sub
reader task per process that routes worker events to connections."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Protocol, cast

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, ResponseError

from streamfleet.gateway.requests.prefixroute import PrefixRouter
from streamfleet.shared import aio
from streamfleet.shared.errors import ErrorCode, RefusedError, UnavailableError
from streamfleet.shared.fairshare import ENQUEUE_LUA, audio_cost, enqueue_call, prompt_cost, token_cost
from streamfleet.shared.keys import affinity_source
from streamfleet.shared.logging import get_logger
from streamfleet.shared.metrics import gateway as metrics
from streamfleet.shared.pubsub import PubSubConnection, ShardSubscriptions, open_pubsub
from streamfleet.shared.redis import BROKER_ERRORS, Coalescer, FleetCluster, RawBatch, connect, read_streams
from streamfleet.shared.schema import (
    AnyTask,
    Attach,
    AudioChunk,
    Cancel,
    Event,
    Follow,
    Heartbeat,
    LogEntry,
    RequestRecord,
    SpeechTask,
    Task,
    decode_events,
    live_workers,
)
from streamfleet.shared.settings import GatewaySettings
from streamfleet.shared.tiers import Tier

__all__ = ["Broker"]

log = get_logger("gateway.broker")

#: log reads of resumed streams one gateway runs at once (the others wait their turn)
REPLAY_READS = 32
#: entries an utterance's audio stream keeps (the gateway appends about one per 100 ms of
#: speech: well over the longest utterance, SF_MAX_UTTERANCE_S)
AUDIO_MAXLEN = 2000
#: seconds of quiet after which the pub/sub connection is PINGed
PUBSUB_PING_S = 5.0
#: what a pub/sub connect, subscribe or ping may fail with (ResponseError: NOAUTH, ACL)
_PUBSUB_ERRORS = (*BROKER_ERRORS, asyncio.TimeoutError, ResponseError)

class Listener(Protocol):
    """What the reader routes a reply channel's traffic to (a ``ReplyChannel``)."""

    def route(self, events: list[Event]) -> None: ...

    def broker_lost(self) -> None: ...

    def resync(self) -> None: ...

class Broker:
    """Redis I/O for one gateway process."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.keys = settings.keys()
        self.gateway_id = uuid.uuid4().hex[:12]
        self._redis: aioredis.Redis | None = None  # ``redis`` once started
        self._pubsub: PubSubConnection | None = None
        self._routes: dict[bytes, Listener] = {}
        self._reader: asyncio.Task[None] | None = None
        self._closing = False
        self.healthy = False
        self._replays = asyncio.Semaphore(REPLAY_READS)
        self.target = settings.redis_target()
        #: a cluster's sharded subscriptions (docs/cluster.md); None on a single server
        self._shards: ShardSubscriptions | None = None

    @property
    def redis(self) -> aioredis.Redis:
        """The command client (``start`` makes it)."""
        if self._redis is None:
            raise UnavailableError("the gateway's broker is not started", retry_after_ms=1000)
        return self._redis

    @property
    def outage_grace_s(self) -> float:
        """How long a stream waits for a log it cannot read (``RequestStream``): a cluster
        shard failing over gets ``SF_REDIS_FAILOVER_S``; a single server's outage ends
        the streams at once (the pub/sub connection reports it)."""
        return self.settings.redis_failover_s if self.target.cluster else 0.0

    @property
    def control_channel(self) -> str:
        return f"{self.keys.prefix}:gateway:{self.gateway_id}"

    async def start(self) -> None:
        s = self.settings
        cluster = self.target.cluster
        self._redis = r = connect(s.redis_url, cluster=cluster, socket_timeout=s.redis_socket_timeout_s,
                                  command_name=f"sf-gateway-{self.gateway_id}-commands")
        self._enqueue = r.register_script(ENQUEUE_LUA)
        self._coalescer = Coalescer(r)
        self.router = PrefixRouter(s, self.keys, r, self._coalescer)
        # blocking log tails (resumed streams) get their own pool, so they never starve the hot path
        self.tail_redis = connect(s.redis_url, cluster=cluster, socket_timeout=s.redis_socket_timeout_s + 2,
                                  max_connections=512)
        if cluster:
            await self._start_shards()
            return
        try:
            # the control channel keeps the pub/sub connection open before any client arrives
            await self._connect_pubsub()
            self.healthy = True
        except _PUBSUB_ERRORS as exc:
            log.warning("redis unreachable at start; will retry", error=str(exc))
        self._reader = asyncio.create_task(self._watch(), name="pubsub-watch")

    async def _start_shards(self) -> None:
        s = self.settings
        self._shards = ShardSubscriptions(
            cast("FleetCluster", self.redis), self.target.node_url, self._on_message, timeout=s.redis_socket_timeout_s,
            client_name=f"sf-gateway-{self.gateway_id}-pubsub", on_restored=self._shards_restored,
            on_lost=self._shards_lost, failover_s=s.redis_failover_s, log=log)
        self._reader = asyncio.create_task(self._shards.run(), name="pubsub-shards")
        control = self.control_channel.encode()
        try:
            # the control channel names this gateway to `streamfleet status` (PUBSUB SHARDCHANNELS)
            await self._shards.subscribe(control)
            self.healthy = True
        except Exception as exc:
            log.warning("redis cluster unreachable at start; will retry", error=str(exc))
            self._shards.keep(control)  # healthy once it is subscribed (``_shards_restored``)

    def _shards_restored(self, channels: list[bytes]) -> None:
        if not self.healthy and self.control_channel.encode() in channels:
            self.healthy = True
            log.info("redis cluster reachable")
        self._tell(channels, "resync")

    def _shards_lost(self, channels: list[bytes]) -> None:
        metrics.redis_errors.labels("pubsub").inc()
        self._tell(channels, "broker_lost")

    def _tell(self, channels: list[bytes], what: str) -> None:
        """Call ``resync`` or ``broker_lost`` on the listeners of ``channels``."""
        for ch in channels:
            listener = self._routes.get(ch)
            if listener is not None:
                try:
                    getattr(listener, what)()
                except Exception:
                    log.exception("listener failed", handler=what)

    async def stop(self) -> None:
        self._closing = True
        if self._shards is not None:
            self._shards.close()
        if self._reader:
            await aio.cancel_and_wait(self._reader)
        if self._pubsub is not None:
            self._pubsub.close()
        if self._redis is not None:
            await self._redis.aclose()
            await self.tail_redis.aclose()

    # -- connections --------------------------------------------------------------
    async def register(self, connection_id: str, listener: Listener) -> None:
        """Route events of ``sf:reply:{connection_id}`` to ``listener`` (subscribes, and
        returns once Redis acknowledged the subscription).

        Raises:
            UnavailableError: Redis is unreachable.
        """
        if not self.healthy or (self._pubsub is None and self._shards is None):
            raise UnavailableError("message broker unavailable; retry shortly", retry_after_ms=1000)
        channel = self.keys.reply(connection_id)
        self._routes[channel.encode()] = listener
        try:
            if self._shards is not None:
                await self._shards.subscribe(channel.encode())
            else:
                assert self._pubsub is not None  # (started)
                await self._pubsub.subscribe(channel, timeout=self.settings.redis_socket_timeout_s)
        except _PUBSUB_ERRORS as exc:
            self._routes.pop(channel.encode(), None)
            raise UnavailableError(f"message broker unavailable: {exc}", retry_after_ms=1000) from exc

    async def unregister(self, connection_id: str) -> None:
        channel = self.keys.reply(connection_id)
        self._routes.pop(channel.encode(), None)
        if self._shards is not None:
            self._shards.unsubscribe(channel.encode())
        elif self._pubsub is not None:
            self._pubsub.unsubscribe(channel)  # the subscription dies with the connection anyway

    # -- the pub/sub connection -------------------------------------------------------
    def _on_message(self, channel: bytes, data: bytes) -> None:
        """Runs inside the pub/sub socket's ``data_received``, once per message."""
        listener = self._routes.get(channel)
        if listener is None:
            return
        try:
            events = decode_events(data)
        except ValueError as exc:
            log.warning("dropping malformed event message", error=str(exc))
            return
        try:
            listener.route(events)
        except Exception:
            log.exception("event routing failed")

    async def _connect_pubsub(self) -> None:
        """A fresh pub/sub connection with every current subscription."""
        timeout = self.settings.redis_socket_timeout_s
        conn = await open_pubsub(self.settings.redis_url, self._on_message, timeout=timeout,
                                 client_name=f"sf-gateway-{self.gateway_id}-pubsub")
        try:
            await conn.subscribe(self.control_channel, *self._routes, timeout=timeout)
        except BaseException:
            conn.close()
            raise
        old, self._pubsub = self._pubsub, conn
        if old is not None:
            old.close()

    def _resync_all(self) -> None:
        for listener in list(self._routes.values()):
            try:
                listener.resync()
            except Exception:
                log.exception("resync handler failed")

    async def _recover_at_once(self) -> bool:
        """A dropped pub/sub socket while Redis still answers (a timeout under load, a
        proxy reset, an output-buffer limit): resubscribe at once and let every stream
        re-read its log for what was published meanwhile, instead of failing them all."""
        try:
            await asyncio.wait_for(self._connect_pubsub(), 2.0)
        except _PUBSUB_ERRORS:
            return False
        log.info("pub/sub connection restored", channels=len(self._routes) + 1)
        self._resync_all()
        return True

    async def _watch(self) -> None:
        """Keep the pub/sub connection alive: PING it when quiet (a dead peer that sent no
        FIN is found within ``PUBSUB_PING_S`` + the socket timeout), replace it when it
        drops, and when Redis is really gone end every request in flight at once rather
        than let it hang, then reconnect with backoff."""
        backoff = 0.05
        while not self._closing:
            conn = self._pubsub
            error: BaseException | None
            if self.healthy and conn is not None and conn.is_open:
                done, _ = await asyncio.wait({conn.lost}, timeout=PUBSUB_PING_S)
                if not done:
                    try:
                        await conn.ping(self.settings.redis_socket_timeout_s)
                        continue
                    except _PUBSUB_ERRORS as exc:
                        error = exc
                        conn.close()
                else:
                    error = conn.lost.result()
                metrics.redis_errors.labels("pubsub").inc()
                log.warning("pub/sub connection lost; reconnecting", error=str(error))
                if await self._recover_at_once():
                    backoff = 0.05
                    continue
                self.healthy = False
                for listener in list(self._routes.values()):
                    try:
                        listener.broker_lost()
                    except Exception:
                        log.exception("broker_lost handler failed")
                continue
            try:
                await self._connect_pubsub()
            except _PUBSUB_ERRORS as exc:
                log.debug("pub/sub reconnect failed", error=str(exc), retry_in_s=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            was_healthy, self.healthy = self.healthy, True
            backoff = 0.05
            log.info("pub/sub connection restored", channels=len(self._routes) + 1)
            if not was_healthy:
                self._resync_all()

    # -- tasks --------------------------------------------------------------------
    def lane_threshold(self, lane: str) -> int:
        """Backlog at which a lane refuses new work (``overload_fraction`` of its capacity)."""
        cap = self.settings.lane_capacity.get(lane, 0)
        return max(1, int(cap * self.settings.overload_fraction)) if cap > 0 else 0

    async def submit(self, task: AnyTask, owner: str = "", tenant: str = "", tier: Tier | None = None) -> int:
        """Enqueue the task on its lane unless the lane is overloaded; returns the lane's
        depth (queued + in flight) after the add.

        With fair share on (``fair_share``) and a ``tenant``, the task waits for its
        tenant's turn (shared/fairshare.py), charged by its prompt tokens and, for text,
        its generated tokens, each divided by the ``share`` of the tenant's ``tier`` (1
        without one); refused when the tenant already has the tier's ``max_queued_tokens``
        prompt tokens waiting in the lane.

        A text task whose prompt's first blocks a live worker holds in its prefix cache
        goes to that worker's affinity stream of the lane instead (``PrefixRouter``,
        docs/architecture.md, "Prefix-aware routing"), under the same threshold: the
        lane's backlog counts its affinity streams too.

        The request's record (``sf:req:{request_id}``: owner, reply channel, deadline)
        travels in the same round trip, ahead of the task, so the request can be resumed
        from the moment it is accepted, also while it waits for a worker.

        Raises:
            RefusedError: ``overloaded`` — the lane's backlog is at its threshold.
            UnavailableError: Redis is unreachable.
        """
        keys = self.keys
        worker = await self.router.route(task) if self.router.applies(task) else None
        if worker is None:
            lane_key, source = keys.lane(task.model, task.lane), task.lane
        else:
            lane_key, source = keys.affinity(task.model, task.lane, worker), affinity_source(task.lane, worker)
        others = self.router.counted(task.model, task.lane, lane_key)  # the lane's other streams
        threshold = self.lane_threshold(task.lane)
        now = time.time()
        deadline = task.deadline or (now + self.settings.request_timeout_s)
        record = RequestRecord(task.request_id, owner, task.model, task.reply_to, task.created_at, deadline,
                               task.prompt_tokens)
        # the worker extends this TTL when the request ends, like its log's
        ttl_ms = int((max(0.0, deadline - now) + self.settings.log_ttl_s) * 1000)
        fair_on = self.settings.fair_share and bool(tenant)
        share = tier.share if tier is not None else 1.0
        max_queued_tokens = tier.max_queued_tokens if tier is not None else None
        if fair_on and isinstance(task, Task):
            task.tenant, task.token_cost = tenant, token_cost(share)
        elif fair_on and isinstance(task, SpeechTask):  # charged its audio when it ends
            task.tenant, task.token_cost = tenant, audio_cost(share)
        script_keys, args = enqueue_call(
            keys, task.model, task.lane, lane_key, others, threshold=threshold, task=task.encode(), source=source,
            tenant=tenant if fair_on else "", cost=prompt_cost(task.prompt_tokens, share),
            window=self.settings.fair_window, ttl_s=self.settings.fair_ttl_s, tokens=task.prompt_tokens,
            max_queued_tokens=max_queued_tokens, routed_window=self.settings.fair_routed_window)
        ok = False
        try:
            # both go out with the other requests of this loop turn (shared.redis.Coalescer)
            record_set = self._coalescer.send(b"SET", keys.request(task.request_id), record.encode(),
                                              b"PX", ttl_ms)
            try:
                ok, depth = await self._coalescer.call(b"EVALSHA", self._enqueue.sha, len(script_keys), *script_keys,
                                                       *args)
            except NoScriptError:  # a restarted or flushed Redis: the wrapper loads it again
                ok, depth = await self._enqueue(keys=list(script_keys), args=list(args))
        except BROKER_ERRORS as exc:
            metrics.redis_errors.labels("enqueue").inc()
            raise UnavailableError(f"message broker unavailable: {exc}", retry_after_ms=1000) from exc
        finally:
            if record_set.done() and not record_set.cancelled():
                record_set.exception()  # a failure shows in the enqueue's own result
            if worker is not None:  # the next routing choices count it in the stream's length
                self.router.enqueued(worker, task, bool(ok))
        if ok == 2:
            raise RefusedError(
                f"this key already has {depth} prompt tokens waiting for their turn in the {task.lane} lane of "
                f"{task.model} (its tier's max_queued_tokens is {max_queued_tokens}); retry shortly",
                code=ErrorCode.too_many_requests, retry_after_ms=self.settings.overload_retry_after_ms)
        if not ok:
            raise RefusedError(
                f"the {task.lane} lane of {task.model} is overloaded ({depth} requests queued or running, "
                f"limit {threshold}); retry shortly",
                code=ErrorCode.overloaded, retry_after_ms=self.settings.overload_retry_after_ms)
        return int(depth)

    async def append_audio(self, request_id: str, model: str, chunks: list[AudioChunk], ttl_s: float) -> None:
        """Append to an utterance's audio stream ``sf:audio:{request_id}``, capped at
        ``AUDIO_MAXLEN`` entries and expiring ``ttl_s`` after the last append (the
        worker transcribing it, or one taking it over, reads it from the start).

        Raises:
            UnavailableError: Redis is unreachable, or refused the append (out of memory).
        """
        key = self.keys.audio(request_id, model)
        # through the coalescer: every utterance's append of this loop turn goes out in one
        # batch on one connection (hundreds of utterances would otherwise each hold a pooled
        # connection for a round trip, and wait for one when the pool runs dry)
        replies = [self._coalescer.send(b"XADD", key, b"MAXLEN", b"~", AUDIO_MAXLEN, b"*",
                                        *(x for pair in chunk.fields().items() for x in pair))
                   for chunk in chunks]
        replies.append(self._coalescer.send(b"EXPIRE", key, max(1, int(ttl_s))))
        try:
            for reply in await asyncio.gather(*replies, return_exceptions=True):
                if isinstance(reply, BaseException):  # an error reply (OOM) or a lost connection
                    raise reply
        except (*BROKER_ERRORS, ResponseError) as exc:
            metrics.redis_errors.labels("audio").inc()
            raise UnavailableError(f"message broker unavailable: {exc}", retry_after_ms=1000) from exc

    async def cancel(self, request_id: str, model: str, reason: str = "client") -> None:
        """Tell the workers of ``model`` to stop the request (one of them runs it)."""
        try:
            await self._coalescer.call(self.keys.publish, self.keys.cancel(model), Cancel(request_id, reason).encode())
        except (*BROKER_ERRORS, ResponseError) as exc:
            log.warning("cancel not delivered", request_id=request_id, error=str(exc))

    def active_streams(self) -> int:
        return sum(len(getattr(listener, "streams", ())) for listener in self._routes.values())

    # -- request logs (resume, gap repair) ---------------------------------------------
    async def read_log(self, request_id: str, after: bytes = b"0-0", block_ms: int | None = None, *,
                       replay: bool = False) -> list[tuple[bytes, Event]]:
        """Events of ``sf:log:{request_id}`` after entry ``after`` (blocking up to
        ``block_ms`` for new ones when given).

        Args:
            replay: a resumed stream's read: it goes through the separate pool, at most
                ``REPLAY_READS`` at once per gateway, so a flood of resumes queues behind
                itself and never takes the connections new requests and live streams use.

        Raises:
            UnavailableError: Redis is unreachable.
        """
        if replay:
            async with self._replays:
                return await self._read_log(self.tail_redis, request_id, after, block_ms)
        return await self._read_log(self.redis if block_ms is None else self.tail_redis, request_id, after,
                                    block_ms)

    async def _read_log(self, client: aioredis.Redis, request_id: str, after: bytes, block_ms: int | None,
                        ) -> list[tuple[bytes, Event]]:
        try:
            res = await client.xread({self.keys.log(request_id): after}, count=1000, block=block_ms)
        except BROKER_ERRORS as exc:
            raise UnavailableError(f"message broker unavailable: {exc}", retry_after_ms=1000) from exc
        except Exception as exc:
            # redis-py's cluster client, racing a node that dies under it, can fail with an
            # AttributeError or (uvloop) RuntimeError: an outage all the same, which the stream
            # rides out or reports; it must never end the connection
            log.warning("log read failed", request_id=request_id, error=f"{type(exc).__name__}: {exc}")
            raise UnavailableError(f"message broker unavailable: {exc}", retry_after_ms=1000) from exc
        out: list[tuple[bytes, Event]] = []
        for _key, entries in read_streams(res):
            for entry_id, fields in entries:
                if fields is None:  # (an entry deleted since: a log's entries are not)
                    continue
                try:
                    out.append((entry_id, LogEntry.decode(fields).event))
                except ValueError:
                    continue
        return out

    async def read_request(self, request_id: str) -> RequestRecord | None:
        """The request's record, or None when there is none (unknown id, or expired).

        Raises:
            UnavailableError: Redis is unreachable.
        """
        try:
            raw = await self.redis.get(self.keys.request(request_id))
        except BROKER_ERRORS as exc:
            raise UnavailableError(f"message broker unavailable: {exc}", retry_after_ms=1000) from exc
        if raw is None:
            return None
        try:
            return RequestRecord.decode(raw)
        except ValueError:
            log.warning("unreadable request record", request_id=request_id)
            return None

    async def follow(self, request_id: str, model: str, connection_id: str, ttl_s: float,
                     announce: bool = True) -> None:
        """Note that ``connection_id`` follows ``request_id`` (a resume), for ``ttl_s``
        unless renewed, and tell the workers, so the one running it publishes its events
        there too and keeps it running while anyone listens.

        Raises:
            UnavailableError: Redis is unreachable.
        """
        key = self.keys.attach(request_id)
        now_ms = int(time.time() * 1000)
        batch = RawBatch()
        for member, score in Attach(connection_id, now_ms + int(ttl_s * 1000)).encode().items():
            batch.add(b"ZADD", key, score, member)
        batch.add(b"ZREMRANGEBYSCORE", key, b"-inf", now_ms)
        batch.add(b"PEXPIRE", key, int(ttl_s * 1000))
        if announce:  # after the set is written: a worker that hears it reads the set
            batch.add(self.keys.publish, self.keys.follow(model), Follow(request_id, connection_id).encode(),
                      after=(key,))
        try:
            results = await batch.execute(self.redis)
        except BROKER_ERRORS as exc:
            raise UnavailableError(f"message broker unavailable: {exc}", retry_after_ms=1000) from exc
        failed = next((r for r in results if isinstance(r, Exception)), None)
        if failed is not None:
            raise UnavailableError(f"message broker unavailable: {failed}", retry_after_ms=1000)

    async def unfollow(self, request_id: str, connection_id: str) -> None:
        try:
            await self.redis.zrem(self.keys.attach(request_id), connection_id)
        except BROKER_ERRORS:
            pass  # the entry expires by itself

    async def followed_elsewhere(self, request_id: str, connection_id: str) -> bool:
        """Whether a connection other than ``connection_id`` follows the request now."""
        try:
            members = await self.redis.zrangebyscore(self.keys.attach(request_id),
                                                     *Attach.live_range(int(time.time() * 1000)))
        except BROKER_ERRORS:
            return True  # cannot tell: do not cancel what someone may be following
        return bool(Attach.decode_members(cast("list[bytes | str]", members)) - {connection_id})

    # -- fleet state ----------------------------------------------------------------
    async def ping(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except BROKER_ERRORS:
            return False

    async def live_workers(self, model: str) -> list[Heartbeat]:
        """Workers of ``model`` whose heartbeat is fresh."""
        raw = await self.redis.hgetall(self.keys.workers(model))
        return live_workers(cast("dict[bytes, bytes]", raw), self.settings.worker_ttl_s, time.time())
