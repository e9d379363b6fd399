"""`streamfleet bench`: a load generator for a running fleet, over WebSocket, SSE or gRPC.

This module is the run: it checks the settings (``BenchConfig``,
``streamfleet/bench_config.py``), asks the gateway whether it is ready, opens the
transport's connections (``streamfleet/bench_clients.py``), drives the load and hands
the per-request records to a ``BenchResult`` (``streamfleet/bench_stats.py``), whose
latency percentiles, tokens/s and errors are the report.

Load shapes:

* closed loop (default): ``concurrency`` clients send their next request as soon as
  the previous one ends;
* open loop (``rate``): requests start at Poisson arrival times, ``rate`` per second on
  average, whatever is still running. Latencies count from the scheduled arrival, so a
  client that falls behind does not hide the wait (no coordinated omission).

Connections: over WebSocket, ``concurrency`` connections (a closed-loop client each;
open-loop requests round-robin over them, multiplexed by id); over SSE each request is
one HTTP stream on a pool of keep-alive connections; over gRPC one ``Generate`` call
per request, on one HTTP/2 channel per ``GRPC_CALLS_PER_CHANNEL`` of concurrency
(round-robin).

The run ends after ``requests`` requests or ``duration`` seconds, whichever comes
first; requests in flight at the deadline finish and count. ``run_comparison`` runs the
same load over several transports in turn and sets their figures side by side.

Library use (scripts call it in-process)::

    result = await run_bench(BenchConfig(url="http://127.0.0.1:8000", concurrency=8, requests=100))
    print(result.render()); data = result.to_dict()
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TextIO

import httpx
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from streamfleet.bench_clients import _GrpcChannel, _SseClient, _WsConn
from streamfleet.bench_config import BenchConfig, BenchError
from streamfleet.bench_stats import BenchResult, Comparison, RequestRecord
from streamfleet.client import PRIORITIES, default_grpc_target, urls
from streamfleet.v1 import inference_pb2 as pb

__all__ = ["run_bench", "run_comparison"]

#: concurrent Generate calls per gRPC channel (one HTTP/2 connection each), well below
#: the gateway's SF_GRPC_MAX_CONCURRENT_STREAMS (256)
GRPC_CALLS_PER_CHANNEL = 64
#: the service the gRPC preflight asks the health service about
GRPC_SERVICE = pb.DESCRIPTOR.services_by_name["Inference"].full_name

_Conn = _WsConn | _SseClient | _GrpcChannel


class _Run:
    def __init__(self, cfg: BenchConfig, ws_url: str, base: str, on_start=None) -> None:
        self.cfg = cfg
        self.on_start = on_start
        self.ws_url = ws_url
        self.base = base
        self.records: list[RequestRecord] = []
        self.rng = random.Random(cfg.seed)
        self.n = itertools.count()
        self.started = 0
        self.done = 0
        self.t0 = 0.0

    def _lane(self) -> str:
        if self.cfg.lane == "mixed":
            return self.rng.choice(("high", "normal"))
        return self.cfg.lane

    def _frame(self, i: int, lane: str) -> dict:
        c = self.cfg
        frame = {"type": "generate", "prompt": c.prompt_text(), "max_tokens": c.max_tokens,
                 "temperature": c.temperature, "seed": c.seed * 1_000_003 + i, "ignore_eos": True,
                 "priority": lane}
        if c.model:
            frame["model"] = c.model
        return frame

    def _body(self, i: int, lane: str) -> dict:
        c = self.cfg
        body = {"prompt": c.prompt_text(), "max_tokens": c.max_tokens, "temperature": c.temperature,
                "seed": c.seed * 1_000_003 + i, "ignore_eos": True, "stream": True, "priority": lane,
                "stream_options": {"include_usage": True}}
        if c.model:
            body["model"] = c.model
        return body

    def _message(self, i: int, lane: str) -> pb.GenerateRequest:
        c = self.cfg
        return pb.GenerateRequest(model=c.model or "", prompt=c.prompt_text(), max_tokens=c.max_tokens,
                                  temperature=c.temperature, seed=c.seed * 1_000_003 + i, ignore_eos=True,
                                  priority=PRIORITIES[lane])

    def _connections(self) -> tuple[list[_Conn], str]:
        """The transport's connections, and where they go."""
        c = self.cfg
        if c.transport == "ws":
            return [_WsConn(self.ws_url, c) for _ in range(c.concurrency)], self.ws_url
        if c.transport == "grpc":
            target = c.grpc_target
            if target is None:
                raise BenchError("no gRPC target (prepare() fills in the default)")
            n = math.ceil(c.concurrency / GRPC_CALLS_PER_CHANNEL)
            return [_GrpcChannel(target, c) for _ in range(n)], target
        return [_SseClient(self.base, c)], self.base

    def _claim(self, deadline: float | None, limit: int | None) -> int | None:
        """The next request number, or None when the run is over."""
        if deadline is not None and time.perf_counter() >= deadline:
            return None
        if limit is not None and self.started >= limit:
            return None
        self.started += 1
        return next(self.n)

    async def _one(self, i: int, start: float, conn: _Conn, keep: bool) -> None:
        lane = self._lane()
        rec = RequestRecord(lane=lane, start=start)
        if keep:
            if not self.records:
                rec.text = []  # the sample: what the model streamed for the first request
            self.records.append(rec)
        # (each transport's connection takes the request in its own form)
        if isinstance(conn, _GrpcChannel):
            await conn.request(rec, self._message(i, lane))
        elif isinstance(conn, _WsConn):
            await conn.request(rec, self._frame(i, lane))
        else:
            await conn.request(rec, self._body(i, lane))
        if keep:
            self.done += 1

    async def run(self) -> BenchResult:
        c = self.cfg
        conns, where = self._connections()
        try:
            results = await asyncio.gather(*(x.open() for x in conns), return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                raise BenchError(f"cannot open {len(failed)} of {len(conns)} {c.transport} connections to "
                                 f"{where}: {failed[0]!r}")
            if c.warmup:
                await self._closed(conns, limit=c.warmup, deadline=None, keep=False)
                self.started = 0
            if self.on_start is not None:
                self.on_start()
            progress = asyncio.create_task(self._progress()) if c.progress else None
            self.t0 = time.perf_counter()
            deadline = self.t0 + c.duration if c.duration else None
            try:
                if c.rate:
                    await self._open(conns, deadline, c.rate)
                else:
                    await self._closed(conns, limit=c.total_requests, deadline=deadline, keep=True)
            finally:
                wall = time.perf_counter() - self.t0
                if progress is not None:
                    progress.cancel()
                    try:
                        await progress
                    except asyncio.CancelledError:
                        pass
                    self._draw(final=True)
            return BenchResult(config=c, records=self.records, wall_s=wall)
        finally:
            await asyncio.gather(*(x.close() for x in conns), return_exceptions=True)

    async def _closed(self, conns: list[_Conn], *, limit: int | None, deadline: float | None, keep: bool) -> None:
        async def client(k: int) -> None:
            conn = conns[k % len(conns)]
            while (i := self._claim(deadline, limit)) is not None:
                await self._one(i, time.perf_counter(), conn, keep)

        await asyncio.gather(*(client(k) for k in range(self.cfg.concurrency)))

    async def _open(self, conns: list[_Conn], deadline: float | None, rate: float) -> None:
        limit = self.cfg.total_requests
        tasks: set[asyncio.Task] = set()
        arrival = self.t0
        k = 0
        while True:
            arrival += self.rng.expovariate(rate)
            if deadline is not None and arrival >= deadline:
                break
            delay = arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            i = self._claim(None, limit)
            if i is None:
                break
            conn = conns[k % len(conns)]
            k += 1
            t = asyncio.create_task(self._one(i, arrival, conn, True))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)

    async def _progress(self) -> None:
        while True:
            self._draw()
            await asyncio.sleep(0.25)

    def _draw(self, final: bool = False) -> None:
        c = self.cfg
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        total = c.total_requests
        if total is not None:
            frac = self.done / total
        elif c.duration:
            frac = min(1.0, elapsed / c.duration)
        else:
            frac = 0.0
        if final:
            frac = 1.0 if total is None or self.done >= total else frac
        width = 24
        filled = round(frac * width)
        bar = "#" * filled + "." * (width - filled)
        errs = sum(1 for r in self.records if r.error is not None)
        tokens = sum(r.tokens or len(r.token_times) for r in self.records)
        count = f"{self.done}/{total}" if total is not None else f"{self.done}"
        line = (f"\r\x1b[K[{bar}] {count} req  {errs} err  {tokens / elapsed:8.0f} tok/s  {elapsed:6.1f} s")
        sys.stderr.write(line + ("\n" if final else ""))
        sys.stderr.flush()


async def _preflight(cfg: BenchConfig, ws_url: str, base: str) -> str | None:
    """Check that the gateway answers; returns a warning (not ready) or None.

    Raises:
        BenchError: nothing answers at the URL.
    """
    try:
        async with httpx.AsyncClient(timeout=5.0) as http:
            r = await http.get(base + "/readyz")
    except httpx.HTTPError as exc:
        raise BenchError(f"cannot reach the gateway at {base}: {exc or type(exc).__name__}") from exc
    if r.status_code == 503:
        try:
            reason = r.json().get("reason", "")
        except ValueError:
            reason = ""
        return f"the gateway at {base} is up but not ready ({reason or 'HTTP 503'}); requests may fail"
    try:
        workers = r.json().get("workers") or {}
    except ValueError:
        workers = {}
    if not any(workers.values()):
        return f"the gateway at {base} sees no live worker; requests will wait in the queue or be refused"
    return None


async def _grpc_preflight(target: str) -> str | None:
    """Ask the gateway's gRPC health service about ``streamfleet.v1.Inference``; returns
    a warning (not serving) or None.

    Raises:
        BenchError: no gRPC service answers at ``target``.
    """
    async with aio.insecure_channel(target) as channel:
        try:
            r = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=GRPC_SERVICE), timeout=5.0)
        except aio.AioRpcError as exc:
            raise BenchError(f"cannot reach the gateway at {target} (gRPC): {exc.code().name} "
                             f"({exc.details()})") from exc
    if r.status != health_pb2.HealthCheckResponse.SERVING:
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
        return f"the gateway at {target} is up but not ready ({status}); requests may fail"
    return None


async def run_bench(config: BenchConfig, *, preflight: bool = True, warn: TextIO | None = sys.stderr,
                    on_start: Callable[[], object] | None = None) -> BenchResult:
    """Run the benchmark described by ``config`` against a running gateway.

    Args:
        config: what to run.
        preflight: first check that ``GET /readyz`` answers, or over gRPC the health
            service (a server without them, such as the in-process baseline of
            scripts/bench_fleet.py, should pass False).
        warn: where to print warnings (None: nowhere).
        on_start: called when measuring starts (connections open, warm-up done), e.g. to
            sample the servers' CPU time over exactly the measured run.

    Raises:
        BenchError: bad settings, or the gateway cannot be reached.
    """
    return await _Run(*await _prepare(config, preflight, warn), on_start).run()


async def _prepare(config: BenchConfig, preflight: bool, warn: TextIO | None) -> tuple[BenchConfig, str, str]:
    """``(config, websocket_url, http_base)`` of a run that can start: the settings
    checked, the gRPC target filled in, the gateway asked (``preflight``).

    Raises:
        BenchError: bad settings, or the gateway cannot be reached.
    """
    config.check()
    ws_url, base = urls(config.url)
    grpc = config.transport == "grpc"
    grpc_target = (config.grpc_target or default_grpc_target(config.url)) if grpc else None
    if grpc_target is not None:
        config = replace(config, grpc_target=grpc_target)
    if preflight:
        note = await (_grpc_preflight(grpc_target) if grpc_target is not None else _preflight(config, ws_url, base))
        if note and warn is not None:
            print(f"warning: {note}", file=warn)
    return config, ws_url, base


async def run_comparison(configs: Sequence[BenchConfig], *, preflight: bool = True,
                         warn: TextIO | None = sys.stderr) -> Comparison:
    """``run_bench`` for each config in turn (the same load over different transports);
    every config is checked, and every gateway asked, before the first run starts.

    Raises:
        BenchError: bad settings, or a gateway cannot be reached.
    """
    runs = [await _prepare(config, preflight, warn) for config in configs]
    return Comparison([await _Run(*run).run() for run in runs])
