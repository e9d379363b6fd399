"""Pub/sub connections: a socket read by an ``asyncio.Protocol``, and the sharded
subscriptions of a Redis Cluster (one such socket per primary).

Every token a gateway delivers arrives as one pub/sub message, so this is the busiest
code path in the process. redis-py's ``PubSub.get_message`` costs a coroutine, a timeout
context, a health check and a dict per message; here the socket's bytes go straight to
hiredis in ``data_received`` and each parsed message is handed to
``on_message(channel, data)`` synchronously (docs/benchmarks/fleet.md measures the path).

The same kind of socket, for commands, is ``shared.command_socket``.

The connection speaks RESP2 and knows what a pub/sub-only client needs: AUTH (user and
password from the URL), TLS (``rediss://``), unix sockets, SUBSCRIBE and SSUBSCRIBE
with their acknowledgements, UNSUBSCRIBE, PING. It does not reconnect by itself: ``lost``
resolves when the socket is gone and the owner (``gateway.requests.broker.Broker``,
``ShardSubscriptions``) opens a new one.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import hiredis
from redis.asyncio.connection import parse_url
from redis.exceptions import ConnectionError as RedisConnectionError, ResponseError

from streamfleet.shared.resp import RedisSocket, fail_all, open_socket, pack, slot_of

if TYPE_CHECKING:
    from redis.asyncio.cluster import ClusterNode
    from structlog.stdlib import BoundLogger

    from streamfleet.shared.redis import FleetCluster

__all__ = ["PubSubConnection", "open_pubsub", "ShardSubscriptions"]

OnMessage = Callable[[bytes, bytes], None]

_PUSH_KINDS = frozenset((b"message", b"subscribe", b"unsubscribe", b"pmessage", b"psubscribe",
                         b"punsubscribe", b"pong", b"smessage", b"ssubscribe", b"sunsubscribe"))


class PubSubConnection(RedisSocket):
    """One subscriber socket. ``on_message(channel, data)`` runs inside ``data_received``:
    it must be quick and must not raise (what it raises is logged by the caller's
    wrapper, never here)."""

    def __init__(self, on_message: OnMessage) -> None:
        self.on_message = on_message
        #: called with a channel the server unsubscribed this socket from by itself (a
        #: cluster slot that moved to another shard)
        self.on_dropped: Callable[[bytes], None] | None = None
        self._leaving: set[bytes] = set()  # channels this side asked to leave (sharded)
        self.transport: asyncio.Transport | None = None
        self._reader = hiredis.Reader(replyError=ResponseError)
        self._replies: deque[asyncio.Future[Any]] = deque()  # plain command replies (AUTH), in order
        self._acks: dict[bytes, list[asyncio.Future[Any]]] = {}  # channel -> SUBSCRIBE acknowledgements
        self._pongs: deque[asyncio.Future[Any]] = deque()
        loop = asyncio.get_running_loop()
        self.lost: asyncio.Future[Exception | None] = loop.create_future()  # result: the exception, or None

    # -- asyncio.Protocol ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        try:
            while True:
                reply = reader.gets()
                if reply is False:
                    return
                if type(reply) is list and reply and reply[0] in _PUSH_KINDS:
                    kind = reply[0]
                    if kind == b"message" or kind == b"smessage":
                        self.on_message(reply[1], reply[2])
                    elif kind == b"sunsubscribe":
                        if reply[1] in self._leaving:
                            self._leaving.discard(reply[1])
                        elif self.on_dropped is not None:
                            self.on_dropped(reply[1])
                    elif kind == b"subscribe" or kind == b"ssubscribe":
                        for fut in self._acks.pop(reply[1], ()):
                            if not fut.done():
                                fut.set_result(None)
                    elif kind == b"pong" and self._pongs:
                            fut = self._pongs.popleft()
                            if not fut.done():
                                fut.set_result(None)
                    continue
                if reply == b"PONG" and self._pongs and not self._replies:  # PING before any SUBSCRIBE
                    fut = self._pongs.popleft()
                    if not fut.done():
                        fut.set_result(None)
                elif self._replies:  # AUTH and other commands sent before subscribing
                    fut = self._replies.popleft()
                    if not fut.done():
                        if isinstance(reply, ResponseError):
                            fut.set_exception(reply)
                        else:
                            fut.set_result(reply)
                elif isinstance(reply, ResponseError):  # a refused SUBSCRIBE or PING (NOAUTH, ACL)
                    self._refused(reply)
        except hiredis.ProtocolError as exc:
            self._fail(RedisConnectionError(f"pub/sub protocol error: {exc}"))
            if self.transport is not None:
                self.transport.abort()

    def _refused(self, error: ResponseError) -> None:
        waiting = [*self._pongs, *(f for fs in self._acks.values() for f in fs)]
        self._pongs.clear()
        self._acks.clear()
        for fut in waiting:
            if not fut.done():
                fut.set_exception(error)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RedisConnectionError(f"pub/sub connection lost: {exc}" if exc else "pub/sub connection closed"))

    def _fail(self, exc: Exception) -> None:
        waiting = [*self._replies, *self._pongs, *(f for fs in self._acks.values() for f in fs)]
        self._replies.clear()
        self._pongs.clear()
        self._acks.clear()
        fail_all(waiting, exc, self.lost)

    # -- commands --------------------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        return self.transport is not None and not self.lost.done()

    def _write(self, data: bytes) -> None:
        if not self.is_open:
            raise RedisConnectionError("pub/sub connection is closed")
        assert self.transport is not None  # is_open
        self.transport.write(data)

    async def command(self, *args: bytes | str | int, timeout: float) -> object:
        """A command answered by a plain reply (only before the first SUBSCRIBE)."""
        fut = asyncio.get_running_loop().create_future()
        self._replies.append(fut)
        self._write(pack(*args))
        return await asyncio.wait_for(fut, timeout)

    async def subscribe(self, *channels: str | bytes, timeout: float, sharded: bool = False) -> None:
        """SUBSCRIBE (``sharded``: SSUBSCRIBE, whose channels must share one slot) and
        wait until Redis acknowledged every channel: a message published after this
        returns reaches this connection.

        Raises:
            ResponseError: refused (NOAUTH, ACL; MOVED for a slot this node does not own).
        """
        if not channels:
            return
        loop = asyncio.get_running_loop()
        futs = []
        for ch in channels:
            key = ch.encode() if isinstance(ch, str) else ch
            fut = loop.create_future()
            self._acks.setdefault(key, []).append(fut)
            futs.append(fut)
        self._write(pack(b"SSUBSCRIBE" if sharded else b"SUBSCRIBE", *channels))
        await asyncio.wait_for(asyncio.gather(*futs), timeout)

    def unsubscribe(self, *channels: str | bytes, sharded: bool = False) -> None:
        """UNSUBSCRIBE without waiting (messages already in flight are dropped by the owner)."""
        if channels and self.transport is not None and self.is_open:
            if sharded:
                self._leaving.update(c.encode() if isinstance(c, str) else c for c in channels)
            self.transport.write(pack(b"SUNSUBSCRIBE" if sharded else b"UNSUBSCRIBE", *channels))

    async def ping(self, timeout: float) -> None:
        """PING in subscribed mode; raises if no PONG within ``timeout``."""
        fut = asyncio.get_running_loop().create_future()
        self._pongs.append(fut)
        self._write(pack(b"PING"))
        await asyncio.wait_for(fut, timeout)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def open_pubsub(url: str, on_message: OnMessage, *, timeout: float = 5.0,
                      client_name: str | None = None) -> PubSubConnection:
    """Connect (and authenticate) a subscriber socket to the Redis at ``url``.

    Raises:
        redis.exceptions.ConnectionError: unreachable, refused, or authentication failed.
    """
    proto = PubSubConnection(on_message)
    await open_socket(parse_url(url), proto, timeout, client_name, "pub/sub")
    return proto


#: seconds of quiet after which a sharded subscriber socket is PINGed
SHARD_PING_S = 5.0
#: the longest wait between tries at re-subscribing channels whose shard failed: about
#: the slot map's refresh (``shared.redis.REFRESH_EVERY_S``), so that the channels move
#: to a new primary within moments of its election (a worker stops a request nobody has
#: heard for ``SF_ORPHAN_GRACE_S``)
RESUBSCRIBE_MAX_S = 0.25


class ShardSubscriptions:
    """Sharded subscriptions on a Redis Cluster (docs/cluster.md): each channel is
    SSUBSCRIBEd on the primary that owns its slot, over one socket per primary.

    ``run()`` keeps them there: a socket whose primary dies (a failover), and a channel the
    server drops because its slot moved (resharding) or answers with MOVED, is subscribed
    again where its slot lives now, from a refreshed slot map, and ``on_restored`` gets
    those channels (their owners re-read the logs for what was published meanwhile).
    Channels that find no live primary within ``failover_s`` go to ``on_lost`` once (their
    requests end with a clear error) and are still retried.

    Args:
        cluster: the process's ``shared.redis.FleetCluster`` (its slot map is shared).
        node_url: the URL of a node (credentials and TLS of the configured one).
    """

    def __init__(self, cluster: FleetCluster, node_url: Callable[[str, int], str], on_message: OnMessage, *,
                 timeout: float, client_name: str, on_restored: Callable[[list[bytes]], None],
                 on_lost: Callable[[list[bytes]], None], failover_s: float = 30.0,
                 log: BoundLogger | None = None) -> None:
        self.cluster = cluster
        self.node_url = node_url
        self.on_message = on_message
        self.timeout = timeout
        self.client_name = client_name
        self.on_restored = on_restored
        self.on_lost = on_lost
        self.failover_s = failover_s
        self.log = log
        self._conns: dict[str, PubSubConnection] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self._where: dict[bytes, str] = {}  # channel -> name of the node it is subscribed on
        self._pending: dict[bytes, float] = {}  # channel -> monotonic time it lost its subscription
        self._reported: set[bytes] = set()  # pending channels already given to on_lost
        self._kick = asyncio.Event()
        self._watchers: set[asyncio.Task[None]] = set()

    async def _owner(self, channel: bytes) -> ClusterNode:
        await self.cluster.ready()
        return self.cluster.nodes_manager.get_node_from_slot(slot_of(channel))

    async def _socket(self, node: ClusterNode) -> PubSubConnection:
        conn = self._conns.get(node.name)
        if conn is not None and conn.is_open:
            return conn
        lock = self._connecting.setdefault(node.name, asyncio.Lock())
        async with lock:
            conn = self._conns.get(node.name)
            if conn is not None and conn.is_open:
                return conn
            conn = await open_pubsub(self.node_url(node.host, int(node.port)), self.on_message, timeout=self.timeout,
                                     client_name=self.client_name)
            conn.on_dropped = self._dropped
            self._conns[node.name] = conn
            t = asyncio.create_task(self._watch(node.name, conn), name=f"pubsub-{node.name}")
            self._watchers.add(t)
            t.add_done_callback(self._watchers.discard)
            return conn

    async def subscribe(self, channel: bytes, attempts: int = 4) -> None:
        """SSUBSCRIBE on the primary owning the channel's slot; returns once it
        acknowledged (a message published after this reaches this process).

        Raises:
            redis.exceptions.ConnectionError: no primary took it (after refreshing the
                slot map between attempts).
            ResponseError: refused for another reason (NOAUTH, ACL).
        """
        last: Exception | None = None
        for attempt in range(attempts):
            try:
                node = await self._owner(channel)
                conn = await self._socket(node)
                await conn.subscribe(channel, timeout=self.timeout, sharded=True)
            except ResponseError as exc:
                if not str(exc).startswith(("MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN")):
                    raise
                last = exc
            except Exception as exc:  # unreachable, or no slot map (ClusterDownError, SlotNotCovered...)
                last = exc
            else:
                self._where[channel] = node.name
                self._pending.pop(channel, None)
                self._reported.discard(channel)
                return
            self.cluster.stale(at_once=True)
            if attempt + 1 < attempts:
                await asyncio.sleep(0.05 * (attempt + 1))
        raise RedisConnectionError(f"cannot subscribe to {channel.decode(errors='replace')}: {last}")

    def keep(self, channel: bytes) -> None:
        """Subscribe in the background: ``run`` tries until a primary takes it, then
        reports it to ``on_restored``."""
        if channel not in self._where:
            self._pending.setdefault(channel, time.monotonic())
            self._kick.set()

    def unsubscribe(self, channel: bytes) -> None:
        self._pending.pop(channel, None)
        self._reported.discard(channel)
        conn = self._conns.get(self._where.pop(channel, ""))
        if conn is not None:
            conn.unsubscribe(channel, sharded=True)

    def _dropped(self, channel: bytes) -> None:
        """The server unsubscribed us: the channel's slot moved to another shard."""
        if self._where.pop(channel, None) is not None:
            self._pending[channel] = time.monotonic()
            self._kick.set()

    async def _watch(self, name: str, conn: PubSubConnection) -> None:
        while not conn.lost.done():
            done, _ = await asyncio.wait({conn.lost}, timeout=SHARD_PING_S)
            if done:
                break
            try:
                await conn.ping(self.timeout)
            except (TimeoutError, RedisConnectionError, OSError, ResponseError):
                conn.close()
                break
        if self._conns.get(name) is conn:
            del self._conns[name]
        now = time.monotonic()
        moved = [ch for ch, where in self._where.items() if where == name]
        for ch in moved:
            del self._where[ch]
            self._pending.setdefault(ch, now)
        if moved and self.log is not None:
            self.log.warning("pub/sub connection to a shard lost; resubscribing", node=name, channels=len(moved))
        self.cluster.stale()
        self._kick.set()

    async def run(self) -> None:
        """Resubscribe what lost its subscription, until cancelled: tried again every
        ``RESUBSCRIBE_MAX_S`` at most (a failover's new primary is served within a slot
        map refresh), at once after a round that restored some (the others' may follow)."""
        backoff = 0.05
        while True:
            if not self._pending:
                self._kick.clear()
                await self._kick.wait()
                backoff = 0.05
            restored = []
            for ch in list(self._pending):
                if ch not in self._pending:
                    continue
                try:
                    await self.subscribe(ch, attempts=1)
                except Exception:
                    continue
                restored.append(ch)
            if restored:
                if self.log is not None:
                    self.log.info("sharded subscriptions restored", channels=len(restored))
                self.on_restored(restored)
            now = time.monotonic()
            late = [ch for ch, since in self._pending.items()
                    if now - since >= self.failover_s and ch not in self._reported]
            if late:
                self._reported.update(late)
                self.on_lost(late)
            if self._pending:
                if restored:  # the slot map names new primaries: the rest may be theirs too
                    backoff = 0.05
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RESUBSCRIBE_MAX_S)

    def close(self) -> None:
        for t in list(self._watchers):
            t.cancel()
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
