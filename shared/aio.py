"""How every long-running process runs its event loop.

``run(coro, loop=...)`` runs ``coro`` on uvloop when it is installed (the default,
``auto``) and on the standard asyncio loop otherwise or when asked (``SF_EVENT_LOOP=
asyncio``). uvloop's C transports and scheduler roughly halve the per-message cost of the
gateway's fan-out and the worker's publish loop, which is where a streaming fleet spends
its CPU (see docs/benchmarks/fleet.md); behaviour is otherwise the same.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

T = TypeVar("T")

__all__ = ["EVENT_LOOPS", "LightQueue", "cancel_and_wait", "loop_factory", "mark_retrieved", "raise_if_cancelled",
           "run", "settle_heap", "sleep_unless_cancelled"]

EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def mark_retrieved(fut: asyncio.Future[Any]) -> None:
    """A done callback for a shared future that several callers may await (a read or a
    connection under way): its exception counts as retrieved, so that one no caller was
    left to await is not reported as never retrieved (those that awaited got it)."""
    if not fut.cancelled():
        fut.exception()


def raise_if_cancelled() -> None:
    """Raise CancelledError where the running task was cancelled but the cancel never
    reached it as an exception: a library call that caught it and went on (seen with
    redis-py 8.2, a heartbeat cancelled inside its Redis pipeline on a loaded machine:
    the task stayed "cancelling" and beat forever, so the stop that awaited it hung).
    Loops that run until cancelled sleep through ``sleep_unless_cancelled``."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def sleep_unless_cancelled(seconds: float) -> None:
    """The pause of a loop that runs until it is cancelled: ``asyncio.sleep``, after
    ``raise_if_cancelled`` (a cancel that a call of the last round swallowed)."""
    raise_if_cancelled()
    await asyncio.sleep(seconds)


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Stop a background task of a part that is closing: cancel it and wait until it has
    unwound, whatever it ends with (its errors were its own to log)."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass


def loop_factory(loop: str = "auto") -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event-loop constructor for ``loop`` (``None``: asyncio's default)."""
    if loop not in EVENT_LOOPS:
        raise ValueError(f"unknown event loop {loop!r}; expected one of {', '.join(EVENT_LOOPS)}")
    if loop == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if loop == "uvloop":
            raise RuntimeError("SF_EVENT_LOOP=uvloop but uvloop is not installed (pip install uvloop)") from None
        return None
    return uvloop.new_event_loop


def run(coro: Coroutine[Any, Any, T], loop: str = "auto") -> T:
    """``asyncio.run(coro)`` on the chosen loop."""
    with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
        return runner.run(coro)


def settle_heap() -> int:
    """Call once a process has finished starting (tokenizers, engine and web framework
    loaded): collect, then move every object alive now into the collector's permanent
    generation (``gc.freeze``). Those millions of start-up objects (transformers alone
    brings most of them) are never garbage, yet every full collection walks them all, a
    pause of tens of milliseconds that landed on whatever stream was due next. Returns
    how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def raise_open_files_limit(wanted: int = 0) -> dict[str, int]:
    """Raise this process's soft limit on open files to its hard limit and say what it is.

    Containers often start with a soft limit of 1024 under a hard one of a million: a
    gateway would stop accepting sockets at about 1,000 connections whatever
    ``SF_MAX_CONNECTIONS`` says. Returns ``{"before", "soft", "hard"}`` (``wanted``: the
    descriptors the process expects to need, logged against the result by the caller).
    """
    import resource

    before, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft = before
    if hard == resource.RLIM_INFINITY or before < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(before, wanted, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # some sandboxes refuse; the caller logs what remains
            pass
    return {"before": int(before), "soft": int(soft), "hard": int(hard) if hard != resource.RLIM_INFINITY else -1}


class LightQueue(Generic[T]):
    """A first-in-first-out queue for one consumer: ``put_nowait``, ``get``,
    ``get_nowait``, ``empty``, as a list and at most one waiting future. Every WebSocket
    holds two (uvicorn's receive queue and the connection's outbox) and every request
    stream one; an ``asyncio.Queue`` holds four deques, about 3 KiB, idle or not
    (docs/operations.md, "Idle connections")."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: list[T] = []
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: T) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self) -> T:
        """The first item; ``asyncio.QueueEmpty`` when there is none."""
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.pop(0)

    async def get(self) -> T:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.pop(0)

