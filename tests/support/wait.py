"""Waiting on a condition instead of sleeping a fixed time (issue 51): ``until`` polls a
check from a synchronous test, ``until_async`` from a coroutine (the check may itself be a
coroutine function, e.g. an asyncio Redis call). Both return the check's first truthy
value, so a test can wait for a thing and use it::

    events = until(lambda: r.xrange(stream), "the worker's first event")
    await until_async(lambda: conn.emitted, "a frame", timeout=2)

On timeout they raise ``AssertionError`` naming what was awaited, how long, and the last
value seen (``what`` may be a callable, called only then, to add e.g. a process's log).

A fixed sleep stays only where the test waits out a real clock window that no event marks
(a rate-limit bucket refilling, an idle timer that must *not* fire); it says why in a
comment. Everything else waits here.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

#: how often a check is polled: short next to anything a test waits for, long enough to
#: leave the loop or the process under test the CPU
INTERVAL_S = 0.01


def _message(what: str | Callable[[], str], timeout: float, last: object) -> str:
    said = what() if callable(what) else what
    return f"waited {timeout:g} s for {said or 'a condition'}; last value: {last!r}"


def until(check: Callable[[], T], what: str | Callable[[], str] = "", timeout: float = 10.0,
          interval: float = INTERVAL_S) -> T:
    """Poll ``check()`` until it is truthy and return it; ``AssertionError`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(_message(what, timeout, last))
        time.sleep(interval)


async def until_async(check: Callable[[], T | Awaitable[T]], what: str | Callable[[], str] = "",
                      timeout: float = 10.0, interval: float = INTERVAL_S) -> T:
    """``until`` for a coroutine: the loop runs between polls, and ``check`` may return an
    awaitable (it is awaited)."""
    deadline = time.monotonic() + timeout
    while True:
        last = check()
        if inspect.isawaitable(last):
            last = await last
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(_message(what, timeout, last))
        await asyncio.sleep(interval)
