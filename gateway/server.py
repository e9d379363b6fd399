"""Run one gateway process: uvicorn (HTTP, and WebSocket served by the `websockets`
library), the gRPC server (``gateway.doors.grpc_server``) and the metrics listener, drained
together."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn
from uvicorn.config import Config
from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.extensions.permessage_deflate import ServerPerMessageDeflateFactory
from websockets.protocol import State
from websockets.server import ServerProtocol

from streamfleet.gateway.app import create_app, front
from streamfleet.gateway.edge.guard import Ticket, edge_protocol
from streamfleet.gateway.scrape import MetricsListenError, MetricsServer, listen
from streamfleet.shared import aio
from streamfleet.shared.logging import get_logger
from streamfleet.shared.settings import GatewaySettings

if TYPE_CHECKING:
    from uvicorn._types import ASGISendEvent
    from uvicorn.server import ServerState

    from streamfleet.gateway.doors.grpc_server import GrpcDoor
    from streamfleet.gateway.hub import Hub

__all__ = ["run_gateway"]

log = get_logger("gateway")


def _write_port_file(port_file: str, port: int) -> None:
    """Write the bound port where a launcher waits for it, whole or not at all."""
    tmp = Path(port_file + ".tmp")
    tmp.write_text(str(port))
    tmp.replace(port_file)


async def _announce(server: uvicorn.Server, port_file: str | None, grpc_door: GrpcDoor | None = None) -> None:
    while not server.started:
        if server.should_exit:
            return
        await asyncio.sleep(0.02)
    if grpc_door is not None:  # after the lifespan: the hub's Redis connections exist
        await grpc_door.start()
    sock = server.servers[0].sockets[0]
    host, port = sock.getsockname()[:2]
    log.info("gateway listening", url=f"http://{host}:{port}")
    if port_file:
        _write_port_file(port_file, port)


#: per-message deflate, when on (SF_WS_COMPRESSION): 512-byte windows and the smallest
#: memLevel keep zlib's state per connection near 10 KiB (uvicorn's 4 KiB windows hold ~40),
#: and still shrink a token frame to about a quarter (docs/operations.md, "Idle connections")
DEFLATE_WINDOW_BITS = 9
DEFLATE_MEM_LEVEL = 1


class LeanWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol (the `websockets` library's sans-I/O core), lighter
    per connection (docs/operations.md, "Idle connections"): a light receive queue,
    the handshake's request and response let go once the handshake is done, and small
    per-message-deflate windows when compression is on."""

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        # (an asyncio.Queue holds ~3 KiB per connection; uvicorn only puts and gets)
        self.queue = aio.LightQueue()  # type: ignore[assignment]
        #: the connection's place in the edge's counts (``gateway.edge.guard.Ticket``), handed
        #: over by the HTTP protocol at the upgrade and given back when the connection closes
        self.edge_ticket: Ticket | None = None
        if config.ws_per_message_deflate:
            self.conn = ServerProtocol(
                extensions=[ServerPerMessageDeflateFactory(
                    server_max_window_bits=DEFLATE_WINDOW_BITS, client_max_window_bits=DEFLATE_WINDOW_BITS,
                    compress_settings={"memLevel": DEFLATE_MEM_LEVEL})],
                max_size=config.ws_max_size, logger=self.conn.logger)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        ticket, self.edge_ticket = self.edge_ticket, None
        if ticket is not None:
            ticket.release()

    async def send(self, message: ASGISendEvent) -> None:
        await super().send(message)
        if self.handshake_complete and getattr(self, "response", None) is not None:
            self.request = self.response = None  # type: ignore[assignment]  # (the handshake's headers, ~2 KiB)

    async def send_text_frame(self, payload: bytes) -> None:
        """Send one text message, ``payload`` being its UTF-8 bytes (a JSON frame), as one
        unfragmented frame written straight to the socket when nothing else may stand
        between (the handshake done, the connection open, no close sent, no extension
        negotiated, the transport not paused): a token frame then skips the ASGI message,
        the text's decode and encode and the sans-I/O frame object. Otherwise, as ``send``
        would.

        Raises:
            ClientDisconnected: the client is gone.
        """
        if self.disconnected:
            raise ClientDisconnected()
        if self.close_sent or not self.handshake_complete or self.initial_response is not None \
                or self.conn.extensions or self.conn.state is not State.OPEN or not self.writable.is_set():
            await self.send({"type": "websocket.send", "text": payload.decode()})
            return
        n = len(payload)  # RFC 6455 §5.2: FIN + text opcode, unmasked, then the payload length
        if n < 126:
            head = _SHORT_HEADS[n]
        elif n < 65536:
            head = struct.pack("!BBH", 0x81, 126, n)
        else:
            head = struct.pack("!BBQ", 0x81, 127, n)
        self.transport.write(head + payload)


_SHORT_HEADS = [bytes((0x81, n)) for n in range(126)]


class DrainingServer(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT meaning "drain": stop listening, let
    streams finish until ``drain_timeout_s``, close WebSockets with 1001, then exit. A
    second signal exits at once."""

    def __init__(self, config: uvicorn.Config, hub: Hub, grpc_door: GrpcDoor | None = None) -> None:
        super().__init__(config)
        self.hub = hub
        self.grpc_door = grpc_door
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.hub.draining or not self.started:
            return super().handle_exit(sig, frame)
        self.hub.draining = True
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(lambda: setattr(self, "_drain_task", loop.create_task(self._drain())))

    async def _drain(self) -> None:
        hub = self.hub
        s = hub.settings
        for srv in self.servers:  # no new connections
            srv.close()
        if self.grpc_door is not None:  # health NOT_SERVING; new calls refused, open ones go on
            await self.grpc_door.drain()
        log.info("draining", streams=hub.active_streams(), connections=hub.connections,
                 drain_timeout_s=s.drain_timeout_s)
        deadline = asyncio.get_running_loop().time() + s.drain_timeout_s
        # (polled: the counts change in every request and connection; a drain's 50 ms wait
        # matters to no one)
        while hub.active_streams() and asyncio.get_running_loop().time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        hub.drain_expired = True  # sessions close with 1001 now, whatever they still run
        while hub.connections and asyncio.get_running_loop().time() < deadline + 3:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        if self.grpc_door is not None:  # before the broker stops: calls still open are cancelled
            await self.grpc_door.stop(grace_s=1.0)
        log.info("drained", streams_left=hub.active_streams(), connections_left=hub.connections)
        self.should_exit = True


async def _serve_metrics(server: uvicorn.Server, metrics: MetricsServer) -> None:
    """Serve the metrics port once the gateway has started (its Redis connection exists);
    a scrape that comes earlier waits in the listen backlog."""
    try:
        while not server.started:
            if server.should_exit or metrics.should_exit:
                return
            await asyncio.sleep(0.02)
        log.info("gateway metrics", url=metrics.url)
        await metrics.run()
    except Exception:
        log.exception("the metrics listener failed; the gateway goes on without it")
    finally:
        metrics.sock.close()


async def serve(settings: GatewaySettings, port_file: str | None = None) -> int:
    """Serve until drained: 0; 2 when the gateway cannot start (the reason is logged)."""
    metrics_sock = None
    if settings.metrics_port:
        try:  # first: a taken port stops the gateway before it connects to anything
            metrics_sock = listen(settings)
        except MetricsListenError as exc:
            log.error("gateway cannot start", error=str(exc))
            return 2
    app = create_app(settings)
    grpc_door = None
    if settings.grpc_port:
        from streamfleet.gateway.doors.grpc_server import GrpcDoor, GrpcListenError

        try:  # bound now, served once the gateway has started
            grpc_door = GrpcDoor(app.state.hub)
        except GrpcListenError as exc:
            log.error("gateway cannot start", error=str(exc))
            if metrics_sock is not None:
                metrics_sock.close()
            return 2
    config = uvicorn.Config(
        front(app),
        host=settings.host,
        port=settings.port,
        # httptools, with the request head bounded and the connections counted (the edge
        # before auth: gateway/edge/guard.py, docs/security.md)
        http=edge_protocol(settings),
        ws=LeanWebSocketProtocol,  # the `websockets` library's sans-I/O protocol
        ws_max_size=settings.max_frame_bytes * 4,
        ws_per_message_deflate=settings.ws_compression,
        ws_ping_interval=settings.ws_ping_interval_s,
        ws_ping_timeout=settings.ws_ping_timeout_s,
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=5,
    )
    server = DrainingServer(config, app.state.hub, grpc_door)
    announce = asyncio.create_task(_announce(server, port_file, grpc_door))
    metrics = MetricsServer(app.state.hub, metrics_sock) if metrics_sock is not None else None
    metrics_task = asyncio.create_task(_serve_metrics(server, metrics), name="metrics") if metrics else None
    try:
        await server.serve()
    finally:
        announce.cancel()
        if grpc_door is not None:  # it served through the drain; calls still open are cancelled
            await grpc_door.stop(grace_s=1.0)
        if metrics is not None and metrics_task is not None:  # it served through the drain; now it stops too
            metrics.stop()
            await asyncio.gather(metrics_task, return_exceptions=True)
    return 0


def run_gateway(settings: GatewaySettings, port_file: str | None = None) -> int:
    _open_files(settings)
    return aio.run(serve(settings, port_file), settings.event_loop)


#: descriptors a gateway needs besides one per connection (Redis pool, listeners, files)
_SPARE_FDS = 256


def _open_files(settings: GatewaySettings) -> None:
    """Raise the open-files soft limit to the hard one (a connection is a descriptor) and
    log it; warn when it still cannot hold ``SF_MAX_CONNECTIONS`` (or, where it is capped,
    every connection the HTTP and gRPC ports may hold)."""
    wanted = max(settings.max_connections, settings.max_open_connections) + _SPARE_FDS
    if settings.max_open_connections and settings.grpc_port:
        wanted += settings.grpc_max_connections
    limits = aio.raise_open_files_limit(wanted)
    log.info("open files limit", soft=limits["soft"], hard=limits["hard"], raised_from=limits["before"])
    if limits["soft"] < settings.max_connections + _SPARE_FDS:
        log.warning("the open files limit is below SF_MAX_CONNECTIONS: connections past it will be refused by "
                    "the kernel", soft=limits["soft"], max_connections=settings.max_connections)
