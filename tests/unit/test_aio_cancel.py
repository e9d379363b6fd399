"""shared.aio.raise_if_cancelled and sleep_unless_cancelled: a loop whose cancel a library call
swallowed still stops."""

from __future__ import annotations

import asyncio

import pytest

from streamfleet.shared.aio import raise_if_cancelled, sleep_unless_cancelled


async def test_a_swallowed_cancel_still_stops_the_loop():
    started = asyncio.Event()
    rounds = 0

    async def swallowing_call():
        try:
            started.set()
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass  # what a library may do

    async def loop():
        nonlocal rounds
        while True:
            rounds += 1
            await swallowing_call()
            await sleep_unless_cancelled(0.01)

    task = asyncio.create_task(loop())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=5)
    assert rounds == 1


async def test_an_uncancelled_task_goes_on():
    raise_if_cancelled()  # nothing asked this task to stop
    with pytest.raises(asyncio.TimeoutError):
        async with asyncio.timeout(0.01):  # a timeout's own cancel is taken back (uncancel)
            await asyncio.sleep(1)
    raise_if_cancelled()
