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

    Blocking commands (XREADGROUP BLOCK, pub/sub reads) must use a per-call timeout
    that exceeds their block time; the socket timeout guards everything else.
    """
    return aioredis.from_url(
        url,
        decode_responses=False,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_timeout,
        health_check_interval=15,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=2),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        max_connections=max_connections,
    )
