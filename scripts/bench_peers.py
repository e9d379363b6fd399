#!/usr/bin/env python
"""streamfleet beside what a user would pick instead, under one client in one run.

Three servers stream the same workload, ``--tokens`` tokens per request, over the same
two doors (OpenAI SSE and the WebSocket frames). ``--engine echo`` (the default) is the
fleet's ``EchoEngine`` with a continuous-batching step of ``--delay-ms``: no model cost,
so what shows is each server's own overhead. ``--engine bench-gpt`` is a real model
(34 M parameters, ``engines/bench-gpt``, made by ``shared/tinymodel.py --preset
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

Real model against llama.cpp (``--engine smollm2-135m``, issue 35 item 5). The same GGUF
file (SmolLM2-135M-Instruct, Q4_1) served, one server at a time, by

  llama-server       llama.cpp's own OpenAI-compatible server: continuous batching over
                     ``--llama-slots`` (16) parallel slots, ``-t``/``-tb`` ``--threads``, no
                     prompt cache (``--cache-ram 0`` and ``cache_prompt: false``)
  llama-cpp-python   optional: ``python -m llama_cpp.server`` (one sequence at a time),
                     with ``--llama-cpp-python PYTHON``, an interpreter that has
                     ``llama-cpp-python[server]`` (not installed by this project)
  one-process        ``scripts/peer_app.py`` with the fleet's ``OnnxRuntimeEngine`` on the
                     imported graph (``engines/smollm2-135m``: 4-bit MatMulNBits weights,
                     fp32 activations), ``--threads`` intra-op threads
  streamfleet        one gateway + one worker (``SF_THREADS=--threads``) on a private Redis

all driven over SSE (``/v1/completions``, streaming, ``ignore_eos``, greedy) by the same
client, with a prompt of its own per request (a numbered prefix: no server can reuse a
cached prefix). Measured: decode tokens/s at c=1 (``--decode-tokens`` per request, from
its first to its last token), TTFT of a ``--prefill-tokens`` (512) prompt at c=1,
aggregate tokens/s at each ``--concurrency`` (default 4,16,64; ``--tokens`` 128 per
request, ``--rounds`` requests per stream capped at ``--max-requests``), the CPU
seconds per token of every server process (for streamfleet also gateway, worker and
Redis apart) and their peak RSS; then ratios against llama-server and against the
one-process loop, and the issue's goals. llama-server closes its connection after each
stream (a kept-alive one fails on its next request), so it gets a fresh connection per
request; the others (uvicorn, the gateway) keep theirs alive. Each phase also prints the
cores every other process of the machine kept busy meanwhile: on a shared machine that
column says which figures to trust.

llama-server is not part of this project. Build it once (about 15 minutes on 2 cores)
from the llama-cpp-python 0.3.36 source distribution, outside the repository::

    python -m scripts.llama_server build      # = pip download --no-deps --no-binary :all:
                                              #   llama-cpp-python==0.3.36, then cmake on its
                                              #   vendor/llama.cpp -DLLAMA_BUILD_SERVER=ON
                                              #   -DBUILD_SHARED_LIBS=OFF -DLLAMA_USE_PREBUILT_UI=OFF
                                              #   -DLLAMA_CURL=OFF, target llama-server, -j2
    python -m scripts.bench_peers --engine smollm2-135m [--llama-server PATH] [--threads 2]

The binary comes from ``--llama-server``, ``$LLAMA_SERVER``, ``PATH`` or
``/tmp/lcpp-build/bin/llama-server``; without one that row is skipped, with a note.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from scripts import benchtable
from scripts.bench_fleet import MODEL, write_model
from scripts.fleetstack import wait_until
from scripts.procstats import cpu_s, rss_mib, stop, tree
from streamfleet.bench import _prepare, _Run, run_bench
from streamfleet.bench_clients import _SseClient
from streamfleet.bench_config import BenchConfig
from streamfleet.bench_stats import summarize
from streamfleet.launcher import EmbeddedRedis, Fleet, free_port, spawn

REPO = Path(__file__).resolve().parent.parent

SERVERS = ("one-process", "ray-serve", "streamfleet")
#: engines that are real models imported from a GGUF file ([source] in engine.toml): the
#: llama.cpp comparison (module docstring, "Real model against llama.cpp")
REAL_ENGINES = ("smollm2-135m",)
REAL_SERVERS = ("llama-server", "llama-cpp-python", "one-process", "streamfleet")

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


#: peer_app with the engine's intra-op threads set (``PEER_THREADS``), as a worker's ``SF_THREADS``
ONE_PROCESS_THREADS_MAIN = textwrap.dedent("""
    import os, sys
    import streamfleet.workers.engines as engines

    _load = engines.load_engine

    def load_engine(spec, backend=None, **options):
        options.setdefault("threads", int(os.environ["PEER_THREADS"]))
        return _load(spec, backend, **options)

    engines.load_engine = load_engine
    sys.argv = ["peer_app", "--port", sys.argv[1]]
    from scripts.peer_app import main
    main()
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
    ``shared/tinymodel.py --preset bench`` when missing)."""
    if engine == "echo":
        return Workload(write_model(Path(tempfile.mkdtemp(prefix="sf-bench-peers-"))), delay_ms=delay_ms)
    folder = REPO / "engines" / engine
    if not (folder / "engine.toml").exists():
        print(f"generating {engine} in {folder} ...", flush=True)
        subprocess.run([sys.executable, "-m", "streamfleet.shared.tinymodel", "--out", str(folder),
                        "--preset", "bench"],
                       check=True)
    return Workload(folder.parent, model=engine, backend="onnxruntime")


def env_for(w: Workload) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SF_", "PEER_")) and k != "REDIS_URL"}
    env.update(PEER_MODEL=w.model, PEER_BACKEND=w.backend, PEER_DELAY_MS=str(w.delay_ms), PEER_MAX_BATCH="256",
               PEER_ENGINES_DIR=str(w.engines),
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    return env


@contextmanager
def one_process(w: Workload, threads: int | None = None, max_batch: int | None = None):
    """``scripts/peer_app.py`` under uvicorn; ``threads``: the engine's intra-op threads
    (passed to ``load_engine`` by a small wrapper, peer_app has no setting for it),
    ``max_batch``: its batch limit (default 256, capped by the engine's own)."""
    port = free_port()
    env = env_for(w)
    if max_batch is not None:
        env["PEER_MAX_BATCH"] = str(max_batch)
    if threads is None:
        args = [sys.executable, "-m", "scripts.peer_app", "--port", str(port)]
    else:
        args = [sys.executable, "-c", ONE_PROCESS_THREADS_MAIN, str(port)]
        env["PEER_THREADS"] = str(threads)
    p = spawn(args, env=env, stdout=subprocess.DEVNULL)
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


# -- a real model against llama.cpp (--engine smollm2-135m) ------------------------------

#: the text of every prompt after its number; repeated and cut to the length wanted
FILLER = ("The old river town kept its market on the square by the bridge. Farmers brought grain and "
          "apples, merchants weighed them on brass scales, and in the evening the boats carried the "
          "sacks down the river to the harbour, where ships waited for the tide. ")
SHORT_PROMPT = " Once upon a time, in a small village by the sea, there lived"


class Prompts:
    """Every request of the run gets a prompt of its own: ``[NNNNNN]`` (one number per
    request, so no server can serve it from a cached prefix) and then either a short
    opening (``short``) or ``FILLER`` cut to exactly ``tokens`` tokens of the model's
    tokenizer (``long``; digits are one token each, so every number gives the same count)."""

    def __init__(self, tokenizer, long_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.numbers = itertools.count(1)
        head = len(self._ids(self._head(0)))
        ids = self._ids(FILLER * (long_tokens // 20 + 2))
        for cut in range(long_tokens - head, long_tokens - head - 8, -1):
            body = tokenizer.decode(ids[:cut])
            if len(self._ids(self._head(0) + body)) == long_tokens:
                break
        self.long_body = body
        self.long_tokens = len(self._ids(self._head(0) + body))
        self.short_tokens = len(self._ids(self._head(0) + SHORT_PROMPT))

    def _ids(self, text: str) -> list[int]:
        from streamfleet.gateway.admission.chat_template import encode_prompt  # the gateway's own count

        return encode_prompt(self.tokenizer, text)

    @staticmethod
    def _head(n: int) -> str:
        return f"[{n:06d}]"

    def short(self, _i: int) -> str:
        return self._head(next(self.numbers)) + SHORT_PROMPT

    def long(self, _i: int) -> str:
        return self._head(next(self.numbers)) + self.long_body


class _FreshSse(_SseClient):
    """The bench's SSE client with a new connection for every request, closed after it:
    llama-server's HTTP server closes the connection after each stream, so a kept-alive
    one would fail on its next request (and the retry would add to its TTFT)."""

    async def open(self) -> None:  # nothing opened ahead: each request connects
        return None

    def _idle(self):
        return None

    async def request(self, rec, body: dict) -> None:
        try:
            await super().request(rec, body)
        finally:
            for conn in self.idle:
                conn.close()
                self.all.discard(conn)
            self.idle.clear()


class _PeerRun(_Run):
    """``streamfleet.bench``'s run (the same closed loop, SSE parser and timing) with a
    prompt per request, extra body fields for one server (llama-server's
    ``cache_prompt: false``), and optionally a fresh connection per request."""

    def __init__(self, cfg: BenchConfig, ws_url: str, base: str, on_start, *, prompt: Callable[[int], str],
                 extra: dict, fresh: bool) -> None:
        super().__init__(cfg, ws_url, base, on_start)
        self.prompt, self.extra, self.fresh = prompt, extra, fresh

    def _body(self, i: int, lane: str) -> dict:
        body = super()._body(i, lane)
        body["prompt"] = self.prompt(i)
        body.update(self.extra)
        return body

    def _connections(self):
        if self.fresh:
            return [_FreshSse(self.base, self.cfg)], self.base
        return super()._connections()


@dataclass
class Peer:
    """A running server of the real-model comparison: its URL, its processes (a list, or
    ``FleetProcs``), what every request body adds, and whether connections are kept."""

    name: str
    url: str
    procs: Callable
    extra: dict = field(default_factory=dict)
    fresh: bool = False
    note: str = ""


def peak_rss_mib(procs: list[psutil.Process]) -> float:
    """The sum of the processes' peak resident sets (VmHWM), MiB."""
    total = 0
    for p in procs:
        try:
            for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, ValueError):
            continue
    return total / 2**20


def machine_cpu_s() -> tuple[float, float]:
    """CPU seconds the whole machine has been busy (all processes, all cores; guest time
    is already in user), and the seconds the hypervisor stole from it."""
    t = psutil.cpu_times()
    return sum(getattr(t, k, 0.0) for k in ("user", "nice", "system", "irq", "softirq")), getattr(t, "steal", 0.0)


def procs_by_name(peer: Peer) -> dict[str, list[psutil.Process]]:
    return peer.procs(by_name=True) if isinstance(peer.procs, FleetProcs) else {"server": peer.procs()}


async def real_phase(peer: Peer, model: str, *, concurrency: int, requests: int, max_tokens: int,
                     prompt: Callable[[int], str]) -> dict:
    """One closed-loop load on ``peer``; its figures with the servers' CPU (sampled over
    exactly the measured run) and the CPU every other process of the machine used meanwhile."""
    cfg = BenchConfig(url=peer.url, transport="sse", concurrency=concurrency, requests=requests,
                      max_tokens=max_tokens, model=model, timeout=600)
    before: dict = {}

    def on_start() -> None:
        before.update(cpu={k: cpu_s(v) for k, v in procs_by_name(peer).items()}, machine=machine_cpu_s(),
                      me=resource.getrusage(resource.RUSAGE_SELF), t=time.perf_counter())

    res = await _PeerRun(*await _prepare(cfg, False, None), on_start, prompt=prompt, extra=peer.extra,
                         fresh=peer.fresh).run()
    ps = procs_by_name(peer)
    cpu1, machine1 = {k: cpu_s(v) for k, v in ps.items()}, machine_cpu_s()
    me1 = resource.getrusage(resource.RUSAGE_SELF)
    wall = time.perf_counter() - before["t"]
    server = {k: cpu1[k] - before["cpu"].get(k, 0.0) for k in cpu1}
    me0 = before["me"]
    client = (me1.ru_utime + me1.ru_stime) - (me0.ru_utime + me0.ru_stime)
    tokens = max(res.tokens, 1)
    decode = []  # per request: tokens after the first over the time from the first to the last
    for r in res.ok:
        if r.tokens >= 2 and len(r.token_times) >= 2 and r.token_times[-1] > r.token_times[0]:
            decode.append((r.tokens - 1) / (r.token_times[-1] - r.token_times[0]))
    return {"c": concurrency, "requests": len(res.records), "tokens": res.tokens, "wall_s": res.wall_s,
            "tokens_per_s": res.tokens / max(res.wall_s, 1e-9), "ttft": summarize(res.ttft_ms()),
            "itl": summarize(res.itl_ms()), "decode_tokens_per_s": summarize(decode), "errors": res.errors,
            "server_cpu_s_per_token": sum(server.values()) / tokens,
            "process_cpu_s_per_token": {k: v / tokens for k, v in server.items()},
            "server_cores": sum(server.values()) / max(wall, 1e-9),
            "client_cpu_s_per_token": client / tokens,
            "other_cores": max(0.0, (machine1[0] - before["machine"][0]) - sum(server.values()) - client)
            / max(wall, 1e-9),
            "steal_cores": (machine1[1] - before["machine"][1]) / max(wall, 1e-9),
            "rss_mib": sum(rss_mib(v) for v in ps.values())}


async def real_suite(peer: Peer, model: str, prompts: Prompts, args, concurrencies: list[int]) -> dict:
    """Warm-up, then decode at c=1, the long prompt's TTFT at c=1, and the aggregate
    throughput at each concurrency, on one server."""
    # warm-up (not measured): the engine's first runs at each shape, the long prompt once
    await real_phase(peer, model, concurrency=1, requests=1, max_tokens=4, prompt=prompts.long)
    top = min(max(concurrencies), 16)
    await real_phase(peer, model, concurrency=top, requests=top, max_tokens=8, prompt=prompts.short)
    out: dict = {}
    out["decode"] = await real_phase(peer, model, concurrency=1, requests=args.decode_requests,
                                     max_tokens=args.decode_tokens, prompt=prompts.short)
    out["prefill"] = await real_phase(peer, model, concurrency=1, requests=args.prefill_requests, max_tokens=2,
                                      prompt=prompts.long)
    out["load"] = {}
    for c in concurrencies:
        n = max(c, min(c * args.rounds, args.max_requests))
        out["load"][c] = await real_phase(peer, model, concurrency=c, requests=n, max_tokens=args.tokens,
                                          prompt=prompts.short)
    ps = procs_by_name(peer)
    out["peak_rss_mib"] = sum(peak_rss_mib(v) for v in ps.values())
    out["peak_rss_by_process"] = {k: peak_rss_mib(v) for k, v in ps.items()}
    return out


def _wait_up(probe: str, name: str, proc: subprocess.Popen, log: Path) -> None:
    """Wait until ``probe`` answers 200 (two minutes at most); on failure, the tail of the
    server's log on stderr."""
    try:
        wait_until(lambda: httpx.get(probe, timeout=1).status_code == 200, 120, name,
                   lambda: [name] if proc.poll() is not None else [])
    except RuntimeError:
        print(log.read_text()[-3000:], file=sys.stderr)
        raise


@contextmanager
def llama_server_peer(binary: Path, gguf: Path, args):
    from scripts import llama_server

    port = free_port()
    ctx = max(1024, args.prefill_tokens + args.tokens + 64, 32 + args.decode_tokens)
    log = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
    with llama_server.start(binary, gguf, port, threads=args.threads, slots=args.llama_slots, ctx_per_slot=ctx,
                            log=log) as p:
        url = f"http://127.0.0.1:{port}"
        _wait_up(url + "/health", "llama-server", p, log)
        yield Peer("llama-server", url, lambda: tree([p.pid]), extra={"cache_prompt": False}, fresh=True,
                   note=f"-t {args.threads} -tb {args.threads} -np {args.llama_slots} -c {args.llama_slots * ctx} "
                        f"--cache-ram 0, cache_prompt false")


@contextmanager
def llama_cpp_python_peer(python: str, gguf: Path, args):
    """``python -m llama_cpp.server`` (one sequence at a time; ``--logits_all False``: its
    default keeps the logits of every prompt token, which no completion here asks for); it
    has no ``ignore_eos``: the end-of-sequence tokens get a logit bias of -100 instead."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="llama-cpp-python-", suffix=".log")[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "SF_", "PEER_"))}
    ctx = max(1024, args.prefill_tokens + args.tokens + 64)
    with open(log, "wb") as out:
        p = spawn([python, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                   "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads), "--n_ctx", str(ctx),
                   "--interrupt_requests", "False", "--logits_all", "False", "--verbose", "False"],
                  env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_up(url + "/v1/models", "llama-cpp-python", p, log)
        yield Peer("llama-cpp-python", url, lambda: tree([p.pid]),
                   extra={"logit_bias": {str(t): -100 for t in args.eos_ids}},
                   note=f"n_threads {args.threads}, n_ctx {ctx}, logits_all False, interrupt_requests False, "
                        f"one sequence at a time")
    finally:
        stop(p)


@contextmanager
def one_process_peer(w: Workload, args):
    with one_process(w, threads=args.threads, max_batch=args.max_batch) as (url, procs):
        yield Peer("one-process", url, procs, note=f"OnnxRuntimeEngine, {args.threads} intra-op threads, "
                                                   f"max batch {args.max_batch}")


@contextmanager
def streamfleet_peer(w: Workload, args):
    with streamfleet(w, {"SF_THREADS": str(args.threads), "SF_MAX_BATCH": str(args.max_batch)}) as (url, procs):
        yield Peer("streamfleet", url, procs, note=f"1 gateway + 1 worker, SF_THREADS={args.threads}, "
                                                   f"SF_MAX_BATCH={args.max_batch}")


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or not b:
        return "-"
    return f"{a / b:.2f}x"


def real_metrics(r: dict) -> dict[str, float | None]:
    """The figures of one server's suite the table shows (None where missing)."""
    m: dict[str, float | None] = {
        "decode": r["decode"]["decode_tokens_per_s"]["p50"],
        "ttft": r["prefill"]["ttft"]["p50"],
    }
    for c, row in r["load"].items():
        m[f"c{c}"] = row["tokens_per_s"]
    return m


def render_real(results: dict[str, dict], concurrencies: list[int], prompts: Prompts, args) -> str:
    cols = [("decode", "c=1 dec tok/s"), ("ttft", f"TTFT{args.prefill_tokens} ms")] + \
           [(f"c{c}", f"c={c} tok/s") for c in concurrencies]
    lines = [f"{'server':<17}" + "".join(f"{h:>15}" for _, h in cols)
             + f"{'CPU ms/tok c=1':>16}" + "".join(f"{f'c={c}':>8}" for c in concurrencies)
             + f"{'peak RSS MiB':>14}{'errors':>8}"]
    for name, r in results.items():
        m = real_metrics(r)
        cells = "".join(f"{m[k]:>15.1f}" if m.get(k) is not None else f"{'-':>15}" for k, _ in cols)
        cpu = f"{r['decode']['server_cpu_s_per_token'] * 1e3:>16.2f}" + "".join(
            f"{r['load'][c]['server_cpu_s_per_token'] * 1e3:>8.2f}" for c in concurrencies)
        errs = sum(sum(x["errors"].values()) for x in [r["decode"], r["prefill"], *r["load"].values()])
        lines.append(f"{name:<17}{cells}{cpu}{r['peak_rss_mib']:>14.0f}{errs:>8}")
    for base in ("llama-server", "one-process"):
        if base not in results:
            continue
        b = real_metrics(results[base])
        lines.append("")
        lines.append(f"against {base} (throughput: higher is better; TTFT and CPU: the ratio of times, lower is "
                     f"better)")
        for name, r in results.items():
            if name == base:
                continue
            m = real_metrics(r)
            cpu = [r["decode"]["server_cpu_s_per_token"]] + [r["load"][c]["server_cpu_s_per_token"]
                                                             for c in concurrencies]
            bcpu = [results[base]["decode"]["server_cpu_s_per_token"]] + \
                   [results[base]["load"][c]["server_cpu_s_per_token"] for c in concurrencies]
            lines.append(f"  {name:<15}" + "".join(f"{_ratio(m[k], b[k]):>15}" for k, _ in cols)
                         + f"{_ratio(cpu[0], bcpu[0]):>16}"
                         + "".join(f"{_ratio(x, y):>8}" for x, y in zip(cpu[1:], bcpu[1:]))
                         + f"{_ratio(r['peak_rss_mib'], results[base]['peak_rss_mib']):>14}")
    lines.append("")
    lines.append("goals (issue 48) for streamfleet:")
    sf, ll, op = (real_metrics(results[k]) if k in results else None
                  for k in ("streamfleet", "llama-server", "one-process"))
    rss = {k: results[k]["peak_rss_mib"] for k in ("streamfleet", "llama-server") if k in results}

    def goal(text: str, value: float | None, base: float | None, target: float, higher: bool) -> None:
        if value is None or base is None or not base:
            lines.append(f"  {text:<58} n/a (a server is missing)")
            return
        ratio = value / base
        ok = ratio >= target if higher else ratio <= target
        lines.append(f"  {text:<58} {ratio:6.2f}x  {'met' if ok else 'NOT met'}")

    c16 = "c16" if 16 in concurrencies else None
    goal("decode tok/s at c=1 >= 1.0x llama-server", sf and sf["decode"], ll and ll["decode"], 1.0, True)
    goal("aggregate tok/s at c=16 >= 2.0x llama-server", sf and c16 and sf[c16], ll and c16 and ll[c16], 2.0, True)
    goal(f"TTFT of a {args.prefill_tokens}-token prompt <= 0.5x llama-server's", sf and sf["ttft"],
         ll and ll["ttft"], 0.5, False)
    goal("the whole fleet's peak RSS <= llama-server's", rss.get("streamfleet"), rss.get("llama-server"), 1.0, False)
    goal("decode tok/s at c=1 >= 0.95x one-process ORT loop", sf and sf["decode"], op and op["decode"], 0.95, True)
    goal("aggregate tok/s at c=16 >= 0.95x one-process ORT loop", sf and c16 and sf[c16], op and c16 and op[c16],
         0.95, True)
    lines.append("")
    lines.append("per phase: wall s; cores busy: the server's, every other process's (load outside the "
                 "benchmark), stolen by the hypervisor; client CPU ms/tok; ITL p50/p99 ms; TTFT p50/p99 ms")
    for name, r in results.items():
        for label, row in [("decode c=1", r["decode"]), (f"prefill{args.prefill_tokens}", r["prefill"]),
                           *((f"c={c}", r["load"][c]) for c in concurrencies)]:
            lines.append(f"  {name:<17}{label:<12}{row['wall_s']:7.1f} s {row['server_cores']:5.2f} "
                         f"{row['other_cores']:5.2f} {row['steal_cores']:5.2f} "
                         f"{row['client_cpu_s_per_token'] * 1e3:6.2f}  "
                         f"{row['itl']['p50'] or 0:7.1f} {row['itl']['p99'] or 0:7.1f}  "
                         f"{row['ttft']['p50'] or 0:8.1f} {row['ttft']['p99'] or 0:8.1f}  "
                         f"({row['requests']} req, {row['tokens']} tok)")
    if "streamfleet" in results:
        r = results["streamfleet"]
        lines.append("")
        lines.append("streamfleet CPU ms per token by process; peak RSS MiB by process:")
        for label, row in [("decode c=1", r["decode"]), *((f"c={c}", r["load"][c]) for c in concurrencies)]:
            lines.append(f"  {label:<12}" + "  ".join(f"{k} {v * 1e3:6.2f}"
                                                    for k, v in row["process_cpu_s_per_token"].items()))
        lines.append("  peak RSS    " + "  ".join(f"{k} {v:6.0f}" for k, v in r["peak_rss_by_process"].items()))
    return "\n".join(lines)


def real_main(args) -> int:
    from streamfleet.shared.modelrepo import ModelRepository, ensure_artifacts, load_tokenizer
    from streamfleet.shared.packagefetch import PackageFile, fetch

    spec = ModelRepository().get(args.engine)
    ensure_artifacts(spec)  # the GGUF file fetched (or cached) and imported, once
    gguf = fetch(PackageFile.from_table(spec.source, str(spec.path / "engine.toml")))
    args.eos_ids = list(spec.eos_token_ids)
    args.max_batch = args.max_batch or spec.max_batch
    w = Workload(spec.path.parent, model=spec.name, backend="onnxruntime")
    concurrencies = [int(c) for c in (args.concurrency or "4,16,64").split(",")]
    prompts = Prompts(load_tokenizer(spec), args.prefill_tokens)
    only = (args.only or ",".join(s for s in REAL_SERVERS if s != "llama-cpp-python" or args.llama_cpp_python))
    from scripts import llama_server

    binary = llama_server.find(args.llama_server)
    from scripts.procstats import cpu_line
    from streamfleet.shared.execution import graph_path, served

    mode = served(spec)
    graph = graph_path(spec)
    print(f"{cpu_line()}\nmachine: {platform.machine()}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}; model {spec.name} "
          f"({gguf.name}; ORT graph {graph.relative_to(REPO) if graph.is_relative_to(REPO) else graph}, "
          f"execution {mode.mode + ': ' + mode.why if mode else spec.options.get('weights', 'q4')}); "
          f"{args.threads} threads per server", flush=True)
    print(f"load: prompts {prompts.short_tokens} tokens, {args.decode_tokens} tokens at c=1 "
          f"({args.decode_requests} requests); TTFT of a {prompts.long_tokens}-token prompt at c=1 "
          f"({args.prefill_requests} requests); {args.tokens} tokens/request at c={','.join(map(str, concurrencies))} "
          f"(requests: max(c, min(c*{args.rounds}, {args.max_requests}))); SSE /v1/completions, ignore_eos, greedy; "
          f"client: streamfleet.bench in this process", flush=True)
    starters = {
        "llama-server": (lambda: llama_server_peer(binary, gguf, args)) if binary else None,
        "llama-cpp-python": (lambda: llama_cpp_python_peer(args.llama_cpp_python, gguf, args))
        if args.llama_cpp_python else None,
        "one-process": lambda: one_process_peer(w, args),
        "streamfleet": lambda: streamfleet_peer(w, args),
    }
    results: dict[str, dict] = {}
    notes: list[str] = []
    for name in only.split(","):
        if name not in starters:
            raise SystemExit(f"--only: unknown server {name!r} (real mode: {', '.join(REAL_SERVERS)})")
        if starters[name] is None:
            why = ("no llama-server binary (--llama-server PATH or LLAMA_SERVER; build it with "
                   "`python -m scripts.llama_server build`)" if name == "llama-server"
                   else "no --llama-cpp-python PYTHON (an interpreter with llama-cpp-python[server])")
            print(f"  {name}: skipped: {why}", flush=True)
            notes.append(f"{name}: skipped: {why}")
            continue
        t0 = time.monotonic()
        load0 = os.getloadavg()[0]
        with starters[name]() as peer:
            results[name] = asyncio.run(real_suite(peer, spec.name, prompts, args, concurrencies))
            notes.append(f"{name}: {peer.note}")
        print(f"  {name}: {time.monotonic() - t0:.0f} s (load average {load0:.2f} before, "
              f"{os.getloadavg()[0]:.2f} after)", flush=True)
    print()
    print(render_real(results, concurrencies, prompts, args))
    print()
    for n in notes:
        print(f"  {n}")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "notes": notes, "concurrency": concurrencies},
                                              indent=1, default=str))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__[__doc__.index("Real model against llama.cpp"):],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default=None, help="default 1,8,64,256; real mode 4,16,64")
    ap.add_argument("--doors", default="sse,ws", help="sse,ws (real mode: SSE only)")
    ap.add_argument("--only", default=None,
                    help=f"servers to run: {','.join(SERVERS)}; real mode: {','.join(REAL_SERVERS)} "
                         f"(llama-cpp-python only with --llama-cpp-python)")
    ap.add_argument("--engine", default="echo", choices=("echo", "bench-gpt", *REAL_ENGINES),
                    help="echo: the EchoEngine (the fleet's own overhead); bench-gpt: a real model on ONNX Runtime; "
                         "smollm2-135m: the real-model mode, llama.cpp's llama-server against the one-process ORT "
                         "loop and streamfleet on the same GGUF file")
    ap.add_argument("--delay-ms", type=float, default=10.0, help="echo engine: time per step")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per request (default 16; real mode 128)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="requests per stream slot at each concurrency (default 4; real mode 2)")
    ap.add_argument("--min-requests", type=int, default=40)
    real = ap.add_argument_group("real-model mode (--engine smollm2-135m)")
    real.add_argument("--llama-server", default=None, metavar="PATH",
                      help="llama.cpp's llama-server binary (default: $LLAMA_SERVER, PATH, "
                           "/tmp/lcpp-build/bin/llama-server; none: that row is skipped)")
    real.add_argument("--llama-slots", type=int, default=16, help="llama-server -np (parallel slots)")
    real.add_argument("--llama-cpp-python", default=os.environ.get("LLAMA_CPP_PYTHON"), metavar="PYTHON",
                      help="an interpreter with llama-cpp-python[server]: adds `python -m llama_cpp.server` "
                           "(one sequence at a time; default $LLAMA_CPP_PYTHON, else skipped)")
    real.add_argument("--threads", type=int, default=2,
                      help="threads of every server: llama-server -t/-tb, ORT intra-op (SF_THREADS)")
    real.add_argument("--max-batch", type=int, default=None,
                      help="the ORT loops' batch limit (default: engine.toml's max_batch)")
    real.add_argument("--decode-tokens", type=int, default=128, help="tokens per request of the c=1 decode run")
    real.add_argument("--decode-requests", type=int, default=3)
    real.add_argument("--prefill-tokens", type=int, default=512, help="prompt length of the TTFT run")
    real.add_argument("--prefill-requests", type=int, default=5)
    real.add_argument("--max-requests", type=int, default=32,
                      help="at most this many requests per concurrency (and at least c)")
    real.add_argument("--json", default=None, metavar="FILE", help="also write every figure to FILE")
    benchtable.add_argument(ap)
    args = ap.parse_args()
    if args.engine in REAL_ENGINES:
        args.tokens = args.tokens or 128
        args.rounds = args.rounds or 2
        return real_main(args)
    args.tokens = args.tokens or 16
    args.rounds = args.rounds or 4
    args.only = args.only or ",".join(SERVERS)
    w = workload(args.engine, args.delay_ms)
    concurrencies = [int(c) for c in (args.concurrency or "1,8,64,256").split(",")]
    doors = args.doors.split(",")
    from scripts.procstats import cpu_line

    print(cpu_line(), flush=True)
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
    sys.exit(benchtable.main(main))
