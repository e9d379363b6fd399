"""The drain: on SIGTERM a worker reads no new tasks, lets the requests it runs finish
for up to ``drain_timeout_s``, then hands every unfinished one (and every held
delivery) back to its lane so that another worker runs it (a task routed to this worker
for its cached prefix goes back to the shared lane).

With Redis unreachable the hand-back gives up at the first failure, or when Redis has
not answered within the time it is given: what it could not hand back stays pending in
its lane, under this worker's name, and a live worker takes it over once Redis is back
(docs/failures.md, "Graceful shutdown").
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor

from streamfleet.shared.keys import GROUP, split_source
from streamfleet.shared.logging import get_logger
from streamfleet.shared.redis import BROKER_ERRORS
from streamfleet.workers.context import Part, WorkerContext
from streamfleet.workers.coreset import CoreSet
from streamfleet.workers.inflight import InFlightTable

__all__ = ["Drain", "REQUEUE_LUA"]

log = get_logger("worker")

#: Hand a task back to its lane (drain): re-add it at the tail and drop this worker's
#: delivery, atomically. KEYS[1] lane; KEYS[2] the stream it was delivered from (the
#: lane, or an affinity stream of it: its task goes back to the shared lane, where any
#: worker takes it at once); ARGV[1] group, ARGV[2] message id, ARGV[3] task.
REQUEUE_LUA = """
redis.call('XADD', KEYS[1], '*', 'task', ARGV[3])
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[2], ARGV[2])
return 1
"""


class Drain(Part):
    def __init__(self, ctx: WorkerContext, cores: CoreSet, table: InFlightTable, executor: Executor) -> None:
        super().__init__(ctx)
        self.timeout_s = ctx.settings.drain_timeout_s
        self.cores = cores
        self.table = table
        self.executor = executor
        self.deadline: float | None = None
        self._requeue = ctx.redis.register_script(REQUEUE_LUA)

    def due(self) -> bool:
        """Whether to hand back now: nothing runs here any more, or the drain's deadline
        passed. The first call starts the drain."""
        return self.overdue() or not self.cores.has_work()

    def overdue(self) -> bool:
        """The drain's deadline passed (its clock starts when the worker is told to stop,
        ``start``)."""
        return time.monotonic() >= self.start()

    def start(self) -> float:
        """Start the drain's clock (once); returns its deadline."""
        if self.deadline is None:
            self.deadline = time.monotonic() + self.timeout_s
            log.info("draining: no new tasks", in_flight=self.cores.active, drain_timeout_s=self.timeout_s)
        return self.deadline

    async def hand_back(self, within_s: float) -> bool:
        """Give every unfinished task back to its lane so another worker runs it, trying
        for ``within_s`` at most. Returns whether Redis answered (False: what is left
        stays pending in its lane for a live worker to take over)."""
        loop = asyncio.get_running_loop()
        tasks = await loop.run_in_executor(self.executor, self.cores.abandon_all)
        items = self.table.hand_back(tasks)
        done, error = 0, None
        try:
            async with asyncio.timeout(within_s):
                for source, mid, raw in items:
                    lane = split_source(source)[0]
                    await self._requeue(keys=[self.lane_keys[lane], self.lane_keys[source]], args=[GROUP, mid, raw])
                    done += 1
        except TimeoutError:
            error = f"Redis did not answer within {within_s:.1f} s"
        except BROKER_ERRORS as exc:  # Redis is gone: the others would fail the same way
            error = str(exc) or type(exc).__name__
        if done:
            log.info("handed back unfinished tasks", count=done)
        if error is not None:
            left = items[done:]
            log.warning("could not hand back unfinished tasks: Redis unreachable; they stay pending in their "
                        "lanes and a live worker takes them over once Redis is back", count=len(left),
                        message_ids=[mid.decode() for _, mid, _ in left[:16]], error=error)
        return error is None
