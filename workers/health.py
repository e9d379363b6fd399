"""The worker's liveness, served next to its metrics (``GET /healthz`` on the metrics port).

The metrics server runs on its own thread, so it answers while the event loop or the
engine hangs: a probe of ``/metrics`` cannot see a stuck worker. ``Liveness`` is told
by the event loop when a step finishes (or when there is nothing to do) and ticks once a
second from a task on the loop; ``/healthz`` answers 503 when sequences are in flight and
no step has finished for ``SF_WORKER_STALL_S``, or when the loop has not ticked for that
long (docs/operations.md, "Probes and limits").
"""

from __future__ import annotations

import asyncio
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson

__all__ = ["Liveness", "serve_metrics_and_health"]


class Liveness:
    """What ``/healthz`` judges by. Written by the event loop, read by the HTTP thread
    (floats and ints: each assignment is atomic)."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = float(stall_s)
        now = time.monotonic()
        self.progress_at = now  # a step finished, or there was nothing to do
        self.loop_at = now  # the event loop's last tick
        self.in_flight = 0

    def idle(self) -> None:
        """Nothing in flight: nothing can be stuck."""
        self.in_flight = 0
        self.progress_at = time.monotonic()

    def stepped(self, in_flight: int) -> None:
        """A step finished; ``in_flight`` sequences remain."""
        self.in_flight = in_flight
        self.progress_at = time.monotonic()

    async def tick(self) -> None:
        """Mark the event loop alive once a second (a task on the loop)."""
        while True:
            self.loop_at = time.monotonic()
            await asyncio.sleep(1.0)

    def check(self) -> tuple[bool, dict]:
        now = time.monotonic()
        loop_age, step_age = now - self.loop_at, now - self.progress_at
        body = {"in_flight": self.in_flight, "seconds_since_step": round(step_age, 1),
                "seconds_since_loop_tick": round(loop_age, 1), "stall_s": self.stall_s}
        if loop_age > self.stall_s:
            return False, {"status": "stalled", "reason": "the event loop is not running", **body}
        if self.in_flight and step_age > self.stall_s:
            return False, {"status": "stalled", "reason": "sequences in flight and no step finished", **body}
        return True, {"status": "ok", **body}


def serve_metrics_and_health(host: str, port: int, liveness: Liveness) -> ThreadingHTTPServer:
    """Serve ``/metrics`` (the process's Prometheus registry) and ``/healthz`` on a daemon
    thread; returns the server."""
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                status, body, ctype = 200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST
            elif path == "/healthz":
                ok, data = liveness.check()
                status, body, ctype = 200 if ok else 503, orjson.dumps(data), "application/json"
            else:
                status, body, ctype = 404, b"not found\n", "text/plain"
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # probes every few seconds: not worth a log line
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
