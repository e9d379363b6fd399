"""The pipelined command socket: ``CommandConnection``, one per redis-py client
(``CommandLink``), on which ``shared.redis.RawBatch`` sends the batches of a gateway's
enqueues and a worker's per-step publishes, back to back without waiting for each
other's replies. The rest of the Redis traffic (heartbeats, log reads, rate limits)
stays on redis-py's pooled connections."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any

import hiredis
from redis._parsers.base import BaseParser
from redis.exceptions import ConnectionError as RedisConnectionError, TimeoutError as RedisTimeoutError

from streamfleet.shared import aio
from streamfleet.shared.resp import RedisSocket, fail_all, open_socket, pack

if TYPE_CHECKING:
    from redis.asyncio import ConnectionPool, Redis

__all__ = ["CommandConnection", "CommandLink", "command_link", "blocking_link", "close_command_link"]


class CommandConnection(RedisSocket):
    """A pipelined command socket: the batches of ``shared.redis.RawBatch`` (a gateway's
    enqueues, a worker's per-step publish) go out on it one after another without waiting
    for each other's replies, and each gets its replies, in order, from
    ``data_received``.

    redis-py spends more Python on every batch it sends through a pooled connection
    (taking the connection from the pool, a write that awaits ``drain``, a read through a
    stream reader) than a Redis round trip takes, and it is paid twice on a request's way
    to its first token (the enqueue, then the token's publish). Here a batch is one
    ``transport.write`` and one future (docs/benchmarks/fleet.md measures the whole path).

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
        self._waiting: deque[list[Any]] = deque()
        self.lost: asyncio.Future[Exception | None] = self.loop.create_future()  # result: the exception

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
        fail_all(waiting, exc, self.lost)

    @property
    def is_open(self) -> bool:
        return self.transport is not None and not self.lost.done() and not self.transport.is_closing()

    def send(self, data: bytes, n: int) -> asyncio.Future[list[Any]]:
        """Write ``n`` packed commands; the future gets their ``n`` replies.

        Raises:
            redis.exceptions.ConnectionError: the socket is closed.
        """
        if not self.is_open:
            raise RedisConnectionError("Redis connection is closed")
        fut = self.loop.create_future()
        self._waiting.append([n, [], fut])
        assert self.transport is not None  # is_open
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

    def __init__(self, pool: ConnectionPool, name: str | None = None) -> None:
        self.params = dict(pool.connection_kwargs, connection_class=pool.connection_class)
        self.timeout: float | None = self.params.get("socket_timeout")
        self.connect_timeout: float = self.params.get("socket_connect_timeout") or self.timeout or 5.0
        self.name: str | None = name or getattr(pool, "_sf_command_name", None) or self.params.get("client_name")
        self._conn: CommandConnection | None = None
        self._opening: asyncio.Future[CommandConnection] | None = None

    async def connection(self) -> CommandConnection:
        conn = self._conn
        if conn is not None and conn.is_open and conn.loop is asyncio.get_running_loop():
            return conn
        opening = self._opening
        if opening is None or opening.done() or opening.get_loop() is not asyncio.get_running_loop():
            opening = self._opening = asyncio.ensure_future(self._open())
            opening.add_done_callback(aio.mark_retrieved)
        return await asyncio.shield(opening)

    async def _open(self) -> CommandConnection:
        conn = CommandConnection()
        await open_socket(self.params, conn, self.connect_timeout, self.name, "commands")
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


def command_link(client: Redis) -> CommandLink:
    """The ``CommandLink`` of a redis-py client (one per connection pool)."""
    pool = client.connection_pool
    link = getattr(pool, "_sf_command_link", None)
    if link is None:
        link = pool._sf_command_link = CommandLink(pool)  # type: ignore[attr-defined]  # kept on the pool
    return link


def blocking_link(client: Redis, name: str) -> CommandLink:
    """A second ``CommandLink`` of a redis-py client, named ``name``, for the blocking
    commands of one caller (``CommandLink.blocking``: a worker's idle wait on its lanes),
    so that they never hold the socket the client's batches are pipelined on."""
    pool = client.connection_pool
    link = getattr(pool, "_sf_blocking_link", None)
    if link is None:
        link = pool._sf_blocking_link = CommandLink(pool, name)  # type: ignore[attr-defined]  # kept on the pool
    return link


def close_command_link(client: object) -> None:
    """Close the client's command sockets, if it has any (with ``client.aclose()``)."""
    pool = getattr(client, "connection_pool", None)
    for attr in ("_sf_command_link", "_sf_blocking_link"):
        link = getattr(pool, attr, None)
        if link is not None:
            link.close()
