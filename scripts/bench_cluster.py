#!/usr/bin/env python
"""The broker on one Redis against a 3-shard Redis Cluster, side by side in one run
(docs/cluster.md, "Capacity").

For each broker the same fleet is started from scratch (``streamfleet gateway`` and
``streamfleet worker --backend echo`` processes, the echo engine so the model costs
nothing and the broker's own cost shows), and the same WebSocket load is run from this
process: a closed loop at concurrency 1 (latency) and at ``--concurrency`` (throughput).
Reported per broker: tokens/s, TTFT p50/p99, and the Redis CPU each delivered token
cost (``used_cpu_user + used_cpu_sys`` of every primary, before and after), in total and
per shard; then the cluster's figures as ratios of the single server's.

The cluster is a local one (``EmbeddedCluster``: 3 primaries, no replicas by default so
every shard's CPU is the primary's own; ``--replicas 1`` adds them). On a machine with
fewer cores than processes the figures are a lower bound for the cluster: its three
Redis processes share the cores with everything else.

    python -m scripts.bench_cluster [--concurrency 64] [--seconds 10] [--tokens 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

from scripts.bench_fleet import MODEL, write_model
from scripts.fleetstack import wait_until
from streamfleet.bench import run_bench
from streamfleet.bench_config import BenchConfig
from streamfleet.bench_stats import summarize
from streamfleet.launcher import EmbeddedCluster, EmbeddedRedis, Fleet, free_port
from streamfleet.shared.redis import sync_client


def fleet_env(url: str, cluster: bool, engines: Path, delay_ms: float, **settings: object) -> dict[str, str]:
    """The environment of the fleet's processes: the echo model of ``write_model`` on
    the broker at ``url``; ``settings`` add or override ``SF_*`` settings by name
    (``log_level="info"`` is ``SF_LOG_LEVEL=info``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SF_") and k != "REDIS_URL"}
    env.update(SF_REDIS_URL=url, SF_REDIS_CLUSTER=str(cluster).lower(), SF_LOG_LEVEL="warning",
               SF_ENGINES_DIR=str(engines), SF_MODEL=MODEL, SF_DEFAULT_MODEL=MODEL, SF_MODELS=MODEL,
               SF_BACKEND="echo", SF_ECHO_DELAY_MS=str(delay_ms), SF_MAX_BATCH="256", SF_GRPC_PORT="0",
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env.update({f"SF_{k.upper()}": str(v) for k, v in settings.items()})
    return env


@dataclass
class Broker:
    name: str
    cluster: bool
    replicas: int = 0
    server: object = None
    fleet: Fleet = field(default_factory=Fleet)
    port: int = 0

    @property
    def url(self) -> str:
        return self.server.url

    def primaries(self) -> list[int]:
        if self.cluster:
            return self.server.primary_ports()
        return [self.server.port]

    def redis_cpu(self) -> dict[int, float]:
        out = {}
        for port in self.primaries():
            r = sync_client(f"redis://127.0.0.1:{port}")
            try:
                info = r.info("cpu")
                out[port] = float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
            finally:
                r.close()
        return out

    def start(self, engines: Path, delay_ms: float) -> Broker:
        self.server = (EmbeddedCluster(3, self.replicas) if self.cluster else EmbeddedRedis()).start()
        env = fleet_env(self.url, self.cluster, engines, delay_ms)
        self.fleet.start("worker", ["worker"], env)
        self.port = free_port()
        self.fleet.start("gateway", ["gateway", "--port", str(self.port)], env)
        r = sync_client(self.url, cluster=self.cluster)
        try:
            wait_until(lambda: r.hlen(f"sf:workers:{MODEL}") >= 1, 90, "the worker", self.fleet.dead)
        finally:
            r.close()
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{self.port}/readyz", timeout=1).status_code == 200, 90,
                   "the gateway", self.fleet.dead)
        return self

    def stop(self) -> None:
        self.fleet.stop()
        if self.server is not None:
            self.server.stop()


async def measure(b: Broker, args) -> dict:
    url = f"http://127.0.0.1:{b.port}"
    base = {"url": url, "model": MODEL, "max_tokens": args.tokens, "prompt_tokens": 8}
    c1 = await run_bench(BenchConfig(concurrency=1, requests=args.c1_requests, warmup=3, **base), warn=None)
    before = b.redis_cpu()
    load = await run_bench(BenchConfig(concurrency=args.concurrency, duration=args.seconds,
                                       warmup=args.concurrency, **base), warn=None)
    after = b.redis_cpu()
    tokens = max(load.tokens, 1)
    cpu = {port: after[port] - before.get(port, 0.0) for port in after}
    return {
        "broker": b.name,
        "tokens_per_s": load.tokens / max(load.wall_s, 1e-9),
        "errors": load.errors,
        "ttft_c1": summarize(c1.ttft_ms()),
        "ttft_load": summarize(load.ttft_ms()),
        "redis_cpu_us_per_token": sum(cpu.values()) / tokens * 1e6,
        "redis_cpu_us_per_token_by_shard": {str(p): v / tokens * 1e6 for p, v in sorted(cpu.items())},
        "redis_cpu_busiest_share": max(cpu.values()) / max(sum(cpu.values()), 1e-9),
    }


def table(rows: list[dict], concurrency: int) -> str:
    head = (f"{'broker':<16}{'tok/s':>9}{'TTFT c=1 p50/p99 ms':>22}{f'TTFT c={concurrency} p50/p99 ms':>24}"
            f"{'Redis CPU µs/token':>20}  per shard (µs/token)")
    lines = [head, "-" * len(head)]
    for r in rows:
        shards = " / ".join(f"{v:.1f}" for v in r["redis_cpu_us_per_token_by_shard"].values())
        lines.append(f"{r['broker']:<16}{r['tokens_per_s']:>9.0f}"
                     f"{r['ttft_c1']['p50']:>13.1f} / {r['ttft_c1']['p99']:<6.1f}"
                     f"{r['ttft_load']['p50']:>15.1f} / {r['ttft_load']['p99']:<6.1f}"
                     f"{r['redis_cpu_us_per_token']:>18.1f}  {shards}")
    if len(rows) == 2:
        s, c = rows
        lines.append("")
        lines.append(f"cluster / single: tokens/s {c['tokens_per_s'] / s['tokens_per_s']:.2f}, "
                     f"TTFT c=1 p50 {c['ttft_c1']['p50'] / s['ttft_c1']['p50']:.2f}, "
                     f"TTFT c={concurrency} p99 {c['ttft_load']['p99'] / s['ttft_load']['p99']:.2f}, "
                     f"Redis CPU per token {c['redis_cpu_us_per_token'] / s['redis_cpu_us_per_token']:.2f} "
                     f"(busiest shard {c['redis_cpu_busiest_share'] * 100:.0f}% of it)")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--tokens", type=int, default=32, help="tokens per request")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="echo engine time per step")
    ap.add_argument("--c1-requests", type=int, default=40)
    ap.add_argument("--replicas", type=int, default=0, help="replicas per cluster shard")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    engines = write_model(Path(tempfile.mkdtemp(prefix="sf-bench-cluster-")))
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; echo engine {args.delay_ms:g} ms/step, "
          f"{args.tokens} tokens/request, 1 gateway + 1 worker", flush=True)
    rows = []
    for b in (Broker("single Redis", False), Broker("cluster 3 shards", True, args.replicas)):
        try:
            b.start(engines, args.delay_ms)
            rows.append(asyncio.run(measure(b, args)))
        finally:
            b.stop()
        print(f"  {b.name}: done", flush=True)
    print(table(rows, args.concurrency))
    if args.json:
        Path(args.json).write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
