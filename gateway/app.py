"""The gateway's ASGI application."""

from __future__ import annotations

import asyncio
import os
import time

from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.websockets import WebSocket
import orjson

from streamfleet.shared import aio
from streamfleet.shared.errors import ErrorCode, StreamfleetError, UnavailableError
from streamfleet.shared.logging import get_logger
from streamfleet.shared.modelrepo import ModelRepository
from streamfleet.shared.settings import GatewaySettings

from streamfleet.gateway import demo, edge, openai
from streamfleet.gateway.admission import Admission
from streamfleet.gateway.broker import Broker
from streamfleet.gateway.httperror import openai_error_response
from streamfleet.gateway.origin import OriginGuard, refused_origin
from streamfleet.gateway.streams import ReplyChannel
from streamfleet.gateway.validation import Validator
from streamfleet.gateway.voice import SileroBatch, audio_stream
from streamfleet.gateway.voiceslots import VoiceSlots, capacity_of
from streamfleet.gateway.ws import websocket_stream

__all__ = ["Hub", "create_app", "json_response"]

log = get_logger("gateway")

#: Retry-After of a request refused because its model has no live worker
NO_WORKERS_RETRY_MS = 5000


def _retrieve(fut: "asyncio.Future[None]") -> None:
    """Take a background read's exception, so that a read no request waited for is not
    reported as never retrieved (the requests that waited got it themselves)."""
    if not fut.cancelled():
        fut.exception()


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
    _worker_reads: dict[str, "asyncio.Future[None]"] = field(default_factory=dict)
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

    async def readiness(self) -> tuple[bool, dict]:
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
            read.add_done_callback(_retrieve)
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
        try:
            counts = await self._worker_counts()
        except Exception as exc:
            raise UnavailableError(f"message broker unavailable: {exc}", retry_after_ms=1000) from exc
        return [(name, n) for name, n in counts.items() if n]

    async def _worker_counts(self) -> dict[str, int]:
        """Live workers of each model served here."""
        return {name: len(await self.broker.live_workers(name)) for name in self.validator.model_names()}


def json_response(data: object, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON response encoded with orjson."""
    return Response(orjson.dumps(data), status_code=status_code, media_type="application/json", headers=headers)


async def refresh_fleet_gauges(hub: Hub) -> None:
    """Lane depth, in-flight, lag, live workers and dead letters, read from Redis when
    Prometheus scrapes the metrics port (gateway/scrape.py; a few commands per model, not
    per token)."""
    from streamfleet.shared.keys import GROUP
    from streamfleet.shared.metrics import gateway as m
    from streamfleet.shared.redis import BROKER_ERRORS

    r, keys = hub.broker.redis, hub.broker.keys
    try:
        for model in hub.validator.model_names():
            for lane, key in keys.lanes(model).items():
                m.lane_depth.labels(model, lane).set(await r.xlen(key))
                try:
                    groups = await r.xinfo_groups(key)
                except Exception:
                    groups = []
                g = next((g for g in groups if g.get("name") in (GROUP, GROUP.encode())), None)
                m.lane_inflight.labels(model, lane).set(g.get("pending", 0) if g else 0)
                m.lane_lag.labels(model, lane).set((g.get("lag") or 0) if g else 0)
            m.live_workers.labels(model).set(len(await hub.broker.live_workers(model)))
            m.dead_letters.labels(model).set(await r.xlen(keys.dead(model)))
    except BROKER_ERRORS:
        m.redis_errors.labels("metrics").inc()


#: the WebSocket doors, served by ``front`` without the HTTP stack in between
WEBSOCKET_ROUTES = {"/v1/stream": websocket_stream, "/v1/audio/stream": audio_stream}
#: the OpenAI generation doors (POST), served by ``front`` the same way
STREAM_ROUTES = {"/v1/completions": openai.completions, "/v1/chat/completions": openai.chat_completions}


def front(app: FastAPI):
    """The ASGI app uvicorn runs: a WebSocket to one of ``WEBSOCKET_ROUTES`` goes straight
    to its session, a POST to one of ``STREAM_ROUTES`` straight to its handler;
    everything else (other HTTP routes, lifespan, any other path) to ``app``.

    FastAPI's middleware, exception handlers, exit stacks and routing give these doors
    nothing they use (they check the Origin, read their bodies within their limits and
    answer every refusal themselves), yet cost on every request and every token:

    * a WebSocket: about 12 KiB held per connection for as long as it stays open, a third
      of an idle WebSocket's cost (docs/operations.md, "Idle connections");
    * an SSE stream: each token's ``send`` passes through every middleware's wrapper, and
      routing and the exit stacks run per request (docs/status.md, "Beside the peers").

    The routes stay registered on ``app`` as well (in-process test clients, the OpenAPI
    document); what the stack would add is done here: the Origin check of
    ``gateway.origin.OriginGuard`` and the last-resort 500 of ``create_app``.
    """
    sockets, streams = WEBSOCKET_ROUTES, STREAM_ROUTES
    allowed = app.state.hub.settings.allowed_origins

    async def serve(scope, receive, send) -> None:
        kind = scope["type"]
        if kind == "websocket":
            handler = sockets.get(scope["path"])
            if handler is not None:
                scope["app"] = app
                # the server's direct text-frame writer, where it has one (gateway.server)
                server_protocol = getattr(send, "__self__", None)
                frame_writer = getattr(server_protocol, "send_text_frame", None)
                if frame_writer is not None:
                    scope["streamfleet.send_text_frame"] = frame_writer
                # its place in the edge's counts (gateway/edge.py), for ``edge.authenticated``
                ticket = getattr(server_protocol, "edge_ticket", None)
                if ticket is not None:
                    scope[edge.SCOPE_KEY] = ticket
                try:
                    await handler(WebSocket(scope, receive, send))
                except Exception:  # as the HTTP stack's last handler would, without a traceback per client
                    log.exception("websocket session failed", path=scope["path"])
                return
        elif kind == "http" and scope["method"] == "POST":
            handler = streams.get(scope["path"])
            if handler is not None:
                scope["app"] = app
                await _stream_route(handler, allowed, scope, receive, send)
                return
        await app(scope, receive, send)

    return serve


async def _stream_route(handler, allowed_origins: str, scope, receive, send) -> None:
    """One POST to a generation door, as ``app`` would serve it."""
    refusal = refused_origin(scope, allowed_origins)
    if refusal is not None:
        await openai_error_response(refusal)(scope, receive, send)
        return
    request = Request(scope, receive)
    try:
        response = await handler(request)
    except ClientDisconnect:  # a body cut short: nobody reads the answer (as create_app's handler)
        response = Response(status_code=499)
    except Exception:
        log.exception("unhandled error", path=scope["path"])
        response = openai_error_response(StreamfleetError("internal error", code=ErrorCode.internal))
    try:
        await response(scope, receive, send)
    except ClientDisconnect:
        pass
    except Exception:  # mid-stream: the server closes the connection; the client sees it cut short
        log.exception("stream failed", path=scope["path"])


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings()
    repo = ModelRepository(settings.engines_dir)
    broker = Broker(settings)
    hub = Hub(settings=settings, validator=Validator(settings, repo), broker=broker,
              admission=Admission(settings, broker))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await hub.broker.start()
        hub.admission.start()
        if settings.voice_fair_slots:
            async def speech_slots(model: str) -> int:
                return capacity_of(await hub.broker.live_workers(model))

            hub.voice_slots = VoiceSlots(hub.broker.redis, hub.broker.keys, speech_slots,
                                         reserve=settings.voice_reserved_slots)
        # load tokenizers up front so the first request is not slow
        for name in hub.validator.model_names():
            try:
                hub.validator.tokenizer(hub.validator.spec(name))
            except Exception:
                pass
        log.info("gateway started", frozen_objects=aio.settle_heap())
        yield
        if hub.voice_slots is not None:
            await hub.voice_slots.stop()
        await hub.admission.stop()
        await hub.broker.stop()

    # the schema and its pages need no API key: off unless asked for (SF_API_DOCS), then 404
    docs = settings.api_docs
    app = FastAPI(title="streamfleet gateway", lifespan=lifespan, openapi_url="/openapi.json" if docs else None,
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None)
    app.state.hub = hub
    # POSTs from another site's page are refused (403); WebSockets check the same in ws.py
    app.add_middleware(OriginGuard, allowed_origins=settings.allowed_origins)

    @app.get("/healthz")
    async def healthz():
        return json_response({"status": "ok", "gateway_id": hub.broker.gateway_id, "pid": os.getpid()})

    @app.get("/readyz")
    async def readyz():
        ready, body = await hub.readiness()
        return json_response(body, status_code=200 if ready else 503)

    for path, handler in WEBSOCKET_ROUTES.items():
        app.add_api_websocket_route(path, handler)
    app.include_router(openai.router)
    app.include_router(demo.router)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        code = {404: ErrorCode.invalid_request, 405: ErrorCode.invalid_request}.get(exc.status_code, ErrorCode.internal)
        body = {"error": {"message": str(exc.detail), "type": "invalid_request_error" if exc.status_code < 500
                          else "server_error", "param": None, "code": str(code)}}
        return json_response(body, exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def client_left(request, exc: ClientDisconnect):
        # the client went away mid-request (a body cut short): nothing is wrong here and
        # nobody reads the answer, so no traceback and no "unhandled error"
        log.debug("client left mid-request", path=request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal_error(request, exc: Exception):
        log.exception("unhandled error", path=request.url.path)
        return openai_error_response(StreamfleetError("internal error", code=ErrorCode.internal))
    return app
