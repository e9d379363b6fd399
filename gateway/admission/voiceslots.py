"""Fair voice slots (docs/voice.md, "Fair slots"): which utterance takes one of the
speech workers' decoder slots next, decided in Redis for every gateway at once.

Utterances used to queue in their model's lanes, first come, first served, and a worker
slot, once taken, is held for the whole utterance (up to ``SF_MAX_UTTERANCE_S``): a
tenant talking without pause on a few sockets held every slot, and another tenant's
utterance waited behind its 30-second ones. Now an utterance takes a *grant* before its
task is enqueued. Grants stand for the fleet's decoder slots, ``C``: the ``max_batch``
of the model's live workers that are not draining, from their heartbeats. The rules:

1. **Fair share.** A tenant (an API key; a connection with auth off) may hold
   ``max(1, C // max(T, 2))`` grants, ``T`` being the tenants holding or waiting for
   one. A tenant alone counts as one of two: it never takes more than half of the slots
   by right, so the next tenant to speak finds one free.
2. **Reserve.** Beyond its share a tenant takes a free slot only while
   ``SF_VOICE_RESERVED_SLOTS`` (1) more stay free.
3. **Cap.** Its tier's ``max_utterances`` caps a key outright.
4. **Turns.** When slots are short, waiting utterances get them in turn: the tenant
   holding the fewest first, then the one waiting longest.

No grant is taken back: a tenant over its share (others arrived) keeps what it holds
until those utterances end, and then waits its turn. A grant goes back when the
utterance's final (or error) reaches its gateway, and lapses ``GRANT_TTL_S`` after its
gateway last refreshed it (every third of that), so the grants of a gateway that died
come back. A waiting utterance asks again every ``POLL_S``; its place lapses
``WAIT_TTL_S`` after its last ask (its gateway died, or it stopped waiting).

``SlotTable`` is the decision without I/O (tested in memory); ``VOICE_SLOTS_LUA`` is its
transcription, one atomic script per ask, and the tests hold them to the same answers.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import anyio
import redis.asyncio as aioredis

from streamfleet.gateway.admission.ratelimit import lua_now_ms
from streamfleet.shared import aio
from streamfleet.shared.errors import ErrorCode, GenerationError, UnavailableError
from streamfleet.shared.keys import Keys
from streamfleet.shared.logging import get_logger
from streamfleet.shared.redis import BROKER_ERRORS, refresh_members
from streamfleet.shared.schema import Heartbeat

__all__ = ["SlotTable", "VoiceSlots", "Waiter", "capacity_of", "fair_share", "next_grants", "VOICE_SLOTS_LUA",
           "GRANT_TTL_S", "WAIT_TTL_S", "POLL_S"]

log = get_logger("gateway.voiceslots")

#: a grant lapses this long after its gateway last refreshed it (it refreshes every third)
GRANT_TTL_S = 30.0
#: a waiting utterance's place lapses this long after its last ask
WAIT_TTL_S = 2.0
#: a waiting utterance asks again this often
POLL_S = 0.1
#: the live workers' slots are read at most this often per model
CAPACITY_READ_S = 1.0


def tenant_of(member: str) -> str:
    """``tenant|utterance`` -> ``tenant``."""
    return member.rpartition("|")[0] or member


def fair_share(capacity: int, tenants: int) -> int:
    """Grants a tenant may hold by right: ``max(1, C // max(T, 2))``."""
    return max(1, capacity // max(tenants, 2))


@dataclass(frozen=True, slots=True)
class Waiter:
    """An utterance waiting for a grant: ``cap`` is its key's ``max_utterances`` (0 = none)."""

    member: str
    since_ms: int
    cap: int = 0

    @property
    def tenant(self) -> str:
        return tenant_of(self.member)


def next_grants(held: list[str], waiting: list[Waiter], capacity: int, reserve: int) -> list[str]:
    """The waiting utterances that get a slot now, in the order they get one (rules 1–4
    of the module's docstring); ``held`` are the members holding a grant."""
    counts: dict[str, int] = {}
    for m in held:
        counts[tenant_of(m)] = counts.get(tenant_of(m), 0) + 1
    tenants = set(counts) | {w.tenant for w in waiting}
    share = fair_share(capacity, len(tenants))
    free = capacity - len(held)
    left = list(waiting)
    out: list[str] = []
    while free > 0:
        best: tuple[int, int, str] | None = None
        pick: Waiter | None = None
        for w in left:
            h = counts.get(w.tenant, 0)
            if (w.cap and h >= w.cap) or not (h < share or free - 1 >= reserve):
                continue
            rank = (h, w.since_ms, w.member)
            if best is None or rank < best:
                best, pick = rank, w
        if pick is None:
            break
        out.append(pick.member)
        left.remove(pick)
        counts[pick.tenant] = counts.get(pick.tenant, 0) + 1
        free -= 1
    return out


class SlotTable:
    """The grants and the waiting utterances of one model, in memory: what the script
    keeps in Redis, with the same ``ask`` and ``release``. Times are integer ms."""

    def __init__(self, held_ttl_ms: int = int(GRANT_TTL_S * 1000), wait_ttl_ms: int = int(WAIT_TTL_S * 1000)) -> None:
        self.held_ttl_ms = held_ttl_ms
        self.wait_ttl_ms = wait_ttl_ms
        self.held: dict[str, int] = {}  # member -> expiry
        self.waiting: dict[str, int] = {}  # member -> expiry
        self.turns: dict[str, tuple[int, int]] = {}  # member -> (since, cap)

    def ask(self, member: str, cap: int, capacity: int, reserve: int, now_ms: int) -> tuple[bool, int]:
        """One ask of ``member`` (``cap``: its key's ``max_utterances``, 0 = none;
        ``capacity`` 0: unknown, every ask is granted). Returns (granted, grants held)."""
        self.held = {m: t for m, t in self.held.items() if t > now_ms}
        for m in [m for m, t in self.waiting.items() if t <= now_ms]:
            del self.waiting[m]
            self.turns.pop(m, None)
        if member in self.held or capacity <= 0:
            return self._grant(member, now_ms), len(self.held)
        self.waiting[member] = now_ms + self.wait_ttl_ms
        self.turns.setdefault(member, (now_ms, cap))
        if len(self.held) >= capacity:
            return False, len(self.held)
        waiters = [Waiter(m, *self.turns.get(m, (now_ms, 0))) for m in self.waiting]
        if member in next_grants(list(self.held), waiters, capacity, reserve):
            return self._grant(member, now_ms), len(self.held)
        return False, len(self.held)

    def _grant(self, member: str, now_ms: int) -> bool:
        self.waiting.pop(member, None)
        self.turns.pop(member, None)
        self.held[member] = now_ms + self.held_ttl_ms
        return True

    def release(self, member: str) -> None:
        """Give a grant back, or stop waiting for one."""
        self.held.pop(member, None)
        self.waiting.pop(member, None)
        self.turns.pop(member, None)


#: KEYS[1] grants zset, KEYS[2] waiting zset (member -> expiry ms), KEYS[3] turns hash
#: (member -> "since_ms cap"); ARGV member, cap (0 = none), capacity (0 = unknown: grant),
#: reserve, grant ttl ms, wait ttl ms, [now ms: tests only] -> {granted 0|1, grants held}
VOICE_SLOTS_LUA = lua_now_ms(7) + """local member, cap = ARGV[1], tonumber(ARGV[2])
local capacity, reserve = tonumber(ARGV[3]), tonumber(ARGV[4])
local held_ttl, wait_ttl = tonumber(ARGV[5]), tonumber(ARGV[6])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do
  redis.call('HDEL', KEYS[3], m)
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local function tenant(m)
  return string.match(m, '^(.*)|[^|]*$') or m
end
local held = redis.call('ZRANGE', KEYS[1], 0, -1)
local function grant()
  redis.call('ZREM', KEYS[2], member)
  redis.call('HDEL', KEYS[3], member)
  local fresh = redis.call('ZADD', KEYS[1], now + held_ttl, member)
  redis.call('PEXPIRE', KEYS[1], held_ttl)
  return {1, #held + fresh}
end
if redis.call('ZSCORE', KEYS[1], member) or capacity <= 0 then
  return grant()
end
redis.call('ZADD', KEYS[2], now + wait_ttl, member)
redis.call('HSETNX', KEYS[3], member, now .. ' ' .. cap)
redis.call('PEXPIRE', KEYS[2], wait_ttl)
redis.call('PEXPIRE', KEYS[3], wait_ttl)
local free = capacity - #held
if free <= 0 then
  return {0, #held}
end
local counts, tenants, ntenants = {}, {}, 0
for _, m in ipairs(held) do
  local t = tenant(m)
  counts[t] = (counts[t] or 0) + 1
  if not tenants[t] then tenants[t] = true; ntenants = ntenants + 1 end
end
local ws = {}
for _, m in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  local since, c = now, 0
  local info = redis.call('HGET', KEYS[3], m)
  if info then
    local a, b = string.match(info, '^(%S+) (%S+)$')
    since, c = tonumber(a), tonumber(b)
  end
  local t = tenant(m)
  if not tenants[t] then tenants[t] = true; ntenants = ntenants + 1 end
  ws[#ws + 1] = {m, t, since, c}
end
local share = math.max(1, math.floor(capacity / math.max(ntenants, 2)))
local picked = {}
while free > 0 do
  local best, bh, bs, bm = nil, 0, 0, ''
  for i, w in ipairs(ws) do
    if not picked[i] then
      local h = counts[w[2]] or 0
      if (w[4] == 0 or h < w[4]) and (h < share or free - 1 >= reserve) then
        if best == nil or h < bh or (h == bh and (w[3] < bs or (w[3] == bs and w[1] < bm))) then
          best, bh, bs, bm = i, h, w[3], w[1]
        end
      end
    end
  end
  if best == nil then break end
  if bm == member then
    return grant()
  end
  picked[best] = true
  counts[ws[best][2]] = bh + 1
  free = free - 1
end
return {0, #held}
"""


class VoiceSlots:
    """The fair grants of this gateway's utterances, in Redis (one ``VOICE_SLOTS_LUA``
    per ask), and the refresh of those it holds.

    Args:
        redis: the broker's asyncio client.
        keys: the key builder of this fleet.
        capacity: ``async (model) -> slots``: the decoder slots of the model's live
            workers (0 when none is known: then nothing waits).
        reserve: ``SF_VOICE_RESERVED_SLOTS``.
    """

    def __init__(self, redis: aioredis.Redis, keys: Keys, capacity: Callable[[str], Awaitable[int]], *,
                 reserve: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        self.redis = redis
        self.keys = keys
        self.reserve = reserve
        self._read_capacity = capacity
        self._clock = clock
        self._script = redis.register_script(VOICE_SLOTS_LUA)
        self._capacity: dict[str, tuple[float, int]] = {}  # model -> (read at, slots)
        self._capacity_reads: dict[str, asyncio.Future[int]] = {}
        self._held: dict[tuple[str, str], None] = {}  # (model, member) granted here
        self._refresher: asyncio.Task[None] | None = None

    # -- the fleet's slots ----------------------------------------------------------------
    async def capacity(self, model: str) -> int:
        """The model's decoder slots, read at most every ``CAPACITY_READ_S``; one read
        however many utterances ask at once."""
        now = self._clock()
        known = self._capacity.get(model)
        if known is not None and now - known[0] < CAPACITY_READ_S:
            return known[1]
        read = self._capacity_reads.get(model)
        if read is None:
            read = asyncio.ensure_future(self._read(model))
            read.add_done_callback(aio.mark_retrieved)  # (a read nobody awaits any more)
            self._capacity_reads[model] = read
        return await asyncio.shield(read)

    async def _read(self, model: str) -> int:
        try:
            slots = int(await self._read_capacity(model))
        finally:
            self._capacity_reads.pop(model, None)
        self._capacity[model] = (self._clock(), slots)
        return slots

    # -- grants ---------------------------------------------------------------------------
    async def ask(self, model: str, member: str, cap: int | None = None) -> bool:
        """One ask: True when ``member`` holds a grant now (keep it until ``release``).

        Raises:
            UnavailableError: Redis cannot be reached.
        """
        try:
            capacity = await self.capacity(model)
            ok, _ = await self._script(keys=list(self.keys.voice_slots(model)),
                                       args=[member, cap or 0, capacity, self.reserve,
                                             int(GRANT_TTL_S * 1000), int(WAIT_TTL_S * 1000)])
        except BROKER_ERRORS as exc:
            raise UnavailableError(f"cannot share the speech slots: Redis unavailable ({exc})") from exc
        if ok:
            self._hold(model, member)
        return bool(ok)

    async def acquire(self, model: str, tenant: str, cap: int | None, *, timeout_s: float,
                      warn_after_s: float | None = None,
                      on_warn: Callable[[], Awaitable[None]] | None = None) -> str:
        """Wait for a grant, asking every ``POLL_S``; returns the member that holds it
        (``release`` it). ``on_warn`` is awaited once the wait reaches ``warn_after_s``.

        Raises:
            GenerationError: ``timeout`` — no grant within ``timeout_s``.
            UnavailableError: Redis cannot be reached.
        """
        member = f"{tenant}|{uuid.uuid4().hex}"
        started = self._clock()
        try:
            while not await self.ask(model, member, cap):
                waited = self._clock() - started
                if waited >= timeout_s:
                    raise GenerationError(f"this utterance waited {timeout_s:g} s for a speech worker slot; other "
                                          f"tenants' utterances held them all", code=ErrorCode.timeout)
                if on_warn is not None and warn_after_s is not None and waited >= warn_after_s:
                    warn, on_warn = on_warn, None
                    await warn()
                await asyncio.sleep(POLL_S)
        except BaseException:
            await self.release(model, member)
            raise
        waited = self._clock() - started
        if waited >= POLL_S:
            log.info("utterance waited its turn for a speech slot", model=model, waited_s=round(waited, 2))
        return member

    async def release(self, model: str, member: str) -> None:
        """Give a grant back (or stop waiting for one). Never raises: a grant that cannot
        be given back lapses after ``GRANT_TTL_S``."""
        self._held.pop((model, member), None)
        held, waiting, turns = self.keys.voice_slots(model)
        with anyio.CancelScope(shield=True):
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.zrem(held, member)
                    pipe.zrem(waiting, member)
                    pipe.hdel(turns, member)
                    await pipe.execute()
            except BROKER_ERRORS as exc:
                log.warning("could not give a speech slot back", model=model, error=str(exc))

    def held(self) -> list[tuple[str, str]]:
        """``(model, member)`` of the grants this gateway holds."""
        return list(self._held)

    def _hold(self, model: str, member: str) -> None:
        self._held[(model, member)] = None
        if self._refresher is None or self._refresher.done():
            self._refresher = asyncio.create_task(self._refresh(), name="voice-slots-refresh")

    async def _refresh(self) -> None:
        """While this gateway holds grants: push their expiry ``GRANT_TTL_S`` ahead every
        third of it."""
        ttl_ms = int(GRANT_TTL_S * 1000)
        while self._held:
            await asyncio.sleep(GRANT_TTL_S / 3)
            held = list(self._held)
            if not held:
                break
            try:
                seconds, micros = await self.redis.time()
                expiry = int(seconds) * 1000 + int(micros) // 1000 + ttl_ms
                await refresh_members(self.redis, [(self.keys.voice_slots(m)[0], member) for m, member in held],
                                      expiry, ttl_ms)
            except BROKER_ERRORS as exc:
                log.warning("could not refresh speech slots", count=len(held), error=str(exc))

    async def stop(self) -> None:
        await aio.cancel_and_wait(self._refresher)


def capacity_of(heartbeats: Iterable[Heartbeat]) -> int:
    """The decoder slots of live workers that take new work (not draining)."""
    return sum(max(0, int(hb.max_batch)) for hb in heartbeats if not hb.draining)

