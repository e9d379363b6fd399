#!/usr/bin/env python
"""streamfleet beside what a user would pick instead, under one client in one run.

Three servers stream the same workload, ``--tokens`` tokens per request, over the same
two doors (OpenAI SSE and the WebSocket frames). ``--engine echo`` (the default) is the
fleet's ``EchoEngine`` with a continuous-batching step of ``--delay-ms``: no model cost,
so what shows is each server's own overhead. ``--engine bench-gpt`` is a real model
(34 M parameters, ``engines/bench-gpt``, made by ``scripts/make_tiny_model.py --preset
bench`` when missing) on ONNX Runtime, the same engine class in all three servers.

  one-process  ``scripts/peer_app.py`` under uvicorn: the batching loop in the server's
               own event loop, the engine on a thread (the limit any fleet is measured
               against)
  ray-serve    the same FastAPI app as a Ray Serve deployment behind Ray's HTTP proxy
               (Ray 2.60: ``pip install -e '.[peers]'``; skipped when Ray is missing)
  streamfleet  one gateway + one worker on a private Redis

For each server, door and concurrency (closed loop): TTFT p50/p99, inter-token p99,
tokens/s, CPU per token of every server process (psutil, the process tree; for
streamfleet also gateway, worker and Redis apart, with the tokens/s one gateway process
would carry on a core of its own), and their memory; then the peers' figures as
differences and ratios against the one-process server. The client is
``streamfleet.bench`` in this process (WebSocket: the ``websockets`` client; SSE: a
keep-alive connection pool parsed straight off the socket); its own CPU per token is
printed with every row, so a client that cost too much shows.

    python -m scripts.bench_peers [--engine echo|bench-gpt] [--concurrency 1,8,64,256] [--doors sse,ws]
                                  [--only one-process,ray-serve,streamfleet]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import resource
import subprocess
import sys
import tempfile
import textwrap
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from streamfleet.bench import BenchConfig, run_bench, summarize
from streamfleet.launcher import EmbeddedRedis, Fleet, free_port, spawn

from scripts.bench_fleet import MODEL, wait_until, write_model

REPO = Path(__file__).resolve().parent.parent
from scripts.procstats import cpu_s, rss_mib, stop, tree

SERVERS = ("one-process", "ray-serve", "streamfleet")

RAY_MAIN = textwrap.dedent("""
    import os, signal, threading
    import ray
    from ray import serve
    from scripts.peer_app import app as peer

    @serve.deployment(max_ongoing_requests=4096)
    @serve.ingress(peer)
    class Peer:
        pass

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {k: v for k, v in os.environ.items() if k.startswith("PEER_")}})
    serve.start(http_options={"host": "127.0.0.1", "port": int(os.environ["PEER_PORT"])})
    serve.run(Peer.bind(), route_prefix="/")
    open(os.environ["PEER_READY"], "w").write("ok")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()
""")


def ray_processes() -> list[psutil.Process]:
    """Every process of the local Ray session (raylet, GCS, workers, the proxy)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "ray" in cmd and ("raylet" in cmd or "gcs_server" in cmd or "ray::" in cmd or "default_worker" in cmd
                             or "dashboard" in cmd or "log_monitor" in cmd or "monitor.py" in cmd):
            out.append(p)
    return out


@dataclass(frozen=True)
class Workload:
    """What every server runs: ``model`` in ``engines`` on ``backend`` (``echo``: the
    fleet's EchoEngine, ``delay_ms`` per step; ``onnxruntime``: a real model on the CPU)."""

    engines: Path
    model: str = MODEL
    backend: str = "echo"
    delay_ms: float = 10.0

    def describe(self) -> str:
        if self.backend == "echo":
            return f"echo engine {self.delay_ms:g} ms/step"
        return f"{self.model} on {self.backend}"


def workload(engine: str, delay_ms: float) -> Workload:
    """``echo`` (in a temporary folder), or ``bench-gpt`` (``engines/bench-gpt``, made by
    ``scripts/make_tiny_model.py --preset bench`` when missing)."""
    if engine == "echo":
        return Workload(write_model(Path(tempfile.mkdtemp(prefix="sf-bench-peers-"))), delay_ms=delay_ms)
    folder = REPO / "engines" / engine
    if not (folder / "model.onnx").exists():
        print(f"generating {engine} in {folder} ...", flush=True)
        subprocess.run([sys.executable, "-m", "scripts.make_tiny_model", "--out", str(folder), "--preset", "bench"],
                       check=True)
    return Workload(folder.parent, model=engine, backend="onnxruntime")


def env_for(w: Workload) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SF_", "PEER_")) and k != "REDIS_URL"}
    env.update(PEER_MODEL=w.model, PEER_BACKEND=w.backend, PEER_DELAY_MS=str(w.delay_ms), PEER_MAX_BATCH="256",
               PEER_ENGINES_DIR=str(w.engines),
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    return env


@contextmanager
def one_process(w: Workload):
    port = free_port()
    p = spawn([sys.executable, "-m", "scripts.peer_app", "--port", str(port)], env=env_for(w),
              stdout=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: httpx.get(url + "/readyz", timeout=1).status_code == 200, 60, "the one-process server")
        yield url, lambda: tree([p.pid])
    finally:
        stop(p)


@contextmanager
def ray_serve(w: Workload):
    port = free_port()
    ready = Path(tempfile.mkdtemp(prefix="sf-peers-")) / "ready"
    env = dict(env_for(w), PEER_PORT=str(port), PEER_READY=str(ready),
               RAY_USAGE_STATS_ENABLED="0", RAY_DEDUP_LOGS="0")
    p = spawn([sys.executable, "-c", RAY_MAIN], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(ready.exists, 240, "Ray Serve", lambda: ["ray"] if p.poll() is not None else [])
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: httpx.get(url + "/readyz", timeout=2).status_code == 200, 120, "the Ray Serve route")
        yield url, lambda: [*tree([p.pid]), *ray_processes()]
    finally:
        stop(p, 60)
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], capture_output=True)


class FleetProcs:
    """The processes of a fleet started by ``streamfleet``: ``procs()`` all of them (with
    their children), ``procs(by_name=True)`` as ``{"gateway": […], "worker": […], "redis": […]}``."""

    def __init__(self, gateway: int, worker: int, redis: int, redis_url: str) -> None:
        self.pids = {"gateway": gateway, "worker": worker, "redis": redis}
        self.redis_url = redis_url

    def __call__(self, by_name: bool = False):
        named = {name: tree([pid]) for name, pid in self.pids.items()}
        return named if by_name else [p for ps in named.values() for p in ps]


@contextmanager
def streamfleet(w: Workload, extra_env: dict[str, str] | None = None):
    redis = EmbeddedRedis().start()
    fleet = Fleet()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SF_") and k != "REDIS_URL"}
    env.update(SF_REDIS_URL=redis.url, SF_LOG_LEVEL="warning", SF_ENGINES_DIR=str(w.engines), SF_MODEL=w.model,
               SF_DEFAULT_MODEL=w.model, SF_MODELS=w.model, SF_BACKEND=w.backend, SF_ECHO_DELAY_MS=str(w.delay_ms),
               SF_MAX_BATCH="256", SF_GRPC_PORT="0", SF_MAX_CONNECTIONS="4096",
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env.update(extra_env or {})  # overrides the defaults above
    try:
        worker = fleet.start("worker", ["worker"], env)
        port = free_port()
        gateway = fleet.start("gateway", ["gateway", "--port", str(port)], env)
        url = f"http://127.0.0.1:{port}"
        import redis as redis_py

        r = redis_py.Redis.from_url(redis.url)
        wait_until(lambda: r.hlen(f"sf:workers:{w.model}") >= 1, 90, "the worker", fleet.dead)
        r.close()
        wait_until(lambda: httpx.get(url + "/readyz", timeout=1).status_code == 200, 90, "the gateway", fleet.dead)
        yield url, FleetProcs(gateway.pid, worker.pid, redis.proc.pid, redis.url)
    finally:
        fleet.stop()
        redis.stop()


async def measure(url: str, procs, door: str, concurrency: int, args, model: str = MODEL) -> dict:
    cfg = BenchConfig(url=url, transport=door, concurrency=concurrency, model=model, max_tokens=args.tokens,
                      prompt_tokens=8, requests=max(args.min_requests, concurrency * args.rounds),
                      warmup=min(concurrency, 16), timeout=120)
    named = isinstance(procs, FleetProcs)
    ps = procs(by_name=True) if named else {"server": procs()}
    cpu0, me0 = {k: cpu_s(v) for k, v in ps.items()}, resource.getrusage(resource.RUSAGE_SELF)
    res = await run_bench(cfg, preflight=False, warn=None)
    ps = procs(by_name=True) if named else {"server": procs()}
    cpu1, me1 = {k: cpu_s(v) for k, v in ps.items()}, resource.getrusage(resource.RUSAGE_SELF)
    tokens = max(res.tokens, 1)
    per = {k: (cpu1[k] - cpu0.get(k, 0.0)) / tokens * 1e6 for k in cpu1}
    return {"door": door, "c": concurrency, "tokens_per_s": res.tokens / max(res.wall_s, 1e-9),
            "ttft": summarize(res.ttft_ms()), "itl": summarize(res.itl_ms()), "errors": res.errors,
            "server_cpu_us_per_token": sum(per.values()), "process_cpu_us_per_token": per if named else {},
            "client_cpu_us_per_token": ((me1.ru_utime + me1.ru_stime) - (me0.ru_utime + me0.ru_stime)) / tokens * 1e6,
            "server_rss_mib": sum(rss_mib(v) for v in ps.values())}


def render(results: dict[str, list[dict]]) -> str:
    lines = [f"{'server':<12}{'door':>5}{'c':>5}{'TTFT p50':>10}{'p99':>8}{'ITL p99':>9}{'tok/s':>9}"
             f"{'srv µs/tok':>12}{'RSS MiB':>9}{'client µs/tok':>15}{'errors':>8}"]
    for name, rows in results.items():
        for r in rows:
            lines.append(f"{name:<12}{r['door']:>5}{r['c']:>5}{r['ttft']['p50']:>10.1f}{r['ttft']['p99']:>8.1f}"
                         f"{r['itl']['p99']:>9.1f}{r['tokens_per_s']:>9.0f}{r['server_cpu_us_per_token']:>12.0f}"
                         f"{r['server_rss_mib']:>9.0f}{r['client_cpu_us_per_token']:>15.0f}"
                         f"{sum(r['errors'].values()):>8}")
    fleet = results.get("streamfleet") or []
    if fleet and fleet[0]["process_cpu_us_per_token"]:
        lines.append("")
        lines.append("streamfleet CPU per token by process (µs), and the tokens/s one gateway process would "
                     "deliver on a core of its own (1 s / its µs per token):")
        for r in fleet:
            per = r["process_cpu_us_per_token"]
            lines.append(f"  {r['door']:>4} c={r['c']:<4} " + "  ".join(f"{k} {v:6.1f}" for k, v in per.items())
                         + f"   gateway ceiling {1e6 / max(per['gateway'], 1e-9):9,.0f} tok/s")
    base = {(r["door"], r["c"]): r for r in results.get("one-process", [])}
    for name in ("ray-serve", "streamfleet"):
        if name not in results or not base:
            continue
        lines.append("")
        lines.append(f"{name} against one-process: added TTFT p50 / p99 (ms), tokens/s ratio")
        for r in results[name]:
            b = base.get((r["door"], r["c"]))
            if b:
                lines.append(f"  {r['door']:>4} c={r['c']:<4} {r['ttft']['p50'] - b['ttft']['p50']:+8.1f} / "
                             f"{r['ttft']['p99'] - b['ttft']['p99']:+8.1f}   "
                             f"{r['tokens_per_s'] / max(b['tokens_per_s'], 1e-9):.2f}x")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,8,64,256")
    ap.add_argument("--doors", default="sse,ws")
    ap.add_argument("--only", default=",".join(SERVERS))
    ap.add_argument("--engine", default="echo", choices=("echo", "bench-gpt"),
                    help="echo: the EchoEngine (the fleet's own overhead); bench-gpt: a real model on ONNX Runtime")
    ap.add_argument("--delay-ms", type=float, default=10.0, help="echo engine: time per step")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4, help="requests per stream slot at each concurrency")
    ap.add_argument("--min-requests", type=int, default=40)
    args = ap.parse_args()
    w = workload(args.engine, args.delay_ms)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    doors = args.doors.split(",")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; {w.describe()}, "
          f"{args.tokens} tokens/request; client: streamfleet.bench in this process", flush=True)
    starters = {"one-process": one_process, "ray-serve": ray_serve, "streamfleet": streamfleet}
    results: dict[str, list[dict]] = {}
    for name in args.only.split(","):
        if name == "ray-serve":
            try:
                import ray  # noqa: F401
            except ImportError:
                print("ray-serve: skipped (Ray is not installed: pip install -e '.[peers]')", flush=True)
                continue
        t0 = time.monotonic()
        with starters[name](w) as (url, procs):
            rows = []
            for door in doors:
                for c in concurrencies:
                    rows.append(asyncio.run(measure(url, procs, door, c, args, w.model)))
            results[name] = rows
        print(f"  {name}: {time.monotonic() - t0:.0f} s", flush=True)
    print(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
