"""tests/support/wait.py, the one way tests wait on a condition (issue 51, item 4)."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests.support.wait import until, until_async


def test_until_returns_the_first_truthy_value():
    calls = itertools.count()
    assert until(lambda: next(calls) >= 3 and "ready", "three calls") == "ready"


def test_until_names_what_it_waited_for_and_the_last_value():
    with pytest.raises(AssertionError, match=r"waited 0.05 s for the answer; last value: \[\]"):
        until(list, "the answer", timeout=0.05)
    with pytest.raises(AssertionError, match="the log: nothing yet"):
        until(lambda: 0, lambda: "the log: nothing yet", timeout=0.01)


async def test_until_async_awaits_a_coroutine_check_and_lets_the_loop_run():
    done = asyncio.Event()
    asyncio.get_running_loop().call_later(0.02, done.set)

    async def check() -> bool:
        return done.is_set()

    assert await until_async(check, "the event") is True
    assert await until_async(lambda: done.is_set() and 7, "a plain check") == 7
    with pytest.raises(AssertionError, match="for never"):
        await until_async(lambda: False, "never", timeout=0.02)
