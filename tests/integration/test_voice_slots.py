"""Fair voice slots against a real redis-server (gateway/admission/voiceslots.py): the script gives
the in-memory ``SlotTable``'s answers, and ``VoiceSlots`` waits its turn, refreshes and
gives back grants."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from streamfleet.gateway.admission.voiceslots import POLL_S, VOICE_SLOTS_LUA, SlotTable, VoiceSlots
from streamfleet.shared.errors import ErrorCode, GenerationError
from streamfleet.shared.keys import Keys
from streamfleet.shared.redis import connect
from tests.support.wait import until_async


@pytest.fixture
async def ards(redis_server):
    client = connect(redis_server.url)
    yield client
    await client.aclose()


def test_the_script_decides_as_the_table_does(rds, key_prefix):
    keys = Keys(key_prefix)
    held_key, waiting_key, turns_key = keys.voice_slots("asr-en")
    script = rds.register_script(VOICE_SLOTS_LUA)
    rng = random.Random(7)
    table = SlotTable(held_ttl_ms=3_000, wait_ttl_ms=400)
    members = [f"key:{t}|{i}" for t in "abcde" for i in range(4)]
    now = 1_000_000
    for step in range(1500):
        now += rng.choice((0, 10, 50, 200))
        member = rng.choice(members)
        if rng.random() < 0.2:
            table.release(member)
            rds.zrem(held_key, member)
            rds.zrem(waiting_key, member)
            rds.hdel(turns_key, member)
            continue
        cap = rng.choice((0, 0, 1, 2))
        capacity = rng.choice((0, 2, 3, 4, 4, 6))
        reserve = rng.choice((0, 1, 1, 2))
        want = table.ask(member, cap, capacity, reserve, now)
        got = script(keys=[held_key, waiting_key, turns_key],
                     args=[member, cap, capacity, reserve, table.held_ttl_ms, table.wait_ttl_ms, now])
        assert (bool(got[0]), got[1]) == want, (step, member, capacity, reserve)
        live = {m.decode() for m in rds.zrangebyscore(held_key, f"({now}", "+inf")}
        assert live == set(table.held), step
        waiting = {m.decode() for m in rds.zrangebyscore(waiting_key, f"({now}", "+inf")}
        assert waiting == set(table.waiting), step


async def test_a_waiter_gets_the_slot_given_back_in_turn(ards, key_prefix):
    slots = VoiceSlots(ards, Keys(key_prefix), lambda model: _const(2))
    a0 = await slots.acquire("asr-en", "key:a", None, timeout_s=5)
    b0 = await slots.acquire("asr-en", "key:b", None, timeout_s=5)  # a's share is one of two
    assert len(slots.held()) == 2
    _, waiting_key, _ = Keys(key_prefix).voice_slots("asr-en")

    async def waiters(n: int) -> bool:
        return await ards.zcard(waiting_key) == n

    waiting_a = asyncio.create_task(slots.acquire("asr-en", "key:a", None, timeout_s=10))
    await until_async(lambda: waiters(1), "a waiting")  # a waits first
    waiting_c = asyncio.create_task(slots.acquire("asr-en", "key:c", None, timeout_s=10))
    await until_async(lambda: waiters(2), "c waiting")
    assert not waiting_a.done() and not waiting_c.done()
    t0 = time.monotonic()
    await slots.release("asr-en", b0)
    # c holds nothing and a holds one: c's turn, though a has waited longer
    c0 = await asyncio.wait_for(waiting_c, 2)
    assert time.monotonic() - t0 < POLL_S * 3 and c0.startswith("key:c|")
    assert not waiting_a.done()
    await slots.release("asr-en", a0)
    a1 = await asyncio.wait_for(waiting_a, 2)
    for m in (a1, c0):
        await slots.release("asr-en", m)
    assert slots.held() == [] and not await ards.zcard(Keys(key_prefix).voice_slots("asr-en")[0])
    await slots.stop()


async def test_a_wait_past_its_deadline_fails_and_leaves_no_place(ards, key_prefix):
    keys = Keys(key_prefix)
    slots = VoiceSlots(ards, keys, lambda model: _const(1))
    held = await slots.acquire("asr-en", "key:a", None, timeout_s=5)
    warned = []

    async def warn():
        warned.append(time.monotonic())

    with pytest.raises(GenerationError) as e:
        await slots.acquire("asr-en", "key:b", None, timeout_s=0.6, warn_after_s=0.2, on_warn=warn)
    assert e.value.code == ErrorCode.timeout and len(warned) == 1
    assert not await ards.zcard(keys.voice_slots("asr-en")[1]) and not await ards.hlen(keys.voice_slots("asr-en")[2])
    await slots.release("asr-en", held)
    await slots.stop()


async def _const(n: int) -> int:
    return n
