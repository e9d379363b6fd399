"""A token bucket, kept in Redis so that every gateway and worker draws on one budget
(docs/admission.md, "Rate limits"): the arithmetic without I/O (``TokenBucket``, tested
in memory) and its transcription as one Lua script (``TOKEN_BUCKET_LUA``), held to the
same answers by the tests.

A bucket (a hash ``{tokens, ts}``) holds up to ``burst`` tokens and refills continuously
at ``rate`` tokens a second. A take of ``cost`` is allowed when the bucket holds that
many; a forced take (work already done: the tokens a request generated, charged when it
ends) is always allowed and may leave the bucket below zero, a debt the refill pays back
before the next take is allowed. The script reads the clock with Redis ``TIME``, so
processes with skewed clocks agree, and the key expires once the bucket would be full
again: an idle key costs no memory and reads as a full bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["BucketDecision", "TokenBucket", "TOKEN_BUCKET_LUA", "EXPIRE_MARGIN_MS", "EPSILON", "bucket_args"]

#: kept past the moment the bucket is full again (ms) before the key expires
EXPIRE_MARGIN_MS = 1000
#: tokens short of ``cost`` that still count as enough: absorbs float rounding, so a
#: request made exactly ``retry_after_ms`` later is admitted
EPSILON = 1e-9


@dataclass(frozen=True, slots=True)
class BucketDecision:
    """Outcome of one take: ``retry_after_ms`` is 0 when allowed, ``ttl_ms`` is how long
    until the bucket is full again (plus the margin): the key's expiry."""

    allowed: bool
    tokens_left: float
    retry_after_ms: int
    ttl_ms: int


class TokenBucket:
    """Token-bucket arithmetic, no I/O; times are integer microseconds.

    Args:
        rate_per_s: tokens added per second (> 0).
        burst: capacity (>= 1); a new bucket starts full.
        tokens, ts_us: stored state, ``None`` for a new (or expired) bucket.
    """

    def __init__(self, rate_per_s: float, burst: int, tokens: float | None = None, ts_us: int | None = None) -> None:
        if not rate_per_s > 0 or burst < 1:
            raise ValueError("rate_per_s must be > 0 and burst >= 1")
        self.rate_per_s = float(rate_per_s)
        self.burst = burst
        self.tokens = tokens
        self.ts_us = ts_us

    def take(self, now_us: int, cost: float = 1, *, force: bool = False) -> BucketDecision:
        """Refill up to ``now_us``, then take ``cost`` tokens if there are that many;
        ``force``: take them whatever is left, the bucket going below zero (a debt the
        refill pays back before the next take is allowed): work already done, charged
        after the fact."""
        rate_us = self.rate_per_s / 1e6
        burst = float(self.burst)
        tokens = burst
        if self.tokens is not None and self.ts_us is not None:
            elapsed = now_us - self.ts_us
            if elapsed < 0:  # the clock went back (Redis failover): refill nothing
                elapsed = 0
            tokens = min(burst, self.tokens + elapsed * rate_us)
        allowed = force or tokens + EPSILON >= cost
        if force:
            tokens = min(burst, tokens - cost)
            retry = 0
        elif allowed:  # (a negative cost gives tokens back: ``RateLimiter.refund``)
            tokens = min(burst, max(0.0, tokens - cost))
            retry = 0
        else:
            retry = math.ceil((cost - EPSILON - tokens) / rate_us / 1000)
        ttl = math.ceil((burst - tokens) / rate_us / 1000) + EXPIRE_MARGIN_MS
        self.tokens, self.ts_us = tokens, now_us
        return BucketDecision(allowed, tokens, retry, ttl)


#: KEYS[1] bucket hash; ARGV rate per second, burst, cost, expiry margin ms, force 0|1,
#: [now µs: tests only, else Redis TIME] -> {allowed 0|1, tokens left (string),
#: retry_after_ms, ttl_ms}
TOKEN_BUCKET_LUA = """
if redis.replicate_commands then redis.replicate_commands() end
local rate_us = tonumber(ARGV[1]) / 1e6
local burst = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local now
if ARGV[6] then
  now = tonumber(ARGV[6])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = burst
local stored, ts = tonumber(state[1]), tonumber(state[2])
if stored and ts then
  local elapsed = now - ts
  if elapsed < 0 then elapsed = 0 end
  tokens = math.min(burst, stored + elapsed * rate_us)
end
local allowed, retry = 0, 0
if ARGV[5] == '1' then
  tokens = math.min(burst, tokens - cost)
  allowed = 1
elseif tokens + 1e-9 >= cost then
  tokens = math.min(burst, math.max(0, tokens - cost))
  allowed = 1
else
  retry = math.ceil((cost - 1e-9 - tokens) / rate_us / 1000)
end
local ttl = math.ceil((burst - tokens) / rate_us / 1000) + tonumber(ARGV[4])
redis.call('HSET', KEYS[1], 'tokens', string.format('%.17g', tokens), 'ts', string.format('%.17g', now))
redis.call('PEXPIRE', KEYS[1], ttl)
return {allowed, string.format('%.17g', tokens), retry, ttl}
"""


def bucket_args(rate_per_s: float, burst: int, cost: float, *, force: bool = False,
                now_us: int | None = None) -> list[str | int]:
    """``TOKEN_BUCKET_LUA``'s ARGV for one take (``now_us``: tests only, else Redis'
    clock), for every caller of the script: the gateway's ``RateLimiter`` and the
    worker's charge of what a request was served."""
    args: list[str | int] = [repr(float(rate_per_s)), burst, repr(float(cost)), EXPIRE_MARGIN_MS, int(force)]
    if now_us is not None:
        args.append(now_us)
    return args
