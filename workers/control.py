"""The control channel: one pub/sub connection hearing ``sf:cancel``, ``sf:follow``
and this model's ``sf:wake:{model}`` (docs/architecture.md, "Redis keys"; on a Redis
Cluster the model's own sharded ``sf:cancel:{model}``, ``sf:follow:{model}`` and
``sf:wake:{model}``, docs/cluster.md).

Cancels are queued for the main loop, which applies them between steps; follows go to
the in-flight table; wakes to the intake's ``WakeState``. Each message is handled inside
the socket's ``data_received`` (``shared.pubsub.PubSubConnection``, as the gateway's
replies), not redis-py's ``get_message``, which costs a coroutine and a timeout per
message: a burst of wakes comes at every step boundary. The connection is re-established with backoff
when it drops.
"""

from __future__ import annotations

import asyncio
import time
from typing import cast

from redis.exceptions import ConnectionError as RedisConnectionError, ResponseError

from streamfleet.shared.logging import get_logger
from streamfleet.shared.pubsub import ShardSubscriptions, open_pubsub
from streamfleet.shared.redis import BROKER_ERRORS, FleetCluster
from streamfleet.shared.schema import Cancel, Follow
from streamfleet.workers.context import Part, WorkerContext
from streamfleet.workers.inflight import InFlightTable
from streamfleet.workers.intake import WakeState

__all__ = ["ControlChannel"]

log = get_logger("worker")

#: seconds of quiet after which the control socket is PINGed
PING_S = 5.0


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
        timeout = self.settings.redis_socket_timeout_s
        backoff = 0.1
        while True:
            conn = None
            try:
                conn = await open_pubsub(self.settings.redis_url, self._on_message, timeout=timeout,
                                         client_name=f"sf-worker-{self.worker_id}-control")
                await conn.subscribe(self._cancel, self._wake, self._follow, timeout=timeout)
                backoff = 0.1
                while True:  # PINGed when quiet: a peer gone without a FIN is found
                    done, _ = await asyncio.wait({conn.lost}, timeout=PING_S)
                    if done:
                        raise conn.lost.result() or RedisConnectionError("control connection closed")
                    await conn.ping(timeout)
            except (*BROKER_ERRORS, ResponseError) as exc:
                log.warning("cancel channel lost; resubscribing", error=str(exc))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                if conn is not None:
                    conn.close()

    def _on_message(self, channel: bytes, data: bytes) -> None:
        """Runs inside the socket's ``data_received``: must not raise."""
        try:
            self._route(channel, data)
        except Exception:
            log.exception("control message handling failed", channel=channel)

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
        # (on a cluster, the context's client is a FleetCluster: shared.redis.connect)
        shards = ShardSubscriptions(cast(FleetCluster, self.redis), self.settings.redis_target().node_url, self._route,
                                    timeout=self.settings.redis_socket_timeout_s,
                                    client_name=f"sf-worker-{self.worker_id}-control", on_restored=lambda chs: None,
                                    on_lost=lambda chs: None, failover_s=self.settings.redis_failover_s, log=log)
        for ch in (self._cancel, self._wake, self._follow):
            shards.keep(ch)
        try:
            await shards.run()
        finally:
            shards.close()
