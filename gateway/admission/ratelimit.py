"""Shared rate limits: a token bucket per API key and a cap on concurrent streams, both
kept in Redis so every gateway process draws on one budget per key.

Token bucket (``{prefix}:rl:{key_id}``, a hash ``{tokens, ts}``): a bucket holds up to
``burst`` tokens and refills continuously at ``requests_per_minute / 60`` tokens per
second; a request takes one. The decision is one Lua script (EVALSHA), so concurrent
gateways cannot both spend the last token, and it reads the clock with Redis ``TIME``,
so gateways with skewed clocks still agree. The key expires once the bucket would be
full again: an idle key costs no memory and reads as a full bucket.

:class:`TokenBucket` is the same arithmetic without I/O (tested in memory); the script is
its transcription, and the tests hold them to the same answers.

Stream slots (``{prefix}:streams:{key_id}``, a sorted set ``request_id -> expiry ms``):
acquiring drops expired members, refuses when ``ZCARD >= max_streams``, else adds the
request. Members expire (10 min after they were taken or last refreshed: the worker
running a request refreshes its slot and gives it back when the request really ends,
whatever became of the client) so a fleet that lost track of a slot does not lock its key
out for good.

Connection slots (``{prefix}:conns:{key_id}``, the same structure and script, member
``connection_id``): WebSockets a key has open on every gateway, refreshed by their
gateway every 20 s and lapsing 60 s after the last refresh.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.asyncio as aioredis

from streamfleet.gateway.admission.auth import Identity
from streamfleet.shared.errors import ErrorCode, RefusedError, UnavailableError
from streamfleet.shared.keys import Keys
from streamfleet.shared.logging import get_logger
from streamfleet.shared.redis import BROKER_ERRORS, refresh_members
from streamfleet.shared.tiers import CONNECTION_SLOT_TTL_S, STREAM_SLOT_TTL_S, Tier
from streamfleet.shared.tokenbucket import TOKEN_BUCKET_LUA, BucketDecision, TokenBucket, bucket_args

__all__ = ["BucketDecision", "TokenBucket", "RateLimiter", "rate_limited", "tokens_limited", "TokensLimited",
           "StreamSlots", "ConnectionSlots", "TOKEN_BUCKET_LUA", "STREAM_SLOTS_LUA"]

log = get_logger("gateway.ratelimit")

#: retry hint when every stream slot is taken (a slot frees when a stream ends)
STREAMS_RETRY_AFTER_MS = 1000


class RateLimiter:
    """The per-key token bucket in Redis, shared by every gateway.

    Args:
        redis: an asyncio client (``shared.redis.connect``).
        keys: the key builder of this fleet's prefix.
    """

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._script = redis.register_script(TOKEN_BUCKET_LUA)

    async def take(self, key_id: str, tier: Tier, *, cost: int = 1,
                   _now_us: int | None = None) -> BucketDecision | None:
        """One atomic take from ``key_id``'s request bucket; ``None`` for a tier without
        a request rate (no Redis call). Does not raise on refusal: see
        ``decision.allowed``.

        Raises:
            ValueError: ``cost`` exceeds the tier's burst (it could never be allowed).
            UnavailableError: Redis cannot be reached.
        """
        if tier.unlimited:
            return None
        if cost > tier.burst:
            raise ValueError(f"cost {cost} exceeds the burst {tier.burst} of tier {tier.name}")
        assert tier.rate_per_s is not None
        return await self._bucket(self.keys.ratelimit(key_id), tier.rate_per_s, tier.burst, cost, False, _now_us)

    async def take_tokens(self, key_id: str, tier: Tier, cost: float, *, force: bool = False,
                          _now_us: int | None = None) -> BucketDecision | None:
        """One atomic take of ``cost`` tokens from ``key_id``'s token bucket (the tier's
        ``tokens_per_minute``); ``force``: whatever is left (tokens already served).
        ``None`` for a tier without a token rate (no Redis call).

        Raises:
            UnavailableError: Redis cannot be reached.
        """
        rate = tier.token_rate_per_s
        if rate is None:
            return None
        return await self._bucket(self.keys.token_ratelimit(key_id), rate, tier.token_capacity, cost, force,
                                  _now_us)

    async def _bucket(self, key: str, rate: float, burst: int, cost: float, force: bool,
                      now_us: int | None) -> BucketDecision:
        try:
            allowed, tokens, retry, ttl = await self._script(
                keys=[key], args=bucket_args(rate, burst, cost, force=force, now_us=now_us))
        except BROKER_ERRORS as exc:
            raise UnavailableError(f"cannot check the rate limit: Redis unavailable ({exc})") from exc
        return BucketDecision(bool(allowed), float(tokens), int(retry), int(ttl))

    async def check(self, identity_or_key_id: Identity | str, tier: Tier | None = None, *, cost: int = 1) -> None:
        """Admit one request of an API key, or refuse it.

        Args:
            identity_or_key_id: a ``gateway.admission.auth.Identity`` or a bare key id.
            tier: the key's tier (default: the identity's).

        Raises:
            RefusedError: 429 ``rate_limited`` with ``retry_after_ms``.
            UnavailableError: Redis cannot be reached.
        """
        if isinstance(identity_or_key_id, Identity):
            key_id, tier = identity_or_key_id.key_id, tier or identity_or_key_id.tier
        else:
            key_id = identity_or_key_id
            if tier is None:
                raise TypeError("check(key_id, tier): a bare key id needs its tier")
        decision = await self.take(key_id, tier, cost=cost)
        if decision is None or decision.allowed:
            return
        raise rate_limited(tier, decision.retry_after_ms,
                           "exceeded" if cost == 1 else f"has not {cost} requests left for the {cost} choices")

    async def refund(self, identity: Identity, cost: int) -> None:
        """Give ``cost`` requests back to the key's bucket (never past its burst): what a
        request of several choices took for those it could not start."""
        if cost > 0 and not identity.tier.unlimited:
            await self.take(identity.key_id, identity.tier, cost=-cost)


def _wait(ms: int) -> str:
    return f"{ms} ms" if ms < 100 else f"{ms / 1000:.1f} s"


def rate_limited(tier: Tier, retry_after_ms: int, what: str = "exceeded") -> RefusedError:
    """The 429 ``rate_limited`` refusal of a key of ``tier``, due again in ``retry_after_ms``."""
    return RefusedError(f"rate limit of {tier.requests_per_minute:g} requests/min for tier {tier.name} {what}; "
                        f"retry in {_wait(retry_after_ms)}", code=ErrorCode.rate_limited, retry_after_ms=retry_after_ms)


class TokensLimited(RefusedError):
    """``rate_limited`` by the token bucket (``tokens_per_minute``), not the request one."""


def tokens_limited(tier: Tier, retry_after_ms: int, tokens: int = 0) -> RefusedError:
    """The 429 ``rate_limited`` refusal of a key of ``tier`` out of tokens (its
    ``tokens_per_minute``): ``tokens`` the request needs, 0 when the bucket is in debt."""
    what = (f"has not the {tokens} tokens this request needs left" if tokens
            else "is spent (the tokens its earlier requests generated are being paid back)")
    return TokensLimited(f"token rate limit of {tier.tokens_per_minute:g} tokens/min for tier {tier.name} {what}; "
                        f"retry in {_wait(retry_after_ms)}", code=ErrorCode.rate_limited, retry_after_ms=retry_after_ms)


def lua_now_ms(arg: int) -> str:
    """The start of a script that reads the clock: ``now`` (ms) from ``ARGV[arg]`` when
    given (tests), else Redis ``TIME`` (every gateway reads one clock), with effects
    replication for the scripts that call ``TIME`` on Redis before 5.0."""
    return ("if redis.replicate_commands then redis.replicate_commands() end\n"
            f"local now\nif ARGV[{arg}] then\n  now = tonumber(ARGV[{arg}])\nelse\n"
            "  local t = redis.call('TIME')\n"
            "  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\nend\n")


#: KEYS[1] slots zset; ARGV request_id, max_streams, ttl_ms, [now ms: tests only]
#: -> {acquired 0|1, streams held (after)}
STREAM_SLOTS_LUA = lua_now_ms(4) + """local ttl = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held = redis.call('ZCARD', KEYS[1])
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  if held >= tonumber(ARGV[2]) then
    return {0, held}
  end
  held = held + 1
end
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('PEXPIRE', KEYS[1], ttl)
return {1, held}
"""


class StreamSlots:
    """Concurrent streams per API key, counted in Redis across gateways.

    Args:
        redis: an asyncio client.
        keys: the key builder of this fleet's prefix.
        ttl_s: a slot lapses this long after its last acquire/touch, so slots held by
            a gateway that died come back; touch longer streams before then.
    """

    #: what one slot is, for messages
    noun = "streams"

    def __init__(self, redis: aioredis.Redis, keys: Keys, *, ttl_s: float = STREAM_SLOT_TTL_S) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._script = redis.register_script(STREAM_SLOTS_LUA)

    def _key(self, key_id: str) -> str:
        return self.keys.streams(key_id)

    def _refusal(self, held: int, cap: int) -> RefusedError:
        return RefusedError(
            f"too many concurrent streams: {held} of {cap} allowed for this API key are open; "
            "wait for one to finish",
            code=ErrorCode.too_many_requests,
            retry_after_ms=STREAMS_RETRY_AFTER_MS,
        )

    async def acquire(self, key_id: str, request_id: str, max_streams: int | None, *,
                      _now_ms: int | None = None) -> bool:
        """Take a slot for ``request_id`` (idempotent: a held one is refreshed).

        Returns:
            True when a slot is now held (release it), False when ``max_streams`` is
            None (no cap, nothing held, no Redis call).

        Raises:
            RefusedError: 429 ``too_many_requests`` when all ``max_streams`` are taken.
            UnavailableError: Redis cannot be reached.
        """
        if max_streams is None:
            return False
        args: list[str | int] = [request_id, max_streams, self.ttl_ms]
        if _now_ms is not None:
            args.append(_now_ms)
        try:
            ok, held = await self._script(keys=[self._key(key_id)], args=args)
        except BROKER_ERRORS as exc:
            raise UnavailableError(f"cannot count open {self.noun}: Redis unavailable ({exc})") from exc
        if not ok:
            raise self._refusal(int(held), max_streams)
        return True

    async def touch(self, key_id: str, request_id: str) -> None:
        """Push a held slot's expiry ``ttl_s`` into the future (for streams that may run
        longer than ``ttl_s``); a slot that already lapsed is not revived."""
        await self.touch_many([(key_id, request_id)])

    async def touch_many(self, held: list[tuple[str, str]]) -> None:
        """``touch`` for many ``(key_id, member)`` pairs in one round trip. Never raises:
        a slot that cannot be refreshed lapses after ``ttl_s``."""
        if not held:
            return
        try:
            expiry = await self._now_ms() + self.ttl_ms
            await refresh_members(self.redis, [(self._key(k), m) for k, m in held], expiry, self.ttl_ms)
        except BROKER_ERRORS as exc:
            log.warning("could not refresh slots", what=self.noun, count=len(held), error=str(exc))

    async def release(self, key_id: str, request_id: str) -> None:
        """Give a slot back. Never raises: a slot that cannot be released lapses after
        ``ttl_s``."""
        try:
            await self.redis.zrem(self._key(key_id), request_id)
        except BROKER_ERRORS as exc:
            log.warning("could not release a slot", what=self.noun, key_id=key_id, member=request_id,
                        error=str(exc))

    async def count(self, key_id: str) -> int:
        """Slots held now (expired members excluded)."""
        now_ms = await self._now_ms()
        return int(await self.redis.zcount(self._key(key_id), f"({now_ms}", "+inf"))

    async def _now_ms(self) -> int:
        seconds, micros = await self.redis.time()  # Redis's clock, as the script uses
        return int(seconds) * 1000 + int(micros) // 1000

    @asynccontextmanager
    async def hold(self, key_id: str, request_id: str, max_streams: int | None) -> AsyncIterator[None]:
        """``acquire`` on entry, ``release`` on exit."""
        held = await self.acquire(key_id, request_id, max_streams)
        try:
            yield
        finally:
            if held:
                await self.release(key_id, request_id)


class ConnectionSlots(StreamSlots):
    """Open WebSockets per API key, counted in Redis across gateways (members are
    connection ids; the gateway holding one refreshes it with ``touch_many``)."""

    noun = "connections"

    def __init__(self, redis: aioredis.Redis, keys: Keys, *, ttl_s: float = CONNECTION_SLOT_TTL_S) -> None:
        super().__init__(redis, keys, ttl_s=ttl_s)

    def _key(self, key_id: str) -> str:
        return self.keys.connections(key_id)

    def _refusal(self, held: int, cap: int) -> RefusedError:
        return RefusedError(
            f"too many open connections: {held} of {cap} allowed for this API key are open on this fleet; "
            "close one, or send more requests over each",
            code=ErrorCode.too_many_requests,
            retry_after_ms=STREAMS_RETRY_AFTER_MS,
        )
