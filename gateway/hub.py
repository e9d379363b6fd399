"""What every request handler of one gateway process shares (``Hub``): the settings, the
validator, the broker, admission, the voice connections' Silero batch and fair slots,
the connection count and the drain state; the process's shared reply channel; readiness;
the live-worker check a request passes before it is admitted.

Handlers make their requests with ``Hub.request``, which hands a ``ClientRequest`` its
collaborators by name (docs/architecture.md, "A request's path")."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from streamfleet.gateway.admission.gate import Admission
from streamfleet.gateway.admission.validation import Validator
from streamfleet.gateway.admission.voiceslots import VoiceSlots
from streamfleet.gateway.requests.broker import Broker
from streamfleet.gateway.requests.lifecycle import ClientRequest
from streamfleet.gateway.requests.reply_channel import ReplyChannel
from streamfleet.gateway.services.silero import SileroBatch
from streamfleet.shared import aio
from streamfleet.shared.errors import ErrorCode, UnavailableError
from streamfleet.shared.settings import GatewaySettings

if TYPE_CHECKING:
    from streamfleet.gateway.admission.auth import Identity
    from streamfleet.shared.schema import Heartbeat

__all__ = ["Hub", "refresh_fleet_gauges", "NO_WORKERS_RETRY_MS"]


#: Retry-After of a request refused because its model has no live worker
NO_WORKERS_RETRY_MS = 5000


@dataclass
class Hub:
    """What every request handler of one gateway process shares."""

    settings: GatewaySettings
    validator: Validator
    broker: Broker
    admission: Admission
    #: the voice connections' Silero decisions, batched across connections
    silero: SileroBatch = field(default_factory=SileroBatch)
    #: the fair sharing of speech decoder slots (docs/voice.md, "Fair slots"); None: off
    voice_slots: VoiceSlots | None = None
    #: WebSocket connections open on this process
    connections: int = 0
    #: SIGTERM received: refuse new work, let streams finish
    draining: bool = False
    #: the drain deadline passed: close what is left
    drain_expired: bool = False
    #: model -> (monotonic time its workers were last read, last time one was live)
    _workers_seen: dict[str, tuple[float, float]] = field(default_factory=dict)
    #: the read of a model's live workers under way (check_workers)
    _worker_reads: dict[str, asyncio.Future[None]] = field(default_factory=dict)
    _started: float = field(default_factory=time.monotonic)
    _shared_channel: ReplyChannel | None = None
    _shared_channel_opening: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def shared_channel(self) -> ReplyChannel | None:
        """The reply channel the requests this process submits share, whatever their door
        (docs/architecture.md, "Reply channels"): subscribed once for the process's life,
        so a request costs no SUBSCRIBE round trip before its task is enqueued, and a
        worker's step reaches every such stream here in one message. None on a Redis
        Cluster, where each connection or call keeps a channel of its own so that request
        logs (which share their channel's shard) spread over the shards.

        Raises:
            UnavailableError: the pub/sub connection is down (no event could reach a
                request submitted now).
        """
        broker = self.broker
        if broker.keys.cluster:
            return None
        if not broker.healthy:
            raise UnavailableError("message broker unavailable; retry shortly", retry_after_ms=1000)
        channel = self._shared_channel
        if channel is None:
            async with self._shared_channel_opening:
                if self._shared_channel is None:
                    self._shared_channel = await ReplyChannel(broker, shared=True).open()
                channel = self._shared_channel
        return channel

    def active_streams(self) -> int:
        """Requests this process still streams (WebSocket, HTTP and gRPC)."""
        return self.broker.active_streams()

    async def readiness(self) -> tuple[bool, dict[str, str | dict[str, int]]]:
        """Whether this process can serve a request now, and why (``GET /readyz``'s body;
        the gRPC health service reports the same)."""
        if self.draining:
            return False, {"status": "draining"}
        if not await self.broker.ping():
            return False, {"status": "unavailable", "reason": "redis unreachable"}
        # Redis answering is not enough: until this process's pub/sub connection is back (up
        # to the reconnect backoff after Redis restarts) no request here can get its events
        if not self.broker.healthy:
            return False, {"status": "unavailable", "reason": "pub/sub connection down"}
        # ready whatever the workers: the lanes hold requests through a worker rollout, and
        # workers scaled to zero are woken by what gateways enqueue (docs/deployment.md);
        # a model without workers for long is refused per request (check_workers)
        return True, {"status": "ready", "workers": await self._worker_counts()}

    async def check_workers(self, model: str) -> None:
        """Refuse a request for ``model`` when it has had no live worker for
        ``SF_NO_WORKER_GRACE_S`` (or since this gateway started); the live workers are read
        at most once a second per model. A request that the last read would refuse waits
        for the read under way (or starts one), so the first burst after a quiet spell is
        judged by what Redis says now, not by what it said before the spell.

        Raises:
            UnavailableError: ``no_workers`` (503, Retry-After).
        """
        grace = self.settings.no_worker_grace_s
        if grace <= 0:
            return
        now = time.monotonic()
        checked, seen = self._workers_seen.get(model, (0.0, self._started))
        read = self._worker_reads.get(model)
        if read is None and now - checked >= 1.0:  # one read a second, however many requests wait on it
            read = asyncio.ensure_future(self._read_live_workers(model))
            read.add_done_callback(aio.mark_retrieved)
            self._worker_reads[model] = read
        if now - seen > grace and read is not None:
            try:
                await asyncio.shield(read)
            except Exception:  # Redis trouble shows in the enqueue itself
                return
            checked, seen = self._workers_seen[model]
            now = checked
        if now - seen > grace:
            raise UnavailableError(f"model {model!r} has had no live worker for {now - seen:.0f} s; retry later",
                                   code=ErrorCode.no_workers, retry_after_ms=NO_WORKERS_RETRY_MS)

    async def _read_live_workers(self, model: str) -> None:
        """One read of ``model``'s live workers into ``_workers_seen`` (when it was read,
        when a worker was last seen)."""
        started = time.monotonic()
        try:
            live = await self.broker.live_workers(model)
        finally:
            self._worker_reads.pop(model, None)
        _, seen = self._workers_seen.get(model, (0.0, self._started))
        self._workers_seen[model] = (started, started if live else seen)

    async def served_models(self) -> list[tuple[str, int]]:
        """``(model, live workers)`` for each model with at least one live worker.

        Raises:
            UnavailableError: Redis cannot be read.
        """
        return [(name, len(beats)) for name, beats in await self.served_workers()]

    async def served_workers(self) -> list[tuple[str, list[Heartbeat]]]:
        """``(model, its live workers' heartbeats)`` for each model with at least one live
        worker (one read of each model's workers).

        Raises:
            UnavailableError: Redis cannot be read.
        """
        try:
            beats = {name: await self.broker.live_workers(name) for name in self.validator.model_names()}
        except Exception as exc:
            raise UnavailableError(f"message broker unavailable: {exc}", retry_after_ms=1000) from exc
        return [(name, live) for name, live in beats.items() if live]

    async def _worker_counts(self) -> dict[str, int]:
        """Live workers of each model served here."""
        return {name: len(await self.broker.live_workers(name)) for name in self.validator.model_names()}

    def request(self, client_id: str, *, identity: Identity | None = None, channel: ReplyChannel | None = None,
                share: bool = False, peer: str = "") -> ClientRequest:
        """A new request of one client, handed this process's admission, validator and
        broker, its live-worker check and its shared reply channel (``ClientRequest``
        says what ``client_id``, ``channel`` and ``share`` mean)."""
        return ClientRequest(client_id, admission=self.admission, validator=self.validator, broker=self.broker,
                             check_workers=self.check_workers, shared_channel=self.shared_channel,
                             identity=identity, channel=channel, share=share, peer=peer)


async def refresh_fleet_gauges(hub: Hub) -> None:
    """Lane depth, in-flight, lag, live workers and dead letters, read from Redis when
    Prometheus scrapes the metrics port (gateway/scrape.py; a few commands per model, not
    per token). A lane's figures count its affinity streams (prefix-aware routing: the
    tasks gateways sent to one worker, docs/architecture.md) with its shared stream."""
    from streamfleet.shared.keys import GROUP, split_source
    from streamfleet.shared.metrics import gateway as m
    from streamfleet.shared.redis import BROKER_ERRORS

    r, keys = hub.broker.redis, hub.broker.keys
    try:
        for model in hub.validator.model_names():
            routed: dict[str, list[str]] = {}
            for raw in await r.smembers(keys.affinity_streams(model)):
                key = raw.decode() if isinstance(raw, bytes) else raw
                source = keys.affinity_source_of(model, key)
                if source is not None:
                    routed.setdefault(split_source(source)[0], []).append(key)
            for lane, key in keys.lanes(model).items():
                depth = inflight = lag = 0
                for stream in (key, *routed.get(lane, ())):
                    depth += await r.xlen(stream)
                    try:
                        groups = await r.xinfo_groups(stream)
                    except Exception:
                        groups = []
                    g = next((g for g in groups if g.get("name") in (GROUP, GROUP.encode())), None)
                    inflight += g.get("pending", 0) if g else 0
                    lag += (g.get("lag") or 0) if g else 0
                depth += await r.llen(keys.fair(model, lane).queued)  # waiting for their tenant's turn
                m.lane_depth.labels(model, lane).set(depth)
                m.lane_inflight.labels(model, lane).set(inflight)
                m.lane_lag.labels(model, lane).set(lag)
            m.live_workers.labels(model).set(len(await hub.broker.live_workers(model)))
            m.dead_letters.labels(model).set(await r.xlen(keys.dead(model)))
    except BROKER_ERRORS:
        m.redis_errors.labels("metrics").inc()
