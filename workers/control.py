"""The control channel: one pub/sub connection hearing ``sf:cancel``, ``sf:follow``
and this model's ``sf:wake:{model}`` (docs/architecture.md, "Redis keys"; on a Redis
Cluster the model's own sharded ``sf:cancel:{model}``, ``sf:follow:{model}`` and
``sf:wake:{model}``, docs/cluster.md).

Cancels are queued for the main loop, which applies them between steps; follows go to
the in-flight table; wakes to the intake's ``WakeState``. The connection is
re-established with backoff when it drops.
"""

from __future__ import annotations

import asyncio
import time


from streamfleet.shared.logging import get_logger
from streamfleet.shared.pubsub import ShardSubscriptions
from streamfleet.shared.redis import BROKER_ERRORS
from streamfleet.shared.schema import Cancel, Follow

from streamfleet.workers.context import Part, WorkerContext
from streamfleet.workers.inflight import InFlightTable
from streamfleet.workers.intake import WakeState

__all__ = ["ControlChannel"]

log = get_logger("worker")


class ControlChannel(Part):
    def __init__(self, ctx: WorkerContext, table: InFlightTable, wake: WakeState) -> None:
        super().__init__(ctx)
        self.table = table
        self.wake = wake
        self._cancels: list[str] = []
        self._wake = self.keys.wake(self.model).encode()
        self._follow = self.keys.follow(self.model).encode()
        self._cancel = self.keys.cancel(self.model).encode()

    def take_cancels(self) -> list[str]:
        """The request ids of the cancels heard since the last call."""
        cancels, self._cancels = self._cancels, []
        return cancels

    def on_cancel(self, data: bytes) -> None:
        try:
            self._cancels.append(Cancel.decode(data).request_id)
        except ValueError:
            pass

    def on_follow(self, data: bytes) -> None:
        try:
            f = Follow.decode(data)
        except ValueError:
            return
        self.table.follow(f.request_id, f.reply_to, time.monotonic())

    async def run(self) -> None:
        if self.settings.redis_cluster:
            await self._run_sharded()
            return
        backoff = 0.1
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self._cancel, self._wake, self._follow)
                backoff = 0.1
                while True:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if msg is None or msg.get("type") != "message":
                        continue
                    self._route(msg["channel"], msg["data"])
            except asyncio.CancelledError:
                await pubsub.aclose()
                raise
            except BROKER_ERRORS as exc:
                log.warning("cancel channel lost; resubscribing", error=str(exc))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                try:
                    await pubsub.aclose()
                except Exception:
                    pass

    def _route(self, channel: bytes, data: bytes) -> None:
        if channel == self._wake:
            self.wake.on_wake(data)
        elif channel == self._follow:
            self.on_follow(data)
        elif channel == self._cancel:
            self.on_cancel(data)

    async def _run_sharded(self) -> None:
        """On a Redis Cluster: the model's three channels share its lanes' slot and are
        SSUBSCRIBEd on that shard's primary, moved with it on a failover or reshard."""
        shards = ShardSubscriptions(self.redis, self.settings.redis_target().node_url, self._route, timeout=self.settings.redis_socket_timeout_s,
                                    client_name=f"sf-worker-{self.worker_id}-control", on_restored=lambda chs: None,
                                    on_lost=lambda chs: None, failover_s=self.settings.redis_failover_s, log=log)
        for ch in (self._cancel, self._wake, self._follow):
            shards.keep(ch)
        try:
            await shards.run()
        finally:
            shards.close()
