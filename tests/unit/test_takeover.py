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


# -- a replacement worker trusts the age a heartbeat states (issue 37) ------------------------
def _beat(written: float) -> bytes:
    from streamfleet.shared.schema import Heartbeat

    return Heartbeat(heartbeat=written, pid=1).encode()


def test_a_replacement_takes_over_once_the_dead_workers_heartbeat_is_old_enough_not_a_full_wait():
    """A worker started 1.2 s after another died finds its heartbeat 1.2 s old: it is
    dead after the short watch (0.75 s), not 1.5 s after this worker's first look."""
    t = Takeover(1.5, min_watch_s=0.75)
    wall, now = 1_000_000.0, 100.0
    dead_beat = _beat(wall - 1.2)
    for dt in (0.0, 0.25, 0.5):
        t.observe({"gone": dead_beat}, now + dt, wall + dt)
        assert not t.dead("gone", now + dt)  # (never before the watch, however old)
    t.observe({"gone": dead_beat}, now + 0.75, wall + 0.75)
    assert t.dead("gone", now + 0.75)


def test_a_fresh_heartbeat_still_runs_its_course_from_its_own_time():
    """Written 0.2 s before the first look: dead 1.3 s after it (1.5 s after the beat)."""
    t = Takeover(1.5, min_watch_s=0.75)
    wall, now = 1_000_000.0, 100.0
    beat = _beat(wall - 0.2)
    looks = [now + 0.25 * i for i in range(7)]  # up to +1.5 s
    for at in looks:
        t.observe({"w": beat}, at, wall + (at - now))
    assert not t.dead("w", now + 1.25)
    assert t.dead("w", now + 1.5)


def test_a_live_worker_is_not_taken_over_whatever_age_its_clock_states():
    """Its clock 10 s behind ours (or its last beats held up by a stall): it still
    rewrites its entry every 0.5 s, within the watch, so its clock starts over."""
    t = Takeover(1.5, min_watch_s=0.75)
    wall, now = 1_000_000.0, 100.0
    for i in range(20):  # looks every 0.25 s, beats every 0.5 s, each stamped 10 s in the past
        at = now + 0.25 * i
        t.observe({"live": _beat(wall + 0.5 * (i // 2) - 10.0)}, at, wall + 0.25 * i)
        assert not t.dead("live", at)


def test_the_heartbeats_age_counts_at_the_first_look_only_not_after_a_stall():
    """After a gap in our own reading (a Redis stall) every clock starts over from the
    look, however old the heartbeats say they are: the stall may have held them up."""
    t = Takeover(1.5, min_watch_s=0.75)
    wall, now = 1_000_000.0, 100.0
    t.observe({"w": _beat(wall - 0.1)}, now, wall)
    t.observe({"w": _beat(wall - 0.1)}, now + 0.25, wall + 0.25)
    # an 8 s gap; a worker we never saw appears with an old beat, and w's is old by now
    later = now + 8.25
    t.observe({"w": _beat(wall - 0.1), "new": _beat(wall)}, later, wall + 8.25)
    for dt in (0.25, 0.5, 0.75, 1.0, 1.25):
        t.observe({"w": _beat(wall - 0.1), "new": _beat(wall)}, later + dt, wall + 8.25 + dt)
        assert not t.dead("w", later + dt) and not t.dead("new", later + dt)
    t.observe({"w": _beat(wall - 0.1), "new": _beat(wall)}, later + 1.5, wall + 9.75)
    assert t.dead("w", later + 1.5) and t.dead("new", later + 1.5)


def test_an_unreadable_heartbeat_gets_no_credit():
    t = Takeover(1.5, min_watch_s=0.75)
    for i in range(6):
        t.observe({"w": b"not json"}, 100.0 + 0.25 * i, 1_000_000.0 + 0.25 * i)
    assert not t.dead("w", 101.25)


def test_without_a_watch_the_wait_is_the_full_threshold_as_before():
    t = Takeover(1.5)  # min_watch_s defaults to dead_after_s
    t.observe({"gone": _beat(999_990.0)}, 100.0, 1_000_000.0)
    assert not t.dead("gone", 101.25)
    for at in (100.25, 100.5, 100.75, 101.0, 101.25, 101.5):
        t.observe({"gone": _beat(999_990.0)}, at, 1_000_000.0 + at - 100.0)
    assert t.dead("gone", 101.5)
