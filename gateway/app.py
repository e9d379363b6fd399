"""The gateway's ASGI application."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import orjson
from fastapi import FastAPI
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from streamfleet.gateway.admission.gate import Admission
from streamfleet.gateway.admission.validation import Validator
from streamfleet.gateway.admission.voiceslots import VoiceSlots, capacity_of
from streamfleet.gateway.doors import demo, embeddings, openai, responses, transcriptions
from streamfleet.gateway.doors.ws import audio_stream, websocket_stream
from streamfleet.gateway.edge import guard
from streamfleet.gateway.edge.httperror import openai_error_response
from streamfleet.gateway.edge.origin import OriginGuard, refused_origin
from streamfleet.gateway.hub import Hub
from streamfleet.gateway.requests.broker import Broker
from streamfleet.shared import aio
from streamfleet.shared.errors import ErrorCode, StreamfleetError
from streamfleet.shared.logging import get_logger
from streamfleet.shared.modelrepo import ModelRepository
from streamfleet.shared.settings import GatewaySettings

__all__ = ["create_app", "front", "json_response"]

log = get_logger("gateway")

def json_response(data: object, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON response encoded with orjson."""
    return Response(orjson.dumps(data), status_code=status_code, media_type="application/json", headers=headers)


#: the WebSocket doors, served by ``front`` without the HTTP stack in between
WEBSOCKET_ROUTES = {"/v1/stream": websocket_stream, "/v1/audio/stream": audio_stream}
#: the OpenAI generation doors (POST), served by ``front`` the same way
STREAM_ROUTES = {"/v1/completions": openai.completions, "/v1/chat/completions": openai.chat_completions,
                 "/v1/responses": responses.create, "/v1/audio/transcriptions": transcriptions.transcriptions}


#: a door's handler of one POST (``STREAM_ROUTES``)
RouteHandler = Callable[[Request], Awaitable[Response]]


def front(app: FastAPI) -> ASGIApp:
    """The ASGI app uvicorn runs: a WebSocket to one of ``WEBSOCKET_ROUTES`` goes straight
    to its session, a POST to one of ``STREAM_ROUTES`` straight to its handler;
    everything else (other HTTP routes, lifespan, any other path) to ``app``.

    FastAPI's middleware, exception handlers, exit stacks and routing give these doors
    nothing they use (they check the Origin, read their bodies within their limits and
    answer every refusal themselves), yet cost on every request and every token:

    * a WebSocket: memory held per connection for as long as it stays open
      (docs/operations.md, "Idle connections");
    * an SSE stream: each token's ``send`` passes through every middleware's wrapper, and
      routing and the exit stacks run per request.

    The routes stay registered on ``app`` as well (in-process test clients, the OpenAPI
    document); what the stack would add is done here: the Origin check of
    ``gateway.edge.origin.OriginGuard`` and the last-resort 500 of ``create_app``.
    """
    sockets, streams = WEBSOCKET_ROUTES, STREAM_ROUTES
    allowed = app.state.hub.settings.allowed_origins

    async def serve(scope: Scope, receive: Receive, send: Send) -> None:
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
                # its place in the edge's counts (gateway/edge/guard.py), for ``edge.authenticated``
                ticket = getattr(server_protocol, "edge_ticket", None)
                if ticket is not None:
                    scope[guard.SCOPE_KEY] = ticket
                try:
                    await handler(WebSocket(scope, receive, send))
                except Exception:  # as the HTTP stack's last handler would, without a traceback per client
                    log.exception("websocket session failed", path=scope["path"])
                return
        elif kind == "http" and scope["method"] == "POST":
            route = streams.get(scope["path"])
            if route is not None:
                scope["app"] = app
                await _stream_route(route, allowed, scope, receive, send)
                return
        await app(scope, receive, send)

    return serve


async def _stream_route(handler: RouteHandler, allowed_origins: str, scope: Scope, receive: Receive,
                        send: Send) -> None:
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
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
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
    async def healthz() -> Response:
        return json_response({"status": "ok", "gateway_id": hub.broker.gateway_id, "pid": os.getpid()})

    @app.get("/readyz")
    async def readyz() -> Response:
        ready, body = await hub.readiness()
        return json_response(body, status_code=200 if ready else 503)

    for path, handler in WEBSOCKET_ROUTES.items():
        app.add_api_websocket_route(path, handler)
    app.include_router(openai.router)
    app.include_router(responses.router)
    app.include_router(transcriptions.router)
    app.include_router(embeddings.router)
    app.include_router(demo.router)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: ErrorCode.invalid_request, 405: ErrorCode.invalid_request}.get(exc.status_code, ErrorCode.internal)
        body = {"error": {"message": str(exc.detail), "type": "invalid_request_error" if exc.status_code < 500
                          else "server_error", "param": None, "code": str(code)}}
        return json_response(body, exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, exc: ClientDisconnect) -> Response:
        # the client went away mid-request (a body cut short): nothing is wrong here and
        # nobody reads the answer, so no traceback and no "unhandled error"
        log.debug("client left mid-request", path=request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        log.error("unhandled error", path=request.url.path, exc_info=exc)
        return openai_error_response(StreamfleetError("internal error", code=ErrorCode.internal))
    return app
