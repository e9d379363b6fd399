"""The busy worker's read policy: read when a gateway announced a task not read yet."""

import time

from streamfleet.shared.settings import WorkerSettings
from streamfleet.workers import intake
from streamfleet.workers.intake import WakeState
from streamfleet.workers.process import WorkerProcess


def make() -> WakeState:
    # the state the worker's control channel feeds and its intake reads
    return WorkerProcess(WorkerSettings(model="tiny-gpt", redis_url="redis://127.0.0.1:1/0")).wake


def test_a_wake_for_a_task_already_read_is_ignored():
    w = make()
    w.read_at = time.monotonic()
    w.last_read = {"normal": (1700000000000, 5)}
    w.on_wake(b"normal 1700000000000-5")  # the very task the last read returned
    w.on_wake(b"normal 1699999999999-9")
    assert not w.woken and not w.should_read()
    w.on_wake(b"high 1700000000000-1")  # nothing read from that lane yet
    assert w.woken and w.should_read()


def test_a_newer_task_wakes_and_a_garbled_wake_errs_on_reading():
    w = make()
    w.read_at = time.monotonic()
    w.last_read = {"normal": (1700000000000, 5)}
    w.on_wake(b"normal 1700000000000-6")
    assert w.woken
    w.woken = False
    w.on_wake(b"\xff nonsense")
    assert w.woken


def test_reads_happen_anyway_every_read_every_s():
    w = make()
    w.read_at = time.monotonic() - intake.READ_EVERY_S - 0.001
    assert not w.woken and w.should_read()


def test_a_read_clears_the_wake_and_records_the_newest_entry_per_lane():
    w = make()
    w.on_wake(b"normal 1700000000000-6")
    w.reading()
    assert not w.woken and not w.should_read()
    w.read("normal", b"1700000000000-6")
    w.read("normal", b"1700000000000-2")  # older: the newest stays
    assert w.last_read == {"normal": (1700000000000, 6)}
    w.on_wake(b"normal 1700000000000-6")
    assert not w.woken


def test_wakes_that_land_during_a_read_for_what_it_took_leave_nothing_to_read():
    """A burst of enqueues announced while a read runs: what the read took, and (when
    it came back short: the lanes had nothing more) what was announced before it began
    and another worker took, leave the worker unwoken; an entry past both wakes it."""
    w = make()
    w.on_wake(b"normal 1700000000000-1")
    w.reading()
    w.on_wake(b"normal 1700000000000-2")  # during the read, which takes both
    w.read("normal", b"1700000000000-1")
    w.read("normal", b"1700000000000-2")
    w.settle(short=True)
    assert not w.woken

    w.on_wake(b"normal 1700000000000-5")  # another worker takes this one
    w.reading()
    w.settle(short=True)  # the read found nothing
    assert not w.woken

    w.reading()
    w.on_wake(b"normal 1700000000000-7")  # during a read that came back empty: maybe after it ran
    w.settle(short=True)
    assert w.woken

    w.reading()
    w.on_wake(b"high 1700000000000-1")
    w.read("normal", b"1700000000000-7")
    w.settle(short=False)  # a full read: more may wait in either lane
    assert w.woken

    w.reading()
    w.on_wake(b"\xff nonsense")  # names no entry: always worth a read
    w.settle(short=True)
    assert w.woken


async def test_next_wake_resolves_at_the_next_wake_or_at_once_when_woken():
    w = make()
    fut = w.next_wake()
    assert not fut.done()
    w.on_wake(b"normal 1700000000000-1")
    assert fut.done()
    assert w.next_wake().done()  # still woken: no wait
    w.reading()
    w.read("normal", b"1700000000000-1")
    fut = w.next_wake()
    w.on_wake(b"normal 1700000000000-1")  # already read: no wake
    assert not fut.done()
    w.on_wake(b"normal 1700000000000-2")
    assert fut.done()
