#!/usr/bin/env python
"""Idle connections on one gateway: memory per idle WebSocket, and what 1,000 idle
connections do to 50 active streams — side by side in one run.

Starts a private redis-server, three gateways and one echo worker (10 ms per step, so
the model costs nothing and the gateway is what is measured), then:

  1. 50 concurrent streaming clients alone on each gateway (which also warms each alike):
     TTFT and inter-token p50/p99 on A;
  2. opens 1,000 idle WebSocket connections (each sends one ping and waits) on each
     gateway, reading each gateway's RSS before and after: memory per idle connection
     when the client offers no compression (A), when it offers per-message deflate as
     every browser does and the gateway declines it (B, the default), and when the
     gateway accepts it (C, ``SF_WS_COMPRESSION=true``: 512-byte windows);
  3. the same 50 streaming clients on A again while its 1,000 stay open.

Each gateway starts from the same state, so the three figures compare directly.

    python -m scripts.bench_idle [--idle 1000] [--active 50] [--requests 200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import psutil
import websockets

from streamfleet.bench import run_bench
from streamfleet.bench_config import BenchConfig
from streamfleet.launcher import EmbeddedRedis, Fleet, free_port, wait_ready


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))] if s else float("nan")


async def active(url: str, n: int, requests: int) -> dict:
    cfg = BenchConfig(url=url, transport="ws", concurrency=n, requests=requests, max_tokens=32, warmup=n)
    res = await run_bench(cfg)
    t, i = res.ttft_ms(), res.itl_ms()
    return {"ttft_p50": statistics.median(t), "ttft_p99": pct(t, 99), "itl_p50": statistics.median(i),
            "itl_p99": pct(i, 99), "errors": sum(res.errors.values()), "ok": len(res.ok)}


async def open_idle(ws_url: str, n: int, compression: str | None = None) -> list:
    conns = []
    for start in range(0, n, 100):  # in batches, so the handshakes do not all time out at once
        batch = await asyncio.gather(*(websockets.connect(ws_url, max_size=None, compression=compression)
                                       for _ in range(min(100, n - start))))
        for ws in batch:
            await ws.send('{"type":"ping"}')
        for ws in batch:
            await ws.recv()
        conns += batch
    return conns


async def idle_cost(http: str, pid: int, n: int, compression: str | None) -> tuple[float, list, bool]:
    """KiB of gateway RSS per idle connection; the connections; whether deflate was agreed."""
    gw = psutil.Process(pid)
    ws_url = http.replace("http", "ws") + "/v1/stream"
    rss0 = gw.memory_info().rss
    conns = await open_idle(ws_url, n, compression)
    await asyncio.sleep(1.0)
    agreed = any("permessage-deflate" in (c.response.headers.get("Sec-WebSocket-Extensions") or "") for c in conns)
    return (gw.memory_info().rss - rss0) / n / 1024, conns, agreed


async def main_async(args, urls: list[str], pids: list[int]) -> None:
    # the same load on every gateway first: the "alone" figures (on A), and each heap warmed
    # alike, so that the three memory figures compare
    alone = next(await active(url, args.active, args.requests) for url in urls)
    t0 = time.perf_counter()
    rows, idle = [], []
    for (name, comp), url, pid in zip((("no compression offered", None), ("deflate offered, declined (default)",
                                                                          "deflate"),
                                       ("deflate offered, accepted (SF_WS_COMPRESSION=true)", "deflate")),
                                      urls, pids):
        kib, conns, agreed = await idle_cost(url, pid, args.idle, comp)
        rows.append((name, kib, agreed))
        idle += conns
    opened_s = time.perf_counter() - t0
    with_idle = await active(urls[0], args.active, args.requests)
    still_open = sum(1 for c in idle if c.state.name == "OPEN")
    await asyncio.gather(*(c.close() for c in idle))

    print(f"\n{args.idle} idle WebSockets on each of three gateways, {args.active} active streams on the first, "
          f"{os.cpu_count()} cores (echo engine, 10 ms/step, 32 tokens/request)")
    print(f"idle connections opened in {opened_s:.1f} s, {still_open} of {len(idle)} still open at the end")
    for name, kib, agreed in rows:
        print(f"  {name:52} {kib:5.1f} KiB ({kib * 1.024:.1f} kB) per idle connection"
              f"{'  [deflate negotiated]' if agreed else ''}")
    print(f"{'':24} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'errors':>6}")
    for name, r in ((f"{args.active} active alone", alone), (f"{args.active} active + {args.idle} idle", with_idle)):
        print(f"{name:24} {r['ttft_p50']:9.1f} {r['ttft_p99']:9.1f} {r['itl_p50']:8.1f} {r['itl_p99']:8.1f} "
              f"{r['errors']:6d}")
    print(f"ratio (with idle / alone): TTFT p50 {with_idle['ttft_p50'] / alone['ttft_p50']:.2f}x, "
          f"p99 {with_idle['ttft_p99'] / alone['ttft_p99']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--idle", type=int, default=1000)
    ap.add_argument("--active", type=int, default=50)
    ap.add_argument("--requests", type=int, default=200)
    args = ap.parse_args()
    rds = EmbeddedRedis().start()
    env = dict(os.environ, SF_REDIS_URL=rds.url, SF_LOG_LEVEL="warning", SF_MAX_CONNECTIONS=str(args.idle + 500))
    fleet = Fleet()
    try:
        urls, pids = [], []
        for compression in ("false", "false", "true"):
            port = free_port()
            gw = fleet.start("gateway", ["gateway", "--port", str(port)],
                             dict(env, SF_WS_COMPRESSION=compression, SF_GRPC_PORT="0"))
            urls.append(f"http://127.0.0.1:{port}")
            pids.append(gw.pid)
        fleet.start("worker", ["worker", "--backend", "echo"], dict(env, SF_ECHO_DELAY_MS="10", SF_MAX_BATCH="64"))
        for http in urls:
            if not wait_ready(http):
                raise RuntimeError("fleet not ready")
        asyncio.run(main_async(args, urls, pids))
    finally:
        fleet.stop()
        rds.stop()


if __name__ == "__main__":
    main()
