"""Redis connection helpers shared by gateway and workers."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

__all__ = ["connect", "BROKER_ERRORS", "pack", "RawBatch", "Coalescer", "refresh_members"]

#: exceptions meaning "the broker is not reachable right now"
BROKER_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)


def connect(url: str, *, socket_timeout: float | None = 5.0, max_connections: int = 64) -> aioredis.Redis:
    """An asyncio client returning bytes, with bounded retries and timeouts.

    The pool blocks (up to the socket timeout) when all ``max_connections`` are busy,
    so a burst of requests queues for a connection instead of failing.

    Blocking commands (XREADGROUP BLOCK, pub/sub reads) must use a per-call timeout
    that exceeds their block time; the socket timeout guards everything else.
    """
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
    return aioredis.Redis(connection_pool=pool, auto_close_connection_pool=True)


async def refresh_members(redis: aioredis.Redis, members: list[tuple[str, str]], expiry_ms: int,
                          ttl_ms: int) -> None:
    """Push the score (an expiry, unix ms) of ``(sorted set, member)`` pairs to
    ``expiry_ms`` where the member is still there (``ZADD XX``: a lapsed one is not
    revived), and each set's TTL to ``ttl_ms``; one round trip. The stream and connection
    slots of API keys are such sets (gateway/ratelimit.py, workers/heartbeat.py).

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


def pack(*args: bytes | str | int) -> bytes:
    """One command in RESP."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        if isinstance(a, str):
            a = a.encode()
        elif isinstance(a, int):
            a = b"%d" % a
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


class RawBatch:
    """A pipeline of commands packed by hand, for the worker's per-step publish.

    redis-py's ``Pipeline`` spends about as long building each command (argument
    encoding, a command stack, response callbacks) as Redis takes to run it; a step of 64
    sequences is 128+ commands. Here each command is packed straight to RESP bytes, the
    batch is written in one call on a pooled connection, and the replies are read back
    raw: error replies come back as ``ResponseError`` objects in place, never raised.
    A connection or timeout error retries the whole batch once on a fresh connection
    (every command the worker batches here is safe to repeat: gateways drop a
    duplicated token by its index, XACK/XDEL/EXPIRE are idempotent).
    """

    __slots__ = ("_parts",)

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def __len__(self) -> int:
        return len(self._parts)

    def add(self, *args: bytes | str | int) -> int:
        """Queue a command; returns its index in the results."""
        self._parts.append(pack(*args))
        return len(self._parts) - 1

    async def execute(self, client: aioredis.Redis) -> list:
        if not self._parts:
            return []
        try:
            return await self._run(client)
        except (RedisConnectionError, RedisTimeoutError):
            return await self._run(client)

    async def _run(self, client: aioredis.Redis) -> list:
        pool = client.connection_pool
        conn = await pool.get_connection()
        try:
            await conn.send_packed_command(b"".join(self._parts), check_health=False)
            out = []
            for _ in self._parts:
                try:
                    out.append(await conn.read_response())
                except ResponseError as exc:
                    out.append(exc)
            return out
        except BaseException:
            await conn.disconnect()
            raise
        finally:
            await pool.release(conn)


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
        self._pending: list[tuple[tuple, asyncio.Future]] = []
        self._tasks: set[asyncio.Task] = set()

    def send(self, *args: bytes | str | int) -> asyncio.Future:
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

    async def call(self, *args: bytes | str | int):
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

    async def _send(self, pending: list[tuple[tuple, asyncio.Future]]) -> None:
        batch = RawBatch()
        for args, _ in pending:
            batch.add(*args)
        try:
            results = await batch.execute(self.client)
        except BaseException as exc:
            for _, fut in pending:
                if not fut.done():
                    fut.set_exception(exc if isinstance(exc, Exception) else RedisConnectionError(str(exc)))
            if not isinstance(exc, Exception):
                raise
            return
        for (_, fut), res in zip(pending, results):
            if not fut.done():
                fut.set_result(res)
