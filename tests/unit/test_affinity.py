"""A worker's side of prefix-aware routing without I/O (workers/affinity.py,
workers/intake.py): a wake naming this worker wakes it and turns its affinity reads
on, one naming another worker wakes nothing but schedules a look at that worker's
stream once the task may have waited ``SF_AFFINITY_WAIT_MS``."""

from __future__ import annotations

import asyncio
import time

from streamfleet.shared.keys import Keys
from streamfleet.shared.schema import Wake
from streamfleet.shared.settings import WorkerSettings
from streamfleet.workers.affinity import Affinity
from streamfleet.workers.context import WorkerContext
from streamfleet.workers.inflight import InFlightTable
from streamfleet.workers.intake import Intake, WakeState
from streamfleet.workers.lanes import LanePolicy


class Cores:
    free_slots = 4


def make(wait_ms: int = 250) -> tuple[WakeState, Affinity, Intake]:
    settings = WorkerSettings(model="tiny-gpt", redis_url="redis://127.0.0.1:1/0", affinity_wait_ms=wait_ms)
    keys = Keys()
    ctx = WorkerContext(None, settings, keys, "w1", keys.lanes("tiny-gpt"))
    table = InFlightTable()
    wake = WakeState("w1")
    affinity = Affinity(ctx, Cores(), table, asyncio.Event())
    wake.on_other = affinity.on_wake
    intake = Intake(ctx, LanePolicy(settings.lane_weights), Cores(), table, wake, None, lambda c: c.close(),
                    affinity=affinity)
    return wake, affinity, intake


async def test_a_wake_for_another_worker_wakes_nothing_and_schedules_a_look() -> None:
    wake, affinity, _ = make(wait_ms=200)
    t0 = time.monotonic()
    wake.on_wake(Wake("normal@w2", (5, 0)).encode())
    assert not wake.woken and not affinity.active
    due = affinity._due[Keys().affinity("tiny-gpt", "normal", "w2")]
    assert 0.15 < due - t0 < 0.3
    wake.on_wake(Wake("normal@w2", (6, 0)).encode())  # the first wake for a stream sets its time
    assert affinity._due[Keys().affinity("tiny-gpt", "normal", "w2")] == due
    wake.on_wake(Wake("normal", (7, 0)).encode())  # a shared lane's task: as ever
    assert wake.woken


async def test_a_wake_for_this_worker_wakes_it_and_turns_its_affinity_reads_on() -> None:
    wake, affinity, intake = make()
    assert intake._sources() == {b"sf:{tiny-gpt}:tasks:high": "high", b"sf:{tiny-gpt}:tasks:normal": "normal"}
    wake.on_wake(Wake("high@w1", (5, 0)).encode())
    assert wake.woken and affinity.active and not affinity._due
    assert set(intake._sources().values()) == {"high", "normal", "high@w1", "normal@w1"}
    assert intake._sources()[b"sf:{tiny-gpt}:tasks:normal:@w1"] == "normal@w1"
    # once read, the same entry wakes no more
    wake.reading()
    wake.read("high@w1", b"5-0")
    wake.settle(short=True)
    wake.on_wake(Wake("high@w1", (5, 0)).encode())
    assert not wake.woken


def test_the_registry_turns_affinity_reads_on_when_a_wake_was_missed() -> None:
    _, affinity, _ = make()
    keys = Keys()
    affinity.seen({keys.affinity("tiny-gpt", "normal", "w2")})
    assert not affinity.active
    affinity.seen({keys.affinity("tiny-gpt", "normal", "w2"), keys.affinity("tiny-gpt", "normal", "w1")})
    assert affinity.active
    assert affinity._others() == [keys.affinity("tiny-gpt", "normal", "w2")]


async def test_a_busy_workers_tasks_wait_for_its_step_but_never_long() -> None:
    """A worker reads its stream between steps: its tasks wait two of its recent steps
    (its heartbeat's ``step_ms``) when that is longer than ``SF_AFFINITY_WAIT_MS``, at most
    four times the setting; a worker stopped between steps still loses its tasks soon."""
    wake, affinity, _ = make(wait_ms=250)
    affinity._steps = {"fast": 20.0, "slow": 400.0, "stuck": 60_000.0}
    assert affinity.wait_of("fast") == 250
    assert affinity.wait_of("slow") == 800
    assert affinity.wait_of("stuck") == 1000  # (the cap)
    assert affinity.wait_of("unknown") == 250
    assert affinity._owner(Keys().affinity("tiny-gpt", "high", "slow")) == "slow"
    t0 = time.monotonic()
    wake.on_wake(Wake("normal@slow", (5, 0)).encode())
    assert 0.7 < affinity._due[Keys().affinity("tiny-gpt", "normal", "slow")] - t0 < 0.9
    _, at_once, _ = make(wait_ms=0)  # 0: any idle worker takes it at once, however slow its worker
    at_once._steps = {"slow": 400.0}
    assert at_once.wait_of("slow") == 0
