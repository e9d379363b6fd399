"""Pub/sub connections: a socket read by an ``asyncio.Protocol``, and the sharded
subscriptions of a Redis Cluster (one such socket per primary).

Every token a gateway delivers arrives as one pub/sub message, so this is the busiest
code path in the process. redis-py's ``PubSub.get_message`` costs a coroutine, a timeout
context, a health check and a dict per message; here the socket's bytes go straight to
hiredis in ``data_received`` and each parsed message is handed to
``on_message(channel, data)`` synchronously (docs/status.md has the figures).

The same kind of socket carries ``shared.redis.RawBatch``: ``CommandConnection``, one per
client (``CommandLink``), on which the batches of a gateway's enqueues and a worker's
per-step publishes are pipelined. The rest of the Redis traffic (heartbeats, log reads,
rate limits) stays on redis-py.

The connection speaks RESP2 and knows what a pub/sub-only client needs: AUTH (user and
password from the URL), TLS (``rediss://``), unix sockets, SUBSCRIBE and SSUBSCRIBE
with their acknowledgements, UNSUBSCRIBE, PING. It does not reconnect by itself: ``lost``
resolves when the socket is gone and the owner (``gateway.broker.Broker``,
``ShardSubscriptions``) opens a new one.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from typing import Callable

import hiredis
from redis._parsers.base import BaseParser
from redis.asyncio.connection import parse_url
from redis.exceptions import AuthenticationError, ConnectionError as RedisConnectionError, ResponseError, \
    TimeoutError as RedisTimeoutError

from streamfleet.shared.redis import pack, slot_of

__all__ = ["PubSubConnection", "open_pubsub", "pack", "CommandConnection", "CommandLink", "command_link",
           "blocking_link", "close_command_link"]

OnMessage = Callable[[bytes, bytes], None]

_PUSH_KINDS = frozenset((b"message", b"subscribe", b"unsubscribe", b"pmessage", b"psubscribe",
                         b"punsubscribe", b"pong", b"smessage", b"ssubscribe", b"sunsubscribe"))


class PubSubConnection(asyncio.Protocol):
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
        self._replies: deque[asyncio.Future] = deque()  # plain command replies (AUTH), in order
        self._acks: dict[bytes, list[asyncio.Future]] = {}  # channel -> SUBSCRIBE acknowledgements
        self._pongs: deque[asyncio.Future] = deque()
        loop = asyncio.get_running_loop()
        self.lost: asyncio.Future = loop.create_future()  # result: the exception, or None

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
                    elif kind == b"pong":
                        if self._pongs:
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
        _fail_all(waiting, exc, self.lost)

    # -- commands --------------------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        return self.transport is not None and not self.lost.done()

    def _write(self, data: bytes) -> None:
        if not self.is_open:
            raise RedisConnectionError("pub/sub connection is closed")
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
        if channels and self.is_open:
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


def _fail_all(waiting: list[asyncio.Future], exc: Exception, lost: asyncio.Future) -> None:
    """A socket is gone: every reply still awaited fails with ``exc``, and ``lost`` says so."""
    for fut in waiting:
        if not fut.done():
            fut.set_exception(exc)
    if not lost.done():
        lost.set_result(exc)


def _ssl_context(params: dict) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=params.get("ssl_ca_certs"))
    reqs = params.get("ssl_cert_reqs")
    if isinstance(reqs, str):
        reqs = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}.get(reqs.lower())
    if reqs == ssl.CERT_NONE:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if params.get("ssl_certfile"):
        ctx.load_cert_chain(params["ssl_certfile"], params.get("ssl_keyfile"))
    return ctx


async def open_pubsub(url: str, on_message: OnMessage, *, timeout: float = 5.0,
                      client_name: str | None = None) -> PubSubConnection:
    """Connect (and authenticate) a subscriber socket to the Redis at ``url``.

    Raises:
        redis.exceptions.ConnectionError: unreachable, refused, or authentication failed.
    """
    proto = PubSubConnection(on_message)
    await _connect(parse_url(url), proto, timeout, client_name, "pub/sub")
    return proto


async def _connect(params: dict, proto: "PubSubConnection | CommandConnection", timeout: float,
                   client_name: str | None, what: str) -> None:
    """Open ``proto``'s socket as ``params`` say (redis-py's connection keywords: host and
    port or a unix ``path``, TLS by ``connection_class``, credentials), authenticate and
    name it."""
    loop = asyncio.get_running_loop()
    try:
        if params.get("path"):
            await asyncio.wait_for(loop.create_unix_connection(lambda: proto, params["path"]), timeout)
        else:
            tls = None
            conn_class = params.get("connection_class")
            if conn_class is not None and "SSL" in conn_class.__name__:
                tls = _ssl_context(params)
            await asyncio.wait_for(loop.create_connection(lambda: proto, params.get("host", "localhost"),
                                                          int(params.get("port", 6379)), ssl=tls), timeout)
    except (OSError, asyncio.TimeoutError, ssl.SSLError) as exc:
        raise RedisConnectionError(f"cannot connect to Redis for {what}: {exc}") from exc
    try:
        password = params.get("password")
        if password is not None:
            username = params.get("username")
            auth = ("AUTH", username, password) if username else ("AUTH", password)  # parse_url unquoted them
            await proto.command(*auth, timeout=timeout)
        if client_name:
            try:  # a name for CLIENT LIST; an ACL user without client|setname still gets its socket
                await proto.command("CLIENT", "SETNAME", client_name, timeout=timeout)
            except ResponseError as exc:
                if "NOAUTH" in str(exc):
                    raise
    except (ResponseError, AuthenticationError) as exc:
        proto.close()
        refused = str(exc)
        if isinstance(exc, AuthenticationError) or "NOAUTH" in refused or "WRONGPASS" in refused \
                or "invalid" in refused.lower():
            raise AuthenticationError(f"Redis refused the {what} connection's credentials: {exc}") from exc
        raise RedisConnectionError(f"Redis refused the {what} connection: {exc}") from exc
    except asyncio.TimeoutError as exc:
        proto.close()
        raise RedisConnectionError(f"Redis did not answer the {what} handshake") from exc


class CommandConnection(asyncio.Protocol):
    """A pipelined command socket: the batches of ``shared.redis.RawBatch`` (a gateway's
    enqueues, a worker's per-step publish) go out on it one after another without waiting
    for each other's replies, and each gets its replies, in order, from
    ``data_received``.

    redis-py spends about 300 µs of Python on every batch it sends through a pooled
    connection (taking the connection from the pool, a write that awaits ``drain``, a
    read through a stream reader) — more than a Redis round trip, and paid twice on a
    request's way to its first token (the enqueue, then the token's publish). Here a batch
    is one ``transport.write`` and one future (docs/status.md, "Beside the peers").

    Error replies come back in place, as the exceptions redis-py would raise for them
    (``ResponseError`` and its kinds: ``NoScriptError``, ``ReadOnlyError``...). A batch whose caller
    gave up (cancelled) still has its replies read and dropped, so the socket stays in
    step; a lost socket fails every batch in flight with ``ConnectionError``.
    """

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        # error replies as redis-py makes them (NoScriptError, ReadOnlyError, MovedError...)
        self._reader = hiredis.Reader(replyError=BaseParser.parse_error)
        #: batches in flight, oldest first: [replies expected, replies so far, future]
        self._waiting: deque[list] = deque()
        self.lost: asyncio.Future = self.loop.create_future()  # result: the exception

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        waiting = self._waiting
        try:
            while True:
                reply = reader.gets()
                if reply is False:
                    return
                if not waiting:
                    self.abort(RedisConnectionError("Redis sent a reply nothing asked for"))
                    return
                entry = waiting[0]
                replies = entry[1]
                replies.append(reply)
                if len(replies) == entry[0]:
                    waiting.popleft()
                    fut = entry[2]
                    if not fut.done():
                        fut.set_result(replies)
        except hiredis.ProtocolError as exc:
            self.abort(RedisConnectionError(f"Redis protocol error: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RedisConnectionError(f"Redis connection lost: {exc}" if exc else "Redis connection closed"))

    def _fail(self, exc: Exception) -> None:
        waiting = [entry[2] for entry in self._waiting]
        self._waiting.clear()
        _fail_all(waiting, exc, self.lost)

    @property
    def is_open(self) -> bool:
        return self.transport is not None and not self.lost.done() and not self.transport.is_closing()

    def send(self, data: bytes, n: int) -> asyncio.Future:
        """Write ``n`` packed commands; the future gets their ``n`` replies.

        Raises:
            redis.exceptions.ConnectionError: the socket is closed.
        """
        if not self.is_open:
            raise RedisConnectionError("Redis connection is closed")
        fut = self.loop.create_future()
        self._waiting.append([n, [], fut])
        self.transport.write(data)
        return fut

    async def command(self, *args: bytes | str | int, timeout: float) -> object:
        """One command; an error reply is raised."""
        (reply,) = await asyncio.wait_for(self.send(pack(*args), 1), timeout)
        if isinstance(reply, Exception):
            raise reply
        return reply

    def abort(self, exc: Exception) -> None:
        """Drop the socket at once (replies still owed would land out of step); every batch
        in flight fails with ``exc``."""
        self._fail(exc)
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class CommandLink:
    """The ``CommandConnection`` of one redis-py client (same server, credentials, TLS,
    database and timeouts as its pool), opened on first use and opened again after it
    is lost. ``timeout``: how long a batch may wait for its replies (the pool's socket
    timeout); past it the socket is dropped, as redis-py drops a timed-out connection."""

    def __init__(self, pool, name: str | None = None) -> None:
        self.params = dict(pool.connection_kwargs, connection_class=pool.connection_class)
        self.timeout: float | None = self.params.get("socket_timeout")
        self.connect_timeout: float = self.params.get("socket_connect_timeout") or self.timeout or 5.0
        self.name: str | None = name or getattr(pool, "_sf_command_name", None) or self.params.get("client_name")
        self._conn: CommandConnection | None = None
        self._opening: asyncio.Future | None = None

    async def connection(self) -> CommandConnection:
        conn = self._conn
        if conn is not None and conn.is_open and conn.loop is asyncio.get_running_loop():
            return conn
        opening = self._opening
        if opening is None or opening.done() or opening.get_loop() is not asyncio.get_running_loop():
            opening = self._opening = asyncio.ensure_future(self._open())
            opening.add_done_callback(_retrieve)
        return await asyncio.shield(opening)

    async def _open(self) -> CommandConnection:
        conn = CommandConnection()
        await _connect(self.params, conn, self.connect_timeout, self.name, "commands")
        db = int(self.params.get("db") or 0)
        if db:
            try:
                await conn.command("SELECT", db, timeout=self.connect_timeout)
            except BaseException:
                conn.close()
                raise
        old, self._conn = self._conn, conn
        if old is not None:
            old.close()
        return conn

    async def blocking(self, *args: bytes | str | int, block_s: float) -> object:
        """One blocking command (``XREADGROUP ... BLOCK``) that may hold the socket for
        ``block_s``: its reply is waited for that long plus the socket timeout, past which
        the socket is dropped. Use a link of its own for it (``blocking_link``): batches
        queued behind it would wait as long.

        Raises:
            ResponseError: Redis refused the command (the error reply).
            redis.exceptions.ConnectionError, redis.exceptions.TimeoutError: the socket
                was lost, or no reply came in time.
        """
        conn = await self.connection()
        replies = conn.send(pack(*args), 1)
        try:
            async with asyncio.timeout(block_s + (self.timeout or 5.0)):
                (reply,) = await replies
        except TimeoutError as exc:
            error = RedisTimeoutError(f"no reply to a blocking {args[0]!r} from Redis")
            conn.abort(error)
            raise error from exc
        if isinstance(reply, Exception):
            raise reply
        return reply

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except RuntimeError:  # its event loop is closed: the socket went with it
                pass


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # read by its awaiters; marked retrieved for when none is left


def command_link(client) -> CommandLink:
    """The ``CommandLink`` of a redis-py client (one per connection pool)."""
    pool = client.connection_pool
    link = getattr(pool, "_sf_command_link", None)
    if link is None:
        link = pool._sf_command_link = CommandLink(pool)
    return link


def blocking_link(client, name: str) -> CommandLink:
    """A second ``CommandLink`` of a redis-py client, named ``name``, for the blocking
    commands of one caller (``CommandLink.blocking``: a worker's idle wait on its lanes),
    so that they never hold the socket the client's batches are pipelined on."""
    pool = client.connection_pool
    link = getattr(pool, "_sf_blocking_link", None)
    if link is None:
        link = pool._sf_blocking_link = CommandLink(pool, name)
    return link


def close_command_link(client) -> None:
    """Close the client's command sockets, if it has any (with ``client.aclose()``)."""
    pool = getattr(client, "connection_pool", None)
    for attr in ("_sf_command_link", "_sf_blocking_link"):
        link = getattr(pool, attr, None)
        if link is not None:
            link.close()


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

    def __init__(self, cluster, node_url: Callable[[str, int], str], on_message: OnMessage, *, timeout: float,
                 client_name: str, on_restored: Callable[[list[bytes]], None],
                 on_lost: Callable[[list[bytes]], None], failover_s: float = 30.0, log=None) -> None:
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
        self._watchers: set[asyncio.Task] = set()

    async def _owner(self, channel: bytes):
        await self.cluster.ready()
        return self.cluster.nodes_manager.get_node_from_slot(slot_of(channel))

    async def _socket(self, node) -> PubSubConnection:
        conn = self._conns.get(node.name)
        if conn is not None and conn.is_open:
            return conn
        lock = self._connecting.setdefault(node.name, asyncio.Lock())
        async with lock:
            conn = self._conns.get(node.name)
            if conn is not None and conn.is_open:
                return conn
            conn = await open_pubsub(self.node_url(node.host, node.port), self.on_message, timeout=self.timeout,
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
            except (RedisConnectionError, OSError, asyncio.TimeoutError, ResponseError):
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
