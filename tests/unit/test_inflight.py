"""The in-flight table: the requests a worker holds, their listeners, and the cancels
and follows heard before a request starts."""

from __future__ import annotations

from streamfleet.shared.schema import SamplingParams, Task
from streamfleet.workers import inflight
from streamfleet.workers.inflight import Delivery, InFlightTable


def task(rid: str, slot: str = "") -> Task:
    return Task(rid, "toy", "normal", "conn-" + rid, rid, [1, 2], SamplingParams(), 1000.0, slot=slot)


def test_admit_then_finish_forgets_the_request_and_its_listeners():
    t = InFlightTable()
    assert not t.admit("normal", b"1-0", task("r1"))
    t.add_followers("r1", {"c2"})
    t.unheard("r1", 5.0)
    fl = t.get("r1")
    assert "r1" in t and len(t) == 1 and t.channels("conn-r1", "r1") == ("conn-r1", "c2")
    t.finish("r1", fl)
    assert "r1" not in t and t.channels("conn-r1", "r1") == ("conn-r1",)
    assert t.unheard("r1", 9.0) == (9.0, True)  # its silence was forgotten too


def test_finish_of_a_stale_delivery_keeps_the_running_one():
    t = InFlightTable()
    t.admit("normal", b"1-0", task("r1"))
    old = t.get("r1")
    t.admit("normal", b"2-0", task("r1"))  # started again from another delivery
    t.finish("r1", old)
    assert t.get("r1").message_id == b"2-0"


def test_cancels_and_follows_heard_before_the_start_apply_at_the_start():
    t = InFlightTable()
    t.remember_cancel("r1", 10.0)
    t.follow("r1", "c2", 10.0)
    t.follow("r2", "c3", 10.0)
    assert t.admit("normal", b"1-0", task("r1"))  # cancelled before it started
    assert t.channels("conn-r1", "r1") == ("conn-r1", "c2")
    t.forget_old(10.0 + inflight.MEMORY_S + 1)
    assert not t.admit("normal", b"2-0", task("r2"))
    assert t.channels("conn-r2", "r2") == ("conn-r2",)


def test_a_follow_of_a_running_request_applies_at_once_and_resets_its_silence():
    t = InFlightTable()
    t.admit("normal", b"1-0", task("r1"))
    assert t.unheard("r1", 5.0) == (5.0, True)
    assert t.unheard("r1", 6.0) == (5.0, False)
    t.follow("r1", "c2", 6.0)
    assert t.channels("conn-r1", "r1") == ("conn-r1", "c2")
    assert t.unheard("r1", 7.0) == (7.0, True)


def test_followers_are_bounded():
    t = InFlightTable()
    t.admit("normal", b"1-0", task("r1"))
    t.add_followers("r1", {f"c{i}" for i in range(inflight.MAX_FOLLOWERS + 5)})
    assert len(t.channels("conn-r1", "r1")) == 1 + inflight.MAX_FOLLOWERS
    for i in range(inflight.MAX_FOLLOWERS + 5):
        t.follow("r2", f"c{i}", 1.0)  # remembered for a request not running here: bounded too
    t.admit("normal", b"2-0", task("r2"))
    assert len(t.channels("conn-r2", "r2")) == 1 + inflight.MAX_FOLLOWERS


def test_one_look_up_at_a_time():
    t = InFlightTable()
    assert t.begin_look_up("r1") and not t.begin_look_up("r1")
    t.end_look_up("r1")
    assert t.begin_look_up("r1")


def test_held_deliveries_come_out_oldest_first():
    t = InFlightTable()
    for i in range(3):
        t.hold(Delivery("normal", b"%d-0" % i, {b"task": b"x"}))
    assert [d.message_id for d in t.take_held(2)] == [b"0-0", b"1-0"]
    assert [d.message_id for d in t.held] == [b"2-0"]


def test_lost_deliveries_are_dropped_held_or_running():
    t = InFlightTable()
    t.admit("normal", b"1-0", task("r1"))
    t.admit("high", b"1-0", task("r2"))
    t.hold(Delivery("normal", b"2-0", {b"task": b"x"}))
    t.hold(Delivery("normal", b"3-0", {b"task": b"y"}))
    assert t.deliveries() == {"normal": [b"1-0", b"2-0", b"3-0"], "high": [b"1-0"]}
    dropped = t.lost("normal", {b"1-0", b"2-0"})
    assert [rid for rid, _ in dropped] == ["r1"]
    assert "r1" not in t and "r2" in t  # the same id on another lane is another delivery
    assert [d.message_id for d in t.held] == [b"3-0"]


def test_a_delivery_being_acked_is_not_lost():
    """The reclaimer reads the worker's pending deliveries while the publisher's batch
    acks a finished one: that one left the pending list because it finished, and is not
    "taken over by another" (the soak once logged six such warnings for finished tasks)."""
    t = InFlightTable()
    t.admit("normal", b"1-0", task("r1"))
    t.admit("normal", b"2-0", task("r2"))
    t.get("r1").acking = True
    dropped = t.lost("normal", {b"1-0", b"2-0"})
    assert [rid for rid, _ in dropped] == ["r2"]
    assert "r1" in t  # the publisher forgets it once its ack is through (finish)


def test_hand_back_empties_the_table():
    t = InFlightTable()
    t.admit("normal", b"1-0", task("r1", slot="k1"))
    t.admit("normal", b"2-0", task("r2"))
    t.hold(Delivery("high", b"3-0", {b"task": b"raw"}))
    assert t.slots() == [("k1", "r1")]
    items = t.hand_back([task("r1"), task("gone")])
    assert items == [("normal", b"1-0", t_encode("r1", "k1")), ("high", b"3-0", b"raw")]
    assert not t.held and "r1" not in t and "r2" in t  # r2 was not abandoned


def t_encode(rid: str, slot: str) -> bytes:
    return task(rid, slot).encode()
