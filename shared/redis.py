"""Redis connection helpers shared by gateway and workers."""

from __future__ import annotations

import asyncio
import math
import time
from collections import defaultdict
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import Connection
from redis.asyncio.retry import Retry  # (the asyncio clients' own: the sync one is converted, with a warning)
from redis.backoff import ExponentialBackoff
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ConnectionError as RedisConnectionError,
    MovedError,
    NoScriptError,
    RedisClusterException,
    ResponseError,
    SlotNotCoveredError,
    TimeoutError as RedisTimeoutError,
    TryAgainError,
)

from streamfleet.shared.command_socket import close_command_link, command_link
from streamfleet.shared.resp import pack, slot_of

__all__ = ["connect", "sync_client", "SyncRedis", "RedisTarget", "FleetCluster", "BROKER_ERRORS", "pack", "RawBatch",
           "RawScript", "Coalescer", "refresh_members", "slot_of", "StreamEntry", "ClaimedEntry", "Pending",
           "ConsumerInfo", "as_bytes", "as_str", "stream_entries", "claimed_entries", "autoclaimed_entries",
           "pending_entries", "consumer_infos", "raw_entries", "raw_streams", "read_streams"]

#: exceptions meaning "the broker is not reachable right now" (a cluster whose slot map
#: cannot be read, or whose slot has no live primary during a failover, included)
BROKER_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError, ClusterDownError, SlotNotCoveredError,
                 RedisClusterException)


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """Where the fleet's Redis is: one server, or the seed nodes of a Redis Cluster.

    ``SF_REDIS_URL`` names one server (``redis://host:6379/0``); for a cluster it names
    one or more seed nodes, comma separated (``redis://:pw@h1:7000,h2:7000,h3:7000``),
    and ``SF_REDIS_CLUSTER=true`` says so (a URL listing several hosts implies it).
    Credentials, TLS (``rediss://``) and query options apply to every node.
    """

    url: str
    cluster: bool
    seeds: tuple[tuple[str, int], ...]

    @classmethod
    def parse(cls, url: str, cluster: bool = False) -> RedisTarget:
        parts = urlsplit(url)
        netloc = parts.netloc
        _, _, hosts = netloc.rpartition("@")
        seeds = []
        for entry in filter(None, (h.strip() for h in hosts.split(","))):
            host, sep, port = entry.rpartition(":") if not entry.endswith("]") else (entry, "", "")
            if not sep:
                host, port = entry, "6379"
            try:
                seeds.append((host.strip("[]") or "127.0.0.1", int(port)))
            except ValueError:
                raise ValueError(f"SF_REDIS_URL: {entry!r} is not host:port") from None
        if len(seeds) > 1:
            cluster = True
        if cluster:
            db = parts.path.strip("/")
            if db not in ("", "0"):
                raise ValueError(f"SF_REDIS_URL: a Redis Cluster has only database 0, not {db!r}")
            if parts.scheme == "unix":
                raise ValueError("SF_REDIS_URL: a Redis Cluster is reached over TCP, not a unix socket")
        return cls(url, cluster, tuple(seeds))

    def node_url(self, host: str, port: int) -> str:
        """The configured URL (credentials, TLS, options) pointed at one node."""
        parts = urlsplit(self.url)
        userinfo, at, _ = parts.netloc.rpartition("@")
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return urlunsplit((parts.scheme, f"{userinfo}{at}{where}", parts.path, parts.query, parts.fragment))

    @property
    def first_url(self) -> str:
        """A URL of one server: the configured one, or the first seed's."""
        if not self.cluster or not self.seeds:
            return self.url
        return self.node_url(*self.seeds[0])


#: seconds between slot-map refreshes forced by failed nodes
REFRESH_EVERY_S = 0.25
#: seconds between the first tries at a node found unreachable (``FleetCluster.unreachable``),
#: doubling up to ``PROBE_MAX_S``
PROBE_FIRST_S = 0.05
PROBE_MAX_S = 0.5


class FleetCluster(RedisCluster):
    """``redis.asyncio.RedisCluster`` whose slot map is also used by the fleet's own
    batches and sharded subscriptions: a failed node marks it ``stale``, and ``ready``
    reloads it at most every ``REFRESH_EVERY_S``, in the background once a map is
    loaded (a batch never waits for a refresh, which may try a dead node first).

    A node a ``RawBatch`` could not reach is *unreachable* (``unreachable``) until a
    probe in the background connects to it again: meanwhile the batches that may go
    without it (``partial``) fail its commands at once instead of trying it, so that a
    dead primary costs the others nothing (a connection attempt to it waits out
    redis-py's connect retries). Its slots' new primary, after a failover, is another
    node and is tried as soon as the refreshed map names it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refresh_due = False
        self.refreshed_at = 0.0
        self._refreshing: asyncio.Future[None] | None = None
        #: node name -> (the error it failed with, the probe that clears it)
        self._unreachable: dict[str, tuple[Exception, asyncio.Task[None]]] = {}
        #: a node answered CLUSTERDOWN (a primary failed and ``cluster-require-full-coverage``
        #: is on: every shard refuses key commands until its replica is elected) and none
        #: has answered a key command since
        self.down = False

    def stale(self, at_once: bool = False) -> None:
        """A node failed or redirected: reload the slot map before the next use
        (``at_once``: without waiting out ``REFRESH_EVERY_S``)."""
        self.refresh_due = True
        if at_once:
            self.refreshed_at = 0.0

    async def ready(self) -> None:
        """Load the slot map (first use), or reload it when it was marked stale (in the
        background when there is a map to go on with)."""
        if not self.nodes_manager.slots_cache:
            if self._initialize:
                await self.initialize()
            elif self.refresh_due:
                self.refresh_due = False
                self.refreshed_at = time.monotonic()
                await self._refresh()
        # (redis-py asks for a refresh after its own commands failed, ``_initialize``, and
        # paces it by its retry policy; a failover's new primary is looked for here at once)
        elif (self.refresh_due or self._initialize) and time.monotonic() - self.refreshed_at >= REFRESH_EVERY_S:
            self.refresh_due = False
            self.refreshed_at = time.monotonic()
            self._in_background(self._refresh())

    def _in_background(self, coro: Coroutine[Any, Any, None]) -> None:
        if self._refreshing is not None and not self._refreshing.done():
            coro.close()  # one refresh at a time: the one under way answers this call too
            return
        self._refreshing = asyncio.ensure_future(coro)

    async def _refresh(self) -> None:
        try:
            await self.nodes_manager.initialize()
        except BROKER_ERRORS:
            self.refresh_due = True

    async def _determine_slot(self, command: str, *args: Any) -> int:
        """The slot of a command. ``XREAD``/``XREADGROUP`` (the gateway's log reads, an
        idle worker's wait on its lanes) by their first stream, here: redis-py asks a
        node for the keys of a command with movable keys (``COMMAND GETKEYS``) and always
        the same one, so with that node dead every such read failed, whatever shard its
        stream lives on, until the node came back."""
        if isinstance(command, (str, bytes)) and command.upper() in (b"XREAD", b"XREADGROUP", "XREAD",
                                                                     "XREADGROUP"):
            key = _route_key((command, *args))
            if key is not None:
                return slot_of(key)
        return await super()._determine_slot(command, *args)

    def unreachable(self, name: str) -> Exception | None:
        """The error a node failed with while it is unreachable, else None."""
        entry = self._unreachable.get(name)
        return entry[0] if entry is not None else None

    def mark_unreachable(self, node: ClusterNode, error: Exception) -> None:
        """``node`` could not be reached: skip it (``RawBatch``, ``partial``) until a probe
        connects to it again, and reload the slot map meanwhile."""
        self.stale()
        if node.name not in self._unreachable:
            self._unreachable[node.name] = (error, asyncio.ensure_future(self._probe(node)))

    async def _probe(self, node: ClusterNode) -> None:
        """Try to connect to ``node`` (TCP), sooner at first, until it accepts."""
        delay = PROBE_FIRST_S
        limit = min(float(self.connection_kwargs.get("socket_connect_timeout") or 1.0), 1.0)
        try:
            while True:
                await asyncio.sleep(delay)
                try:
                    async with asyncio.timeout(limit):
                        _, writer = await asyncio.open_connection(node.host, node.port)
                    writer.close()
                    return
                except (OSError, TimeoutError):
                    delay = min(delay * 2, PROBE_MAX_S)
                    self.stale()
        finally:
            self._unreachable.pop(node.name, None)

    async def aclose(self) -> None:
        for task in [self._refreshing, *(t for _, t in self._unreachable.values())]:
            if task is not None:
                task.cancel()
        self._unreachable.clear()
        await super().aclose()


def _cluster_kwargs(target: RedisTarget, socket_timeout: float | None) -> dict[str, Any]:
    from redis.asyncio.connection import parse_url

    params: dict[str, Any] = dict(parse_url(target.first_url))
    kw: dict[str, Any] = {"username": params.get("username"), "password": params.get("password"),
                          "decode_responses": False, "socket_timeout": socket_timeout,
                          "socket_connect_timeout": socket_timeout}
    conn_class = params.get("connection_class")
    if conn_class is not None and "SSL" in conn_class.__name__:
        kw["ssl"] = True
        for k in ("ssl_ca_certs", "ssl_cert_reqs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname"):
            if k in params:
                kw[k] = params[k]
    return kw


class FleetRedis(aioredis.Redis):
    """redis-py's client, whose ``aclose`` also closes the pipelined socket ``RawBatch``
    sends on (``shared.command_socket.CommandLink``)."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        close_command_link(self)
        await super().aclose(close_connection_pool)


def connect(url: str, *, cluster: bool = False, socket_timeout: float | None = 5.0,
            max_connections: int = 64, command_name: str | None = None) -> aioredis.Redis:
    """An asyncio client returning bytes, with bounded retries and timeouts.

    With ``cluster`` (or a URL listing several seed nodes) it is a ``FleetCluster``:
    commands go to the primary owning their key's slot, and ``max_connections`` is per
    node (docs/cluster.md).

    The pool blocks (up to the socket timeout) when all ``max_connections`` are busy,
    so a burst of requests queues for a connection instead of failing.

    Blocking commands (XREADGROUP BLOCK, pub/sub reads) must use a per-call timeout
    that exceeds their block time; the socket timeout guards everything else.

    ``command_name``: the name (``CLIENT LIST``) of the socket ``RawBatch`` sends on.
    """
    target = RedisTarget.parse(url, cluster)
    if target.cluster:
        # the cluster client answers the same commands (docs/cluster.md); callers take it as one
        return FleetCluster(startup_nodes=[ClusterNode(h, p) for h, p in target.seeds],
                            max_connections=max_connections, health_check_interval=15,
                            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=3),
                            **_cluster_kwargs(target, socket_timeout))  # type: ignore[return-value]
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        timeout=socket_timeout,  # wait this long for a free pooled connection, then fail
        decode_responses=False,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_timeout,
        health_check_interval=15,
        # a refused or reset connection is retried on a fresh one; a timeout is not: the
        # command may have run (an XADD twice is a task run twice), and the socket timeout
        # is the bound on how long a Redis stall is ridden out (docs/failures.md)
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=2, supported_errors=(RedisConnectionError,)),
        retry_on_error=[RedisConnectionError],
        max_connections=max_connections,
    )
    pool._sf_command_name = command_name  # type: ignore[attr-defined]  # read by shared.command_socket
    return FleetRedis.from_pool(pool)  # the client closes the pool it owns


#: what ``sync_client`` returns: either answers the commands the command-line tools send
SyncRedis = redis.Redis | redis.RedisCluster


def sync_client(url: str, *, cluster: bool = False, socket_timeout: float | None = 5.0) -> SyncRedis:
    """A synchronous client (the command-line tools): ``redis.Redis``, or
    ``redis.RedisCluster`` in cluster mode."""
    target = RedisTarget.parse(url, cluster)
    if not target.cluster:
        return redis.Redis.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout)
    from redis.cluster import ClusterNode as SyncNode

    return redis.RedisCluster(startup_nodes=[SyncNode(h, p) for h, p in target.seeds],  # type: ignore[no-untyped-call]
                              **_cluster_kwargs(target, socket_timeout))


async def refresh_members(redis: aioredis.Redis, members: list[tuple[str, str]], expiry_ms: int,
                          ttl_ms: int) -> None:
    """Push the score (an expiry, unix ms) of ``(sorted set, member)`` pairs to
    ``expiry_ms`` where the member is still there (``ZADD XX``: a lapsed one is not
    revived), and each set's TTL to ``ttl_ms``; one round trip. The stream and connection
    slots of API keys are such sets (gateway/admission/ratelimit.py, workers/heartbeat.py).

    Raises:
        BROKER_ERRORS: Redis is unreachable.
    """
    if not members:
        return
    async with redis.pipeline(transaction=False) as pipe:
        for key, member in members:
            pipe.zadd(key, {member: expiry_ms}, xx=True)
            pipe.pexpire(key, ttl_ms)
        await pipe.execute()


# -- redis-py's replies, typed ------------------------------------------------------------
# redis-py types its stream replies loosely (bytes or str, fields that may be None): the
# fleet's clients return bytes (``connect``, ``sync_client``), and these read a reply into
# the types the callers use, in one place.

#: a stream entry as XRANGE, XREAD and XREADGROUP return it: (entry id, field map)
StreamEntry = tuple[bytes, dict[bytes, bytes]]
#: ... as XCLAIM and XAUTOCLAIM return it: the fields are None for an entry deleted while
#: it was pending
ClaimedEntry = tuple[bytes, dict[bytes, bytes] | None]


@dataclass(frozen=True, slots=True)
class Pending:
    """One row of ``XPENDING <key> <group> <start> <end> <count> [consumer]``."""

    message_id: bytes
    consumer: bytes
    idle_ms: int
    times_delivered: int


@dataclass(frozen=True, slots=True)
class ConsumerInfo:
    """One consumer of ``XINFO CONSUMERS <key> <group>``: its name and how many
    deliveries it holds."""

    name: str
    pending: int


def as_bytes(value: object) -> bytes:
    """A reply's string as bytes (a str, from a client that decodes, is encoded)."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    raise TypeError(f"expected a Redis string reply, not {type(value).__name__}")


def as_str(value: object) -> str:
    """A reply's string as str."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _field_map(fields: Mapping[bytes | str, bytes | str]) -> dict[bytes, bytes]:
    if isinstance(fields, dict) and all(isinstance(k, bytes) and isinstance(v, bytes) for k, v in fields.items()):
        return cast("dict[bytes, bytes]", fields)  # (the common case, checked just above: no copy)
    return {as_bytes(k): as_bytes(v) for k, v in fields.items()}


def stream_entries(reply: Iterable[tuple[bytes | str | None, Mapping[bytes | str, bytes | str] | None]] | None,
                   ) -> list[StreamEntry]:
    """The entries of an ``XRANGE``/``XREVRANGE`` reply (or one stream's of ``XREAD``);
    none for a missing reply. (A nil entry, which redis-py reads as ``(None, None)``,
    names nothing and is left out.)"""
    return [(as_bytes(mid), _field_map(fields) if fields is not None else {}) for mid, fields in reply or ()
            if mid is not None]


def claimed_entries(reply: Iterable[object] | None) -> list[ClaimedEntry]:
    """The entries of an ``XCLAIM`` reply (not ``JUSTID``), or the entry list (the second
    item) of an ``XAUTOCLAIM`` reply; an entry deleted while pending has no fields. (A
    nil entry, which redis-py reads as ``(None, None)``, names nothing and is left out.)"""
    out: list[ClaimedEntry] = []
    for entry in reply or ():
        if not isinstance(entry, (tuple, list)) or len(entry) != 2:
            raise TypeError(f"expected a stream entry, not {entry!r}")
        mid, fields = entry
        if mid is not None:
            out.append((as_bytes(mid), _field_map(fields) if fields is not None else None))
    return out


def autoclaimed_entries(reply: Sequence[object] | None) -> list[ClaimedEntry]:
    """The claimed entries of an ``XAUTOCLAIM`` reply (``[next id, entries, ...]``)."""
    if not reply:
        return []
    entries = reply[1]
    if not isinstance(entries, (list, tuple)):
        raise TypeError(f"expected XAUTOCLAIM's entries, not {entries!r}")
    return claimed_entries(entries)


def raw_entries(items: object) -> list[StreamEntry]:
    """One stream's entries as a raw ``XREADGROUP`` reply (or a script) has them
    (``[id, [field, value, ...]]``; no fields for an entry deleted since it was
    delivered) as ``(id, fields)``."""
    if not items:
        return []
    if not isinstance(items, list):
        raise TypeError(f"expected a list of stream entries, not {items!r}")
    return [(mid, dict(zip(flat[::2], flat[1::2])) if flat else {}) for mid, flat in items]


def raw_streams(reply: object) -> list[tuple[bytes, list[StreamEntry]]]:
    """A raw ``XREAD``/``XREADGROUP`` reply, per stream: RESP2 ``[[stream, entries]]``,
    RESP3 ``{stream: entries}``; none for a nil reply (nothing came)."""
    if not reply:
        return []
    pairs = reply.items() if isinstance(reply, dict) else reply
    if not isinstance(pairs, Iterable):
        raise TypeError(f"expected a stream read reply, not {reply!r}")
    return [(as_bytes(key), raw_entries(items)) for key, items in pairs]


def read_streams(reply: object) -> list[tuple[bytes, list[ClaimedEntry]]]:
    """An ``XREAD``/``XREADGROUP`` reply as redis-py parses it, per stream (RESP2
    ``[[stream, entries]]``, or a dict of stream -> entries); an entry deleted since it
    was delivered has no fields."""
    if not reply:
        return []
    pairs = reply.items() if isinstance(reply, dict) else reply
    if not isinstance(pairs, Iterable):
        raise TypeError(f"expected a stream read reply, not {reply!r}")
    return [(as_bytes(key), claimed_entries(items)) for key, items in pairs]


def pending_entries(reply: Iterable[Mapping[str, object]] | None) -> list[Pending]:
    """The rows of an ``XPENDING`` reply with a range (redis-py's dicts)."""
    return [Pending(as_bytes(row["message_id"]), as_bytes(row["consumer"]), _int(row["time_since_delivered"]),
                    _int(row["times_delivered"])) for row in reply or ()]


def consumer_infos(reply: Iterable[Mapping[str, object]] | None) -> list[ConsumerInfo]:
    """The consumers of an ``XINFO CONSUMERS`` reply (redis-py's dicts)."""
    return [ConsumerInfo(as_str(row["name"]), _int(row.get("pending") or 0)) for row in reply or ()]


def _int(value: object) -> int:
    if isinstance(value, (int, str, bytes)):
        return int(value)
    raise TypeError(f"expected an integer reply, not {value!r}")


#: a cluster command redirected (MOVED, ASK, TRYAGAIN) this often in one batch fails
MAX_REDIRECTS = 5


def _route_key(args: tuple[Any, ...]) -> bytes | str | None:
    """The key (or sharded channel) a command is routed by in a cluster: its first
    argument, for EVAL/EVALSHA its first key, for XREAD/XREADGROUP its first stream."""
    name = args[0]
    key: bytes | str | None = args[1] if len(args) > 1 else None
    if name in (b"EVALSHA", b"EVAL", "EVALSHA", "EVAL"):
        key = args[3] if int(args[2]) > 0 else None
    elif name in (b"XREADGROUP", b"XREAD", "XREADGROUP", "XREAD"):  # the first stream after STREAMS
        for i, a in enumerate(args):
            if a in (b"STREAMS", "STREAMS"):
                key = args[i + 1]
                break
    return key


async def _read_replies(conn: Connection, n: int) -> list[Any]:
    """``n`` replies from ``conn`` (an error reply as its ``ResponseError``), all within the
    connection's socket timeout. redis-py's ``read_response`` would arm and cancel a
    timeout of its own for every reply — a timer per token in a step's publish batch, a
    large share of a worker's CPU — so the batch is read under one.

    Raises:
        redis.exceptions.TimeoutError: the replies did not all come within the timeout.
    """
    out = []
    try:
        async with asyncio.timeout(conn.socket_timeout):
            for _ in range(n):
                try:
                    out.append(await conn.read_response(timeout=math.inf))
                except ResponseError as exc:
                    out.append(exc)
    except TimeoutError as exc:
        raise RedisTimeoutError(f"timeout reading {n} replies from Redis") from exc
    return out


class RawBatch:
    """A pipeline of commands packed by hand, for the worker's per-step publish.

    redis-py's ``Pipeline`` spends about as long building each command (argument
    encoding, a command stack, response callbacks) as Redis takes to run it; a step of 64
    sequences is 128+ commands. Here each command is packed straight to RESP bytes, the
    batch is written in one call on the client's pipelined command socket
    (``shared.command_socket.CommandLink``: not a pooled connection), and the replies are read
    back raw: error replies come back as ``ResponseError`` objects in place, never raised.
    A connection or timeout error retries the whole batch once on a fresh connection
    (every command the worker batches here is safe to repeat: gateways drop a
    duplicated token by its index, XACK/XDEL/EXPIRE are idempotent).

    On a Redis Cluster (docs/cluster.md) the batch is split per primary by each
    command's key, the parts go out side by side (one round trip per shard touched),
    and MOVED/ASK/TRYAGAIN replies are followed. ``add(..., after=keys)`` keeps an
    order across shards: such a command waits until the commands on ``keys`` ran, in a
    second round, unless they all live on its own shard (then one pipeline keeps the
    order, as on a single server).
    """

    __slots__ = ("_parts", "_args", "_after")

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._args: list[tuple[bytes | str | int, ...]] = []
        self._after: list[tuple[Any, ...]] = []

    def __len__(self) -> int:
        return len(self._parts)

    def add(self, *args: bytes | str | int, after: tuple[Any, ...] | list[Any] = ()) -> int:
        """Queue a command; returns its index in the results. ``after``: keys whose
        commands in this batch must run before this one (they do when queued earlier on a
        single server; on a cluster see the class docstring)."""
        self._parts.append(pack(*args))
        self._args.append(args)
        self._after.append(tuple(after))
        return len(self._parts) - 1

    def take(self, indices: list[int]) -> RawBatch:
        """A batch of the commands at ``indices`` (in that order), as they were queued
        here, their ``after`` keys included: what a partial run left to send again."""
        out = RawBatch()
        out._parts = [self._parts[i] for i in indices]
        out._args = [self._args[i] for i in indices]
        out._after = [self._after[i] for i in indices]
        return out

    async def execute(self, client: aioredis.Redis, *, partial: bool = False) -> list[Any]:
        """Run the batch; one result per command (error replies in place).

        Args:
            partial: on a cluster, a shard that cannot be reached puts its connection
                error in place of its commands' results instead of raising (the
                others' results are real: they ran), and so does a command whose
                ``after`` keys live on such a shard (it is not sent: what it must
                follow did not run). A node found unreachable is not tried again until
                it accepts connections (``FleetCluster.mark_unreachable``).

        Raises:
            BROKER_ERRORS: the server (or, without ``partial``, any shard) is unreachable.
        """
        if not self._parts:
            return []
        if isinstance(client, RedisCluster):
            return await self._run_cluster(client, partial)
        try:
            return await self._run(client)
        except (RedisConnectionError, RedisTimeoutError):
            return await self._run(client)

    async def _run(self, client: aioredis.Redis) -> list[Any]:
        """On the client's pipelined command socket (``shared.command_socket.CommandLink``), not
        a pooled connection: batches of concurrent callers go out back to back."""
        link = command_link(client)
        conn = await link.connection()
        n = len(self._parts)
        replies = conn.send(b"".join(self._parts), n)
        if link.timeout is None:
            return await replies
        try:
            async with asyncio.timeout(link.timeout):
                return await replies
        except TimeoutError as exc:
            error = RedisTimeoutError(f"timeout reading {n} replies from Redis")
            conn.abort(error)
            raise error from exc

    # -- Redis Cluster -------------------------------------------------------------------
    async def _run_cluster(self, client: FleetCluster, partial: bool) -> list[Any]:
        await client.ready()
        nodes = client.nodes_manager
        out: list[Any] = [None] * len(self._parts)
        slots = [slot_of(k) if (k := _route_key(a)) is not None else 0 for a in self._args]
        asking: dict[int, ClusterNode] = {}
        failed: dict[int, Exception] = {}  # slot -> why its shard could not be reached (partial)
        todo = list(range(len(self._parts)))
        for attempt in range(MAX_REDIRECTS):
            node_of = {i: asking.get(i) or nodes.get_node_from_slot(slots[i]) for i in todo}
            # while the cluster answers CLUSTERDOWN a command that must follow others waits
            # for their replies even on their own shard: a shard refuses keys (a log entry)
            # but takes sharded publishes then, and a publish must not overtake its log
            apart = partial and getattr(client, "down", False)
            first, later = [], []
            for i in todo:
                deps = self._after[i]
                if not deps:
                    first.append(i)
                    continue
                dep_slots = [slot_of(d) for d in deps]
                if failed and (why := next((failed[d] for d in dep_slots if d in failed), None)) is not None:
                    out[i] = why  # what it must follow did not run: nor does it
                elif apart or any(nodes.get_node_from_slot(d) is not node_of[i] for d in dep_slots):
                    later.append(i)
                else:
                    first.append(i)
            retry = await self._round(client, first, node_of, asking, out, partial, slots, failed)
            if retry:  # a redirected command goes before the commands that wait for it
                retry += later
            elif later:
                if failed:  # (what they wait for may just have failed)
                    waiting = later
                    later = []
                    for i in waiting:
                        why = next((failed[s] for d in self._after[i] if (s := slot_of(d)) in failed), None)
                        if why is None:
                            later.append(i)
                        else:
                            out[i] = why
                retry = await self._round(client, later, node_of, asking, out, partial, slots, failed)
            if not retry:
                return out
            todo = sorted(set(retry))
            await asyncio.sleep(0.01 * (attempt + 1))
        for i in todo:  # (not run: a slot moving on and on, a shard refusing while it fails over)
            out[i] = RedisClusterException(f"redirected more than {MAX_REDIRECTS} times")
        return out

    async def _round(self, client: FleetCluster, group: list[int], node_of: dict[int, ClusterNode],
                     asking: dict[int, ClusterNode], out: list[Any], partial: bool, slots: list[int],
                     failed: dict[int, Exception]) -> list[int]:
        """Send ``group`` side by side, one pipeline per node; fill ``out``; return the
        commands to send again (redirected, or refused while a slot moves). With
        ``partial``, a node that cannot be reached (or is known unreachable) fills its
        commands' places with the error, and their slots go to ``failed``."""
        if not group:
            return []
        nodes = client.nodes_manager
        by_node: dict[ClusterNode, list[int]] = defaultdict(list)
        for i in group:
            by_node[node_of[i]].append(i)
        skip: dict[ClusterNode, Exception] = {}
        if partial and isinstance(client, FleetCluster) and client._unreachable:
            for node in by_node:
                if (why := client.unreachable(node.name)) is not None:
                    skip[node] = why
            if skip:
                client.stale()  # (its slots may have a new primary by now)
        sending = [(node, idxs) for node, idxs in by_node.items() if node not in skip]
        sent = await asyncio.gather(*(self._send_node(node, idxs, asking) for node, idxs in sending),
                                    return_exceptions=True)
        retry: list[int] = []
        refused = answered = False  # CLUSTERDOWN seen; a key command answered otherwise
        for (node, idxs), res in [*zip(sending, sent), *(((n, by_node[n]), why) for n, why in skip.items())]:
            if isinstance(res, BaseException):
                if not isinstance(res, Exception):
                    raise res
                client.stale()
                if not partial:
                    raise res
                if node not in skip and isinstance(client, FleetCluster) and isinstance(res, BROKER_ERRORS):
                    client.mark_unreachable(node, res)
                for i in idxs:
                    out[i] = res
                    failed[slots[i]] = res
                continue
            for i, r in zip(idxs, res):
                if not isinstance(r, ResponseError):  # (the common case: one check)
                    out[i] = r
                    if not answered and self._args[i][0] not in _PUBLISHES:  # (taken while refusing keys)
                        answered = True
                elif isinstance(r, MovedError):
                    await nodes.move_slot(r)
                    asking.pop(i, None)
                    retry.append(i)
                elif isinstance(r, AskError):
                    asking[i] = nodes.get_node(host=r.host, port=r.port) or ClusterNode(
                        r.host, r.port, **nodes.connection_kwargs)
                    retry.append(i)
                elif isinstance(r, ClusterDownError):
                    refused = True
                    if partial:  # not run: kept by the caller, not retried here while others wait
                        out[i] = r
                        failed[slots[i]] = r
                    else:
                        retry.append(i)
                elif isinstance(r, TryAgainError):
                    retry.append(i)
                else:
                    out[i] = r
                    if not answered and self._args[i][0] not in _PUBLISHES:  # (taken while refusing keys)
                        answered = True
        if isinstance(client, FleetCluster):
            if refused:
                client.down = True
            elif answered:
                client.down = False
        return retry

    async def _send_node(self, node: ClusterNode, idxs: list[int], asking: dict[int, ClusterNode]) -> list[Any]:
        parts = []
        for i in idxs:
            if i in asking:
                parts.append(_ASKING)
            parts.append(self._parts[i])
        conn = node.acquire_connection()
        try:
            await conn.send_packed_command(b"".join(parts), check_health=False)
            replies = iter(await _read_replies(conn, len(parts)))
            out = []
            for i in idxs:
                if i in asking:
                    next(replies)  # ASKING's own OK
                out.append(next(replies))
            return out
        except BaseException as exc:
            await conn.disconnect()
            if isinstance(exc, Exception) and not isinstance(exc, BROKER_ERRORS):
                # redis-py's connection to a node that died mid-write can fail with an
                # AttributeError or (uvloop) RuntimeError: the node is unreachable all the same
                raise RedisConnectionError(f"{node.name}: {type(exc).__name__}: {exc}") from exc
            raise
        finally:
            node.release(conn)


_ASKING = pack(b"ASKING")
_PUBLISHES = (b"SPUBLISH", b"PUBLISH", "SPUBLISH", "PUBLISH")


class RawScript:
    """A Lua script run with ``EVALSHA`` in a ``RawBatch`` (one call or several in one round
    trip, their replies raw), loaded on first use and again when Redis answers NOSCRIPT (a
    restarted or flushed server)."""

    __slots__ = ("source", "sha")

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha: bytes | None = None

    async def run(self, client: aioredis.Redis, calls: Sequence[tuple[Sequence[Any], Sequence[Any]]], *,
                  partial: bool = False) -> list[Any]:
        """One result per ``(keys, args)`` call, in order (error replies in place, as
        ``RawBatch.execute``, whose ``partial`` it takes).

        Raises:
            BROKER_ERRORS: as ``RawBatch.execute``.
        """
        results = await self._once(client, calls, partial)
        if any(isinstance(res, NoScriptError) for res in results):
            self.sha = None
            results = await self._once(client, calls, partial)
        return results

    async def _once(self, client: aioredis.Redis, calls: Sequence[tuple[Sequence[Any], Sequence[Any]]],
                    partial: bool) -> list[Any]:
        if self.sha is None:
            self.sha = as_bytes(await client.script_load(self.source))
        batch = RawBatch()
        for keys, args in calls:
            batch.add(b"EVALSHA", self.sha, len(keys), *keys, *args)
        return await batch.execute(client, partial=partial)


class Coalescer:
    """Commands issued by many tasks in the same event-loop turn travel as one batch.

    The gateway enqueues every request with one ``EVALSHA``; when 64 clients submit at
    once, 64 separate redis-py calls cost 64 pool acquisitions, writes and reads. Here
    ``await call(*args)`` queues the command, the first call of a turn schedules a flush
    for the end of the turn, and the flush sends everything queued as one ``RawBatch``.
    A lone command pays one extra loop turn (microseconds). Error replies are raised to
    their own caller; a connection failure is raised to every caller of that batch.
    """

    def __init__(self, client: aioredis.Redis, max_batch: int = 256) -> None:
        self.client = client
        self.max_batch = max_batch
        self._pending: list[tuple[tuple[bytes | str | int, ...], asyncio.Future[Any]]] = []
        self._tasks: set[asyncio.Task[None]] = set()

    def send(self, *args: bytes | str | int) -> asyncio.Future[Any]:
        """Queue a command without waiting; the future gets its reply (an error reply
        as a ``ResponseError`` value). Commands keep the order they were queued in."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending.append((args, fut))
        if len(self._pending) == 1:
            loop.call_soon(self._flush)
        elif len(self._pending) >= self.max_batch:
            self._flush()
        return fut

    async def call(self, *args: bytes | str | int) -> Any:
        result = await self.send(*args)
        if isinstance(result, ResponseError):
            raise result
        return result

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        t = asyncio.ensure_future(self._send(pending))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _send(self, pending: list[tuple[tuple[bytes | str | int, ...], asyncio.Future[Any]]]) -> None:
        batch = RawBatch()
        for args, _ in pending:
            batch.add(*args)
        try:
            results = await batch.execute(self.client, partial=True)
        except BaseException as exc:
            for _, fut in pending:
                if not fut.done():
                    fut.set_exception(exc if isinstance(exc, Exception) else RedisConnectionError(str(exc)))
            if not isinstance(exc, Exception):
                raise
            return
        for (_, fut), res in zip(pending, results):
            if not fut.done():
                if isinstance(res, Exception) and not isinstance(res, ResponseError):
                    fut.set_exception(res)  # a cluster shard that could not be reached
                else:
                    fut.set_result(res)
