"""Takeover: a worker is dead only after its heartbeat stood still while we kept looking."""

from __future__ import annotations

from streamfleet.workers.process import Takeover


def test_a_silent_worker_is_dead_after_the_threshold():
    t = Takeover(1.5)
    now = 100.0
    for i in range(20):  # we look every 0.25 s; w1 beats every 0.5 s, w2 stops at once
        t.observe({"w1": b"%d" % (i // 2), "w2": b"0"}, now)
        now += 0.25
    assert not t.dead("w1", now)
    assert t.dead("w2", now)


def test_a_stall_that_held_up_every_heartbeat_kills_nobody():
    t = Takeover(1.5)
    t.observe({"w1": b"a"}, 100.0)
    t.observe({"w1": b"a"}, 100.25)
    # Redis stalled 8 s: our own next look comes late, and w1's heartbeat has not moved yet
    t.observe({"w1": b"a"}, 108.25)
    assert not t.dead("w1", 108.5)
    t.observe({"w1": b"a"}, 108.5)
    t.observe({"w1": b"a"}, 108.75)
    t.observe({"w1": b"a"}, 109.0)
    t.observe({"w1": b"a"}, 109.5)
    assert not t.dead("w1", 109.5)
    for now in (109.75, 110.0):
        t.observe({"w1": b"a"}, now)
    assert t.dead("w1", 110.0)  # 1.75 s of watched silence after the stall


def test_a_consumer_without_any_heartbeat_gets_a_clock_from_first_sight():
    t = Takeover(1.5)
    t.observe({}, 100.0)
    assert not t.dead("ghost", 100.0)
    for now in (100.25, 100.5, 100.75, 101.0, 101.25, 101.5):
        t.observe({}, now)
    assert t.dead("ghost", 101.5)
