"""Run one gateway process on uvicorn (WebSocket served by the `websockets` library)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import uvicorn

from shared.logging import get_logger
from shared.settings import GatewaySettings

from gateway.app import create_app

__all__ = ["run_gateway"]

log = get_logger("gateway")


async def _announce(server: uvicorn.Server, port_file: str | None) -> None:
    while not server.started:
        if server.should_exit:
            return
        await asyncio.sleep(0.02)
    sock = server.servers[0].sockets[0]
    host, port = sock.getsockname()[:2]
    log.info("gateway listening", url=f"http://{host}:{port}")
    if port_file:
        tmp = Path(port_file + ".tmp")
        tmp.write_text(str(port))
        tmp.replace(port_file)


async def serve(settings: GatewaySettings, port_file: str | None = None) -> None:
    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        ws="websockets-sansio",  # the `websockets` library's sans-I/O protocol
        ws_max_size=settings.max_frame_bytes * 4,
        ws_ping_interval=settings.ws_ping_interval_s,
        ws_ping_timeout=settings.ws_ping_timeout_s,
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=30,
    )
    server = uvicorn.Server(config)
    announce = asyncio.create_task(_announce(server, port_file))
    await server.serve()
    announce.cancel()


def run_gateway(settings: GatewaySettings, port_file: str | None = None) -> None:
    asyncio.run(serve(settings, port_file))
