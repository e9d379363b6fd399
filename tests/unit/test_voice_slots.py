"""Fair voice slots without I/O (gateway/admission/voiceslots.py; docs/voice.md, "Fair slots"): the
fair share, the reserve, the tier cap, turns, and what lapses. The Redis script is held
to the same answers in tests/integration/test_voice_slots.py."""

from __future__ import annotations

from streamfleet.gateway.admission.voiceslots import SlotTable, Waiter, capacity_of, fair_share, next_grants
from streamfleet.shared.schema import Heartbeat


def ask_all(table: SlotTable, members: list[str], capacity: int, now: int, reserve: int = 1, cap: int = 0) -> list[str]:
    return [m for m in members if table.ask(m, cap, capacity, reserve, now)[0]]


def test_fair_share():
    assert [fair_share(4, t) for t in (1, 2, 3, 4, 5)] == [2, 2, 1, 1, 1]
    assert [fair_share(2, t) for t in (1, 2, 3)] == [1, 1, 1]
    assert fair_share(1, 1) == 1 and fair_share(12, 3) == 4


def test_one_tenant_alone_leaves_a_slot_for_the_next():
    """Four sockets of one key talking on a fleet of four slots: three granted (its share
    of two, one more while another stays free), the fourth waits; another key's
    utterance then gets the free slot at once."""
    t = SlotTable()
    attacker = [f"key:a|{i}" for i in range(4)]
    assert ask_all(t, attacker, 4, now=0) == attacker[:3]
    assert t.ask("key:b|0", 0, 4, 1, now_ms=10) == (True, 4)
    assert not t.ask(attacker[3], 0, 4, 1, now_ms=20)[0]


def test_a_two_slot_fleet_holds_one_per_tenant_and_the_reserve_can_be_off():
    t = SlotTable()
    assert ask_all(t, ["conn:x|0", "conn:x|1"], 2, now=0) == ["conn:x|0"]
    assert t.ask("conn:y|0", 0, 2, 1, 1)[0]
    t = SlotTable()
    assert ask_all(t, ["conn:x|0", "conn:x|1"], 2, now=0, reserve=0) == ["conn:x|0", "conn:x|1"]


def test_waiting_tenants_are_served_in_turn():
    """A full fleet; when slots free up, the tenant holding the fewest goes first, then
    the one that has waited longest, whatever order they ask in."""
    t = SlotTable()
    held = ["key:a|0", "key:a|1", "key:b|0", "key:c|0"]
    for m in held:
        t.held[m] = 10**9
    assert not t.ask("key:a|2", 0, 4, 1, 0)[0]  # a waits first...
    assert not t.ask("key:d|0", 0, 4, 1, 5)[0]  # ...then d, which holds nothing
    assert not t.ask("key:b|1", 0, 4, 1, 6)[0]
    t.release("key:a|0")
    # one slot: d's turn (holds 0), though a and b asked before and ask again first
    assert not t.ask("key:a|2", 0, 4, 1, 10)[0]
    assert not t.ask("key:b|1", 0, 4, 1, 10)[0]
    assert t.ask("key:d|0", 0, 4, 1, 10)[0]
    t.release("key:c|0")
    # one slot, and a, b and d hold one each, their share of 4 among 3: the reserve keeps
    # it for a tenant that starts speaking next
    assert not t.ask("key:b|1", 0, 4, 1, 20)[0] and not t.ask("key:a|2", 0, 4, 1, 20)[0]
    # without a reserve it goes to one of them: a, which has waited longest
    assert not t.ask("key:b|1", 0, 4, 0, 20)[0]
    assert t.ask("key:a|2", 0, 4, 0, 20)[0]


def test_next_grants_orders_the_whole_queue():
    waiting = [Waiter("key:a|1", 0), Waiter("key:a|2", 1), Waiter("key:b|1", 2), Waiter("key:c|1", 3)]
    # 6 slots, a holds 2, b holds 1: share 6 // 3 tenants = 2
    assert next_grants(["key:a|0", "key:a|9", "key:b|0"], waiting, 6, 1) == ["key:c|1", "key:b|1"]
    # with no reserve, a may take the last one beyond its share
    assert next_grants(["key:a|0", "key:a|9", "key:b|0"], waiting, 6, 0) == ["key:c|1", "key:b|1", "key:a|1"]


def test_a_tiers_cap_holds_whatever_the_share():
    t = SlotTable()
    assert ask_all(t, [f"key:a|{i}" for i in range(4)], 16, now=0, cap=2) == ["key:a|0", "key:a|1"]
    waiting = [Waiter("key:a|5", 0, cap=1)]
    assert next_grants([], waiting, 8, 1) == ["key:a|5"]
    assert next_grants(["key:a|0"], waiting, 8, 1) == []


def test_grants_and_places_lapse():
    """A gateway that died: its grants lapse after their TTL, its waiting utterances'
    places after theirs, and neither blocks anyone for longer."""
    t = SlotTable(held_ttl_ms=30_000, wait_ttl_ms=2_000)
    assert t.ask("key:a|0", 0, 1, 1, 0)[0]
    assert not t.ask("key:b|0", 0, 1, 1, 100)[0]
    assert not t.ask("key:c|0", 0, 1, 1, 200)[0]
    # b's gateway dies at once (b never asks again); a's grant lapses
    assert not t.ask("key:c|0", 0, 1, 1, 29_000)[0]
    assert t.ask("key:c|0", 0, 1, 1, 30_001) == (True, 1)  # b's place lapsed long ago: c's turn
    assert "key:b|0" not in t.waiting and "key:b|0" not in t.turns


def test_capacity_unknown_grants_and_a_held_grant_is_kept():
    t = SlotTable()
    assert ask_all(t, ["key:a|0", "key:a|1", "key:a|2"], 0, now=0) == ["key:a|0", "key:a|1", "key:a|2"]
    assert t.ask("key:a|0", 0, 1, 1, 5) == (True, 3)  # asked again: still held, refreshed


def test_capacity_counts_live_workers_that_take_work():
    beats = [Heartbeat(heartbeat=1.0, max_batch=2), Heartbeat(heartbeat=1.0, max_batch=4, draining=True),
             Heartbeat(heartbeat=1.0, max_batch=3)]
    assert capacity_of(beats) == 5 and capacity_of([]) == 0


def test_continuous_speakers_do_not_starve_a_newcomer():
    """A time-stepped fleet of 4 slots: key a's four sockets each hold an utterance of 10 s
    and start the next as soon as one ends; key b starts a 2 s utterance every 7 s. Every
    b utterance gets a slot at its first ask; a never holds more than three."""
    t = SlotTable()
    ends: dict[str, int] = {}  # granted utterance -> when it ends
    a_waiting = [f"key:a|{sock}-0" for sock in range(4)]
    b_waits, a_most = [], 0
    for now in range(0, 120_000, 100):
        for m in [m for m, end in ends.items() if end <= now]:
            t.release(m)
            del ends[m]
            if m.startswith("key:a|"):
                sock, k = m.split("|")[1].split("-")
                a_waiting.append(f"key:a|{sock}-{int(k) + 1}")
        for m in list(a_waiting):
            if t.ask(m, 0, 4, 1, now)[0]:
                a_waiting.remove(m)
                ends[m] = now + 10_000
        if now % 7_000 == 0:
            member = f"key:b|{now}"
            b_waits.append(t.ask(member, 0, 4, 1, now)[0])
            ends[member] = now + 2_000
        a_most = max(a_most, sum(m.startswith("key:a|") for m in t.held))
    assert len(b_waits) == 18 and all(b_waits), b_waits
    assert a_most == 3


def test_a_tier_may_cap_its_keys_utterances():
    import pytest

    from streamfleet.shared.errors import FatalError
    from streamfleet.shared.tiers import parse_tiers

    tiers = parse_tiers('{"paid": {"max_utterances": 2}}')
    assert tiers["paid"].max_utterances == 2 and tiers["free"].max_utterances is None
    with pytest.raises(FatalError, match="max_utterances must be"):
        parse_tiers('{"free": {"max_utterances": 0}}')
