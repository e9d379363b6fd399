"""Hot reload: following the model version the fleet should run (``sf:version:{model}``).

When it names another version, the worker takes the fleet's reload lock (so workers
take turns and at most one extra engine is in memory at a time), loads the new engine
beside the old, sends new sequences to it (``CoreSet.switch``), lets the old one's
finish, and releases the lock; the main loop frees the old engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from streamfleet.shared.aio import sleep_unless_cancelled
from streamfleet.shared.errors import FatalError
from streamfleet.shared.keys import Keys
from streamfleet.shared.logging import get_logger
from streamfleet.shared.redis import BROKER_ERRORS
from streamfleet.workers.context import Part, WorkerContext
from streamfleet.workers.coreset import CoreSet, VersionedCore

__all__ = ["Reloader", "target_version"]

log = get_logger("worker")

#: how long the reload lock lives unless its holder keeps extending it
LOCK_MS = 120_000


async def target_version(redis: aioredis.Redis, keys: Keys, model: str) -> str | None:
    """The version the fleet should run, if one is set."""
    raw = await redis.get(keys.target_version(model))
    return (raw.decode() if isinstance(raw, bytes) else raw) or None


class Reloader(Part):
    """The reload loop; ``reloading`` is true while a new version loads or the old one
    finishes its sequences.

    Args:
        load: loads a version's engine (off the event loop).
    """

    def __init__(self, ctx: WorkerContext, cores: CoreSet, load: Callable[[str], Awaitable[VersionedCore]],
                 stopping: asyncio.Event) -> None:
        super().__init__(ctx)
        self.cores = cores
        self.load = load
        self.stopping = stopping
        self.reloading = False

    async def run(self) -> None:
        lock_key = self.keys.reload_lock(self.model)
        while True:
            await sleep_unless_cancelled(1.0)
            if self.stopping.is_set():
                continue
            try:
                target = await target_version(self.redis, self.keys, self.model)
                if not target or target == self.cores.version:
                    continue
                if not await self.redis.set(lock_key, self.worker_id, nx=True, px=LOCK_MS):
                    continue  # another worker is reloading: wait for our turn
            except BROKER_ERRORS:
                continue
            await self._reload(target, lock_key)

    async def _reload(self, target: str, lock_key: str) -> None:
        self.reloading = True
        t0 = time.monotonic()
        log.info("reloading model", model=self.model, old=self.cores.version, new=target)
        try:
            new = await self.load(target)
            self.cores.switch(new)
            while self.cores.retiring is not None:
                await asyncio.sleep(0.05)
                await self.redis.pexpire(lock_key, LOCK_MS)
            log.info("model reloaded", model=self.model, version=target, seconds=round(time.monotonic() - t0, 2))
        except FatalError as exc:
            log.error("reload failed; staying on the current version", version=target, error=exc.message)
            await asyncio.sleep(10)
        except BROKER_ERRORS as exc:
            log.warning("redis error during reload", error=str(exc))
        finally:
            self.reloading = False
            try:
                if (await self.redis.get(lock_key)) == self.worker_id.encode():
                    await self.redis.delete(lock_key)
            except BROKER_ERRORS:
                pass
