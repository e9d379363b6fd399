#!/usr/bin/env python
"""Idle connections on one gateway: memory per idle WebSocket, and what 1,000 idle
connections do to 50 active streams — side by side in one run.

Starts a private redis-server, one gateway and one echo worker (10 ms per step, so the
model costs nothing and the gateway is what is measured), then:

  1. 50 concurrent streaming clients alone: TTFT and inter-token p50/p99;
  2. opens 1,000 idle WebSocket connections (each sends one ping and waits), reading the
     gateway's RSS before and after: memory per idle connection;
  3. the same 50 streaming clients again while the 1,000 stay open.

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


from streamfleet.bench import BenchConfig, run_bench  # noqa: E402
from streamfleet.launcher import EmbeddedRedis, Fleet, free_port, wait_ready  # noqa: E402


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))] if s else float("nan")


async def active(url: str, n: int, requests: int) -> dict:
    cfg = BenchConfig(url=url, transport="ws", concurrency=n, requests=requests, max_tokens=32, warmup=n)
    res = await run_bench(cfg)
    t, i = res.ttft_ms(), res.itl_ms()
    return {"ttft_p50": statistics.median(t), "ttft_p99": pct(t, 99), "itl_p50": statistics.median(i),
            "itl_p99": pct(i, 99), "errors": sum(res.errors.values()), "ok": len(res.ok)}


async def open_idle(ws_url: str, n: int) -> list:
    conns = []
    for start in range(0, n, 100):  # in batches, so the handshakes do not all time out at once
        batch = await asyncio.gather(*(websockets.connect(ws_url, max_size=None, compression=None)
                                       for _ in range(min(100, n - start))))
        for ws in batch:
            await ws.send('{"type":"ping"}')
        for ws in batch:
            await ws.recv()
        conns += batch
    return conns


async def main_async(args, http: str, gw_pid: int) -> None:
    ws_url = http.replace("http", "ws") + "/v1/stream"
    gw = psutil.Process(gw_pid)
    alone = await active(http, args.active, args.requests)
    rss0 = gw.memory_info().rss
    t0 = time.perf_counter()
    conns = await open_idle(ws_url, args.idle)
    opened_s = time.perf_counter() - t0
    await asyncio.sleep(1.0)
    rss1 = gw.memory_info().rss
    with_idle = await active(http, args.active, args.requests)
    still_open = sum(1 for c in conns if c.state.name == "OPEN")
    await asyncio.gather(*(c.close() for c in conns))

    per_conn = (rss1 - rss0) / args.idle
    print(f"\none gateway process, {args.idle} idle WebSockets, {args.active} active streams, "
          f"{os.cpu_count()} cores (echo engine, 10 ms/step, 32 tokens/request)")
    print(f"idle connections: opened in {opened_s:.1f} s, {still_open} still open at the end; "
          f"gateway RSS {rss0 / 2**20:.1f} MiB -> {rss1 / 2**20:.1f} MiB = {per_conn / 1024:.1f} KiB per idle connection")
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
        port = free_port()
        gw = fleet.start("gateway", ["gateway", "--port", str(port)], env)
        fleet.start("worker", ["worker", "--backend", "echo"], dict(env, SF_ECHO_DELAY_MS="10", SF_MAX_BATCH="64"))
        http = f"http://127.0.0.1:{port}"
        if not wait_ready(http):
            raise RuntimeError("fleet not ready")
        asyncio.run(main_async(args, http, gw.pid))
    finally:
        fleet.stop()
        rds.stop()


if __name__ == "__main__":
    main()
