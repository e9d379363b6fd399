"""An idle worker's wait on its lanes ends when a delivery is held (issue 37): what the
reclaim loop takes over from a dead worker starts at once, not after ``SF_BLOCK_MS``;
the blocking read cut short stays out and what it returns later is started too."""

from __future__ import annotations

import asyncio
import time

from streamfleet.shared.keys import Keys
from streamfleet.shared.settings import WorkerSettings
from streamfleet.workers.context import WorkerContext
from streamfleet.workers.inflight import Delivery, InFlightTable
from streamfleet.workers.intake import Intake, WakeState
from streamfleet.workers.lanes import LanePolicy
from tests.support.wait import until_async


class Cores:
    free_slots = 4


def make(read_s: float, returns: list[Delivery]):
    """An intake whose lanes answer a blocking read after ``read_s`` with ``returns``."""
    settings = WorkerSettings(model="tiny-gpt", redis_url="redis://127.0.0.1:1/0")
    keys = Keys()
    ctx = WorkerContext(None, settings, keys, "w1", keys.lanes("tiny-gpt"))
    table = InFlightTable()
    intake = Intake(ctx, LanePolicy(settings.lane_weights), Cores(), table, WakeState(), None, lambda c: c.close())
    reads, started = [], []

    async def read(free, block, block_ms=None):
        reads.append(block)
        await asyncio.sleep(read_s)
        return list(returns)

    intake._read = read
    intake._start = started.append
    return intake, table, reads, started


async def test_a_held_delivery_ends_the_idle_wait_at_once():
    late = Delivery("normal", b"2-0", {b"task": b"x"})
    intake, table, reads, started = make(0.6, [late])
    claimed = Delivery("normal", b"1-0", {b"task": b"y"})
    asyncio.get_running_loop().call_later(0.05, table.hold, claimed)
    t0 = time.monotonic()
    await intake.admit(block=True)
    assert time.monotonic() - t0 < 0.3  # not the read's 0.6 s
    assert started == [claimed] and reads == [True]
    # the worker idles again at once: it waits on the same read (no second one, no spin)
    await intake.admit(block=True)
    assert reads == [True] and started == [claimed, late]


async def test_what_a_read_cut_short_returns_later_is_started_by_the_next_admission():
    late = Delivery("normal", b"2-0", {b"task": b"x"})
    intake, table, reads, started = make(0.2, [late])
    claimed = Delivery("normal", b"1-0", {b"task": b"y"})
    asyncio.get_running_loop().call_later(0.02, table.hold, claimed)
    await intake.admit(block=True)
    assert started == [claimed]
    read = intake._idle_read
    assert read is not None
    await until_async(read.done, "the read cut short to return", timeout=5)  # the worker steps meanwhile
    await intake.admit(block=False, read=False)
    assert started == [claimed, late] and reads == [True]


async def test_close_cancels_a_read_still_out():
    intake, table, _reads, _started = make(5.0, [])
    asyncio.get_running_loop().call_later(0.02, table.hold, Delivery("normal", b"1-0", {}))
    await intake.admit(block=True)
    read = intake._idle_read
    assert read is not None and not read.done()
    intake.close()
    await asyncio.sleep(0)
    assert read.cancelled() or read.done()
