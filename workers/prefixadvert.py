"""Advertising the prefix cache: which KV blocks this worker holds, for the gateways'
prefix-aware routing (docs/architecture.md, "Prefix-aware routing").

With each heartbeat the worker writes the 8-byte names its ``PrefixCache`` holds
(workers/prefixcache.py) to ``sf:{model}:prefix:{worker_id}``, a set, rewritten whole
(one script: delete, add, expire) only when the cache's ``generation`` changed or the
cache is another (a hot reload's new version), and otherwise only has its TTL pushed
back. The TTL is three ``SF_WORKER_TTL_S``: a worker that dies leaves a set that
expires by itself (gateways stop routing to it as soon as its heartbeat is stale); a
clean stop deletes it. At most ``MAX_ADVERTISED`` names, the most recently used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from streamfleet.shared.logging import get_logger
from streamfleet.workers.context import Part, WorkerContext

if TYPE_CHECKING:
    from streamfleet.workers.prefixcache import PrefixCache

__all__ = ["PrefixAdvert", "ADVERTISE_LUA", "MAX_ADVERTISED"]

log = get_logger("worker")

#: most block names one worker advertises (8 bytes each): the most recently used
MAX_ADVERTISED = 16_384

#: Rewrite one worker's advert: KEYS[1] the set; ARGV[1] its TTL (ms), ARGV[2..] the
#: names. Added in chunks (a Lua call takes a few thousand arguments at most).
ADVERTISE_LUA = """
redis.call('DEL', KEYS[1])
for i = 2, #ARGV, 4000 do
  redis.call('SADD', KEYS[1], unpack(ARGV, i, math.min(i + 3999, #ARGV)))
end
if #ARGV > 1 then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
end
return #ARGV - 1
"""


class PrefixAdvert(Part):
    """This worker's advert of its prefix cache.

    Args:
        cache: the prefix cache of the version the worker serves now
            (``WorkerCore.prefix_cache``), or None (no cache: nothing is advertised).
    """

    def __init__(self, ctx: WorkerContext, cache: Callable[[], PrefixCache | None]) -> None:
        super().__init__(ctx)
        self.cache = cache
        self.key = self.keys.prefix_advert(self.model, self.worker_id)
        self.ttl_ms = int(self.settings.worker_ttl_s * 3 * 1000) + 1000
        self._written: tuple[object, int] | None = None  # (cache, generation) as last written
        #: names the set holds, as last written
        self.count = 0
        self._script = ctx.redis.register_script(ADVERTISE_LUA)

    async def write(self) -> None:
        """Rewrite the set if the cache changed since the last write (deleted when the
        worker no longer has a cache).

        Raises:
            BROKER_ERRORS: Redis is unreachable (the next beat tries again).
        """
        cache = self.cache()
        if cache is None:
            if self._written is not None:
                await self.redis.delete(self.key)
                self._written, self.count = None, 0
            return
        state = (cache, cache.generation)
        if self._written is not None and self._written[0] is state[0] and self._written[1] == state[1]:
            return
        names = cache.names()[-MAX_ADVERTISED:]
        self.count = int(await self._script(keys=[self.key], args=[self.ttl_ms, *names]))
        self._written = state

    def refresh(self, pipe) -> bool:
        """Push the set's expiry back, in the heartbeat's pipeline (when there is one);
        returns whether a command was added (its reply goes to ``refreshed``)."""
        if self.count:
            pipe.pexpire(self.key, self.ttl_ms)
            return True
        return False

    def refreshed(self, existed: object) -> None:
        """The reply of ``refresh``'s command: a set that was not there any more (Redis
        restarted empty, the key deleted) is written again at the next beat."""
        if not existed:
            self._written, self.count = None, 0

    async def remove(self) -> None:
        """A clean stop: the set goes with the worker's heartbeat entry.

        Raises:
            BROKER_ERRORS: Redis is unreachable.
        """
        await self.redis.delete(self.key)
        self._written, self.count = None, 0
