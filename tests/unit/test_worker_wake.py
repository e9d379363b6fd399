"""The busy worker's read policy: read when a gateway announced a task not read yet."""

import time

from streamfleet.shared.settings import WorkerSettings
from streamfleet.workers import process
from streamfleet.workers.process import WorkerProcess


def make() -> WorkerProcess:
    return WorkerProcess(WorkerSettings(model="tiny-gpt", redis_url="redis://127.0.0.1:1/0"))


def test_a_wake_for_a_task_already_read_is_ignored():
    w = make()
    w._read_at = time.monotonic()
    w._last_read = {"normal": (1700000000000, 5)}
    w._on_wake(b"normal 1700000000000-5")  # the very task the last read returned
    w._on_wake(b"normal 1699999999999-9")
    assert not w._woken and not w._should_read()
    w._on_wake(b"high 1700000000000-1")  # nothing read from that lane yet
    assert w._woken and w._should_read()


def test_a_newer_task_wakes_and_a_garbled_wake_errs_on_reading():
    w = make()
    w._read_at = time.monotonic()
    w._last_read = {"normal": (1700000000000, 5)}
    w._on_wake(b"normal 1700000000000-6")
    assert w._woken
    w._woken = False
    w._on_wake(b"\xff nonsense")
    assert w._woken


def test_reads_happen_anyway_every_read_every_s():
    w = make()
    w._read_at = time.monotonic() - process.READ_EVERY_S - 0.001
    assert not w._woken and w._should_read()
