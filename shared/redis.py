"""Redis connection helpers shared by gateway and workers."""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

__all__ = ["connect", "BROKER_ERRORS"]

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
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=2),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        max_connections=max_connections,
    )
    return aioredis.Redis(connection_pool=pool, auto_close_connection_pool=True)
