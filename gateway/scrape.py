"""The gateway's Prometheus endpoint, on a listener of its own (``SF_METRICS_PORT``,
``SF_METRICS_HOST``) and never on the API port: the API port faces clients (through nginx
or an ingress, possibly the internet), the metrics port only Prometheus.

A second uvicorn server on the gateway's event loop serves ``GET /metrics``, which reads
the fleet gauges from Redis first (``refresh_fleet_gauges``, with this process's own
connection); every other path is 404. The socket is bound before anything else starts, so
a port that is taken stops the gateway at once with a message that names the setting; it
is served from the moment the gateway has started (a scrape that comes earlier waits).
"""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Iterator

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from streamfleet.gateway.hub import Hub, refresh_fleet_gauges
from streamfleet.shared.settings import GatewaySettings

__all__ = ["MetricsListenError", "MetricsServer", "listen", "metrics_app"]


class MetricsListenError(Exception):
    """The metrics socket cannot be bound; the message says which setting to change."""


def listen(settings: GatewaySettings) -> socket.socket:
    """A listening socket on ``metrics_host:metrics_port``.

    Raises:
        MetricsListenError: the address is taken, not local, or not allowed.
    """
    host, port = settings.metrics_host, settings.metrics_port
    try:
        return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as exc:
        where = f"{host}:{port} (SF_METRICS_HOST:SF_METRICS_PORT)"
        if exc.errno == errno.EADDRINUSE:
            raise MetricsListenError(f"the metrics port is taken: {where} is already in use; set SF_METRICS_PORT "
                                     "to a free port (another gateway on this host needs its own), or 0 for no "
                                     "metrics listener") from exc
        raise MetricsListenError(f"cannot listen for metrics on {where}: {exc.strerror or exc}") from exc


def metrics_app(hub: Hub) -> Starlette:
    """``GET /metrics``: the fleet gauges refreshed from Redis, then the whole registry."""

    async def metrics(request: Request) -> Response:
        await refresh_fleet_gauges(hub)
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return Starlette(routes=[Route("/metrics", metrics, methods=["GET"])])


class MetricsServer(uvicorn.Server):
    """uvicorn for the metrics app, on a socket from ``listen``. Signals stay with the
    gateway's main server, which stops this one when it is done (``stop``)."""

    def __init__(self, hub: Hub, sock: socket.socket) -> None:
        super().__init__(uvicorn.Config(metrics_app(hub), ws="none", lifespan="off", log_config=None,
                                        access_log=False, timeout_graceful_shutdown=2))
        self.sock = sock

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the main server handles SIGTERM / SIGINT (drain) and then stops this one

    async def run(self) -> None:  # type: ignore[override]  # (uvicorn's runs its own loop; this one is awaited)
        await self.serve(sockets=[self.sock])

    def stop(self) -> None:
        self.should_exit = True
