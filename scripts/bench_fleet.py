#!/usr/bin/env python
"""What the fleet costs and what it buys, side by side in one run.

Every benchmark starts its own private redis-server (``EmbeddedRedis``) and its own
processes (``Fleet``: ``streamfleet gateway`` / ``streamfleet worker --backend echo``,
``SF_LOG_LEVEL=warning``), drives them with ``streamfleet.bench.run_bench`` over real
WebSockets from this process, and stops them again. The engine is the echo engine (no
model cost; a fixed sleep per prefill / decode call stands in for the model), on a
model folder written to a temporary directory (``echo-bench``: the tiny-gpt tokenizer,
``max_batch`` 256). Every request asks for a fixed number of tokens (``ignore_eos``).

  overhead    the fleet (1 gateway + 1 worker, 10 ms/step) against one process doing the
              same thing without Redis (scripts/baseline_server.py): TTFT and inter-token
              latency p50/p99 at concurrency 1 and 64, and what the fleet adds.
              Goals: <= 1 ms added TTFT p50 at concurrency 1, <= 5 ms added TTFT p99 at 64.
  throughput  tokens/s that ONE gateway process delivers to 256 concurrent WebSocket
              streams (2 workers x max_batch 128, 0 ms/step), with the gateway's CPU share
              (psutil). Goal >= 30,000 tokens/s.
  scaleout    2 gateways x 2 workers against 1 x 1 (20 ms/step, max_batch 8, so the
              workers are the limit), clients spread over the gateways. Goal >= 1.8x.
  arq         the same echo workload with arq as the task queue (scripts/arq_baseline.py)
              against the fleet's Redis Streams: TTFT at concurrency 1 and 64, with arq's
              default poll_delay (0.5 s) and a tight one (10 ms).

Nothing here is a test: the figures depend on the machine (and on whatever else runs on
it). The client runs in this process and shares the machine's cores with the servers.

    python -m scripts.bench_fleet [--only overhead,throughput,scaleout,arq] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import redis

from scripts import benchtable

SCRIPTS = Path(__file__).resolve().parent

from scripts.fleetstack import StackLife, clean_env, wait_fleet, wait_until  # noqa: E402
from scripts.procstats import cpu_s, stop  # noqa: E402
from streamfleet.bench import run_bench  # noqa: E402
from streamfleet.bench_config import BenchConfig  # noqa: E402
from streamfleet.bench_stats import BenchResult, summarize  # noqa: E402
from streamfleet.launcher import EmbeddedRedis, Fleet, find_redis_server, free_port, spawn  # noqa: E402
from streamfleet.shared import aio  # noqa: E402
from streamfleet.shared.modelrepo import ModelRepository, ensure_artifacts  # noqa: E402

BENCHES = ("overhead", "throughput", "scaleout", "arq")
MODEL = "echo-bench"
PROMPT_TOKENS = 16


@dataclass
class Plan:
    """Sizes of each benchmark (``--quick`` shrinks them)."""

    overhead_tokens: int = 16
    overhead_c1_requests: int = 40
    overhead_c64_requests: int = 320
    throughput_s: float = 15.0
    throughput_tokens: int = 64
    scaleout_s: float = 12.0
    arq_c1_requests: int = 16

    @classmethod
    def quick(cls) -> Plan:
        return cls(overhead_c1_requests=20, overhead_c64_requests=128, throughput_s=5.0, throughput_tokens=32,
                   scaleout_s=5.0, arq_c1_requests=6)


# -- processes ---------------------------------------------------------------------------

def write_model(root: Path) -> Path:
    """``root/echo-bench``: the echo backend on tiny-gpt's tokenizer, room for big batches."""
    tiny = ModelRepository().get("tiny-gpt")
    ensure_artifacts(tiny)
    folder = root / MODEL
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").symlink_to(tiny.tokenizer_path)
    (folder / "engine.toml").write_text(
        f'name = "{MODEL}"\nbackend = "echo"\ntokenizer = "tokenizer.json"\nmax_batch = 256\n'
        f'max_context = 4096\neos_token_ids = {list(tiny.eos_token_ids)}\n')
    return root


@dataclass
class Stack(StackLife):
    """A private Redis, N gateways and M echo workers."""

    engines: Path
    gateways: int = 1
    workers: int = 1
    delay_ms: float = 0.0
    max_batch: int = 64
    redis: EmbeddedRedis | None = None
    fleet: Fleet = field(default_factory=Fleet)
    ports: list[int] = field(default_factory=list)
    gateway_procs: list[subprocess.Popen] = field(default_factory=list)
    worker_procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return clean_env(SF_REDIS_URL=self.redis.url, SF_LOG_LEVEL="warning", SF_ENGINES_DIR=str(self.engines),
                         SF_MODEL=MODEL, SF_DEFAULT_MODEL=MODEL, SF_MODELS=MODEL, SF_BACKEND="echo",
                         SF_ECHO_DELAY_MS=str(self.delay_ms), SF_MAX_BATCH=str(self.max_batch),
                         SF_GRPC_PORT="0",  # WebSocket only; several gateways on one host would share 50051
                         OMP_NUM_THREADS="1")

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def _start(self) -> None:
        env = self.env
        for _ in range(self.workers):
            self.worker_procs.append(self.fleet.start("worker", ["worker"], env))
        for _ in range(self.gateways):
            port = free_port()
            self.ports.append(port)
            self.gateway_procs.append(self.fleet.start("gateway", ["gateway", "--port", str(port)], env))
        wait_fleet(self.redis.url, {MODEL: self.workers}, self.urls, self.fleet.dead, worker_timeout=90,
                   gateway_timeout=90)


@contextlib.contextmanager
def baseline_server(engines: Path, delay_ms: float, max_batch: int):
    tmp = Path(tempfile.mkdtemp(prefix="sf-baseline-"))
    port_file = tmp / "port"
    p = spawn([sys.executable, "-m", "scripts.baseline_server", "--port", "0", "--port-file", str(port_file),
               "--model", MODEL, "--engines-dir", str(engines), "--delay-ms", str(delay_ms),
               "--max-batch", str(max_batch)], env=dict(os.environ, TOKENIZERS_PARALLELISM="false"),
              stdout=subprocess.DEVNULL, cwd=SCRIPTS.parent)
    try:
        wait_until(port_file.exists, 60, "the baseline server",
                   lambda: ["baseline_server"] if p.poll() is not None else [])
        yield f"ws://127.0.0.1:{int(port_file.read_text())}/v1/stream", p.pid
    finally:
        stop(p)


@contextlib.contextmanager
def arq_worker(redis_url: str, engines: Path, delay_ms: float, max_batch: int, poll_delay: float):
    p = spawn([sys.executable, "-m", "scripts.arq_baseline", "worker", "--redis-url", redis_url,
               "--delay-ms", str(delay_ms), "--max-batch", str(max_batch), "--poll-delay", str(poll_delay),
               "--model", MODEL, "--engines-dir", str(engines)],
              env=dict(os.environ, TOKENIZERS_PARALLELISM="false"), stdout=subprocess.DEVNULL,
              stderr=subprocess.DEVNULL, cwd=SCRIPTS.parent)
    from scripts.arq_baseline import QUEUE

    r = redis.Redis.from_url(redis_url)
    try:
        # arq writes its health-check key once its startup (the batcher) is done
        wait_until(lambda: r.exists(QUEUE + ":health-check"), 60, "the arq worker",
                   lambda: ["arq worker"] if p.poll() is not None else [])
        yield
    finally:
        r.close()
        stop(p)


# -- measuring -----------------------------------------------------------------------------

def bench(url: str, *, concurrency: int, max_tokens: int, requests: int | None = None,
          duration: float | None = None, warmup: int = 0, preflight: bool = True, on_start=None) -> BenchResult:
    cfg = BenchConfig(url=url, transport="ws", concurrency=concurrency, requests=requests, duration=duration,
                      prompt_tokens=PROMPT_TOKENS, max_tokens=max_tokens, warmup=warmup, timeout=60.0)
    aio.settle_heap()  # the client's own full collections would land in its latency figures
    return aio.run(run_bench(cfg, preflight=preflight, on_start=on_start))


def lat(result: BenchResult, meter: CpuMeter | None = None) -> dict:
    d = result.to_dict()
    out = {"ttft_p50": d["ttft_ms"]["p50"], "ttft_p99": d["ttft_ms"]["p99"], "itl_p50": d["itl_ms"]["p50"],
           "itl_p99": d["itl_ms"]["p99"], "tokens_per_s": d["tokens_per_s"], "ok": d["requests"]["ok"],
           "errors": d["errors"]}
    if meter is not None and d["tokens_per_s"]:
        # CPU time each server process spent per token delivered
        out["cpu_us_per_token"] = {n: share / d["tokens_per_s"] * 1e6 for n, share in meter.share.items()}
    return out


def measured(url: str, pids: dict[str, int], **kw) -> dict:
    """``bench`` with the CPU time of ``pids`` sampled over exactly the measured run."""
    meter = CpuMeter(pids)
    res = bench(url, on_start=meter.start, **kw)
    meter.stop()
    return lat(res, meter)


class CpuMeter:
    """CPU seconds used by some processes between ``start()`` and ``stop()``."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.t0 = 0.0
        self.c0: dict[str, float] = {}
        self.share: dict[str, float] = {}

    def start(self) -> None:
        self.c0 = {n: cpu_s([p]) for n, p in self.procs.items()}
        self.t0 = time.perf_counter()

    def stop(self) -> None:
        wall = time.perf_counter() - self.t0
        self.share = {n: (cpu_s([p]) - self.c0[n]) / wall for n, p in self.procs.items()}


class MachineMeter:
    """Cores busy on the whole machine during a section, and how many of them were not
    this benchmark (this process and its reaped children): other work skews the figures."""

    def __enter__(self) -> MachineMeter:
        self.t0, self.busy0, self.own0 = time.perf_counter(), self._busy(), self._own()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self.t0
        self.busy = (self._busy() - self.busy0) / wall
        self.other = max(0.0, self.busy - (self._own() - self.own0) / wall)

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- the benchmarks ---------------------------------------------------------------------------

def run_overhead(plan: Plan, engines: Path) -> dict:
    delay, tokens = 10.0, plan.overhead_tokens
    out: dict = {"delay_ms": delay, "max_tokens": tokens, "baseline": {}, "fleet": {}}
    levels = ((1, plan.overhead_c1_requests), (64, plan.overhead_c64_requests))
    log("[overhead] baseline: one process, no Redis")
    with baseline_server(engines, delay, 64) as (url, pid):
        for c, n in levels:
            out["baseline"][c] = measured(url, {"baseline": pid}, concurrency=c, max_tokens=tokens, requests=n,
                                          warmup=min(c, 8) * 2, preflight=False)
    log("[overhead] fleet: 1 gateway + 1 worker")
    with Stack(engines, gateways=1, workers=1, delay_ms=delay, max_batch=64) as st:
        pids = {"gateway": st.gateway_procs[0].pid, "worker": st.worker_procs[0].pid, "redis": st.redis.proc.pid}
        for c, n in levels:
            out["fleet"][c] = measured(st.urls[0], pids, concurrency=c, max_tokens=tokens, requests=n,
                                       warmup=min(c, 8) * 2)
    return out


def run_throughput(plan: Plan, engines: Path) -> dict:
    log("[throughput] 1 gateway, 2 workers x max_batch 128, 256 WebSocket streams")
    with Stack(engines, gateways=1, workers=2, delay_ms=0.0, max_batch=128) as st:
        pids = {"gateway": st.gateway_procs[0].pid, "worker 1": st.worker_procs[0].pid,
                "worker 2": st.worker_procs[1].pid, "redis": st.redis.proc.pid, "client": os.getpid()}
        meter = CpuMeter(pids)
        res = bench(st.urls[0], concurrency=256, max_tokens=plan.throughput_tokens, duration=plan.throughput_s,
                    warmup=256, on_start=meter.start)
        meter.stop()
    d = res.to_dict()
    return {"tokens_per_s": d["tokens_per_s"], "streams": 256, "max_tokens": plan.throughput_tokens,
            "cpu_share": meter.share, "ok": d["requests"]["ok"], "errors": d["errors"],
            "itl_p50": d["itl_ms"]["p50"], "itl_p99": d["itl_ms"]["p99"], "wall_s": d["wall_s"]}


def _spread(urls: list[str], concurrency: int, duration: float, tokens: int) -> dict:
    """Closed-loop clients spread evenly over the gateways, all at once."""
    async def go():
        cfgs = [BenchConfig(url=u, concurrency=concurrency // len(urls), duration=duration, max_tokens=tokens,
                            prompt_tokens=PROMPT_TOKENS, warmup=concurrency // len(urls), timeout=60.0, seed=i)
                for i, u in enumerate(urls)]
        return await asyncio.gather(*(run_bench(c) for c in cfgs))

    aio.settle_heap()
    results = aio.run(go())
    tokens_total = sum(r.tokens for r in results)
    wall = max(r.wall_s for r in results)
    ttft = [x for r in results for x in r.ttft_ms()]
    errors: dict[str, int] = {}
    for r in results:
        for k, v in r.errors.items():
            errors[k] = errors.get(k, 0) + v
    return {"tokens_per_s": tokens_total / wall, "ttft_p50": summarize(ttft)["p50"], "errors": errors,
            "ok": sum(len(r.ok) for r in results)}


def run_scaleout(plan: Plan, engines: Path) -> dict:
    delay, batch, conc, tokens = 20.0, 8, 32, 32
    out: dict = {"delay_ms": delay, "max_batch": batch, "concurrency": conc, "max_tokens": tokens}
    for g, w in ((1, 1), (2, 2)):
        log(f"[scaleout] {g} gateway(s) x {w} worker(s)")
        with Stack(engines, gateways=g, workers=w, delay_ms=delay, max_batch=batch) as st:
            out[f"{g}x{w}"] = _spread(st.urls, conc, plan.scaleout_s, tokens)
    out["ratio"] = out["2x2"]["tokens_per_s"] / out["1x1"]["tokens_per_s"]
    return out


def run_arq(plan: Plan, engines: Path, fleet_results: dict | None) -> dict:
    delay, tokens = 10.0, plan.overhead_tokens
    levels = ((1, plan.arq_c1_requests), (64, 128))
    out: dict = {"delay_ms": delay, "max_tokens": tokens, "fleet": {}, "arq 0.5 s": {}, "arq 10 ms": {}}
    from scripts.arq_baseline import run_arq_bench

    if fleet_results:
        out["fleet"] = fleet_results
    else:
        log("[arq] fleet: 1 gateway + 1 worker")
        with Stack(engines, gateways=1, workers=1, delay_ms=delay, max_batch=64) as st:
            for c, n in levels:
                out["fleet"][c] = lat(bench(st.urls[0], concurrency=c, max_tokens=tokens, requests=n,
                                            warmup=min(c, 8) * 2))
    prompt = " ".join(["hello"] * PROMPT_TOKENS)
    for name, poll in (("arq 0.5 s", 0.5), ("arq 10 ms", 0.01)):
        log(f"[arq] arq worker, poll_delay {poll:g} s")
        rds = EmbeddedRedis().start()
        try:
            with arq_worker(rds.url, engines, delay, 64, poll):
                for c, n in levels:
                    res = aio.run(run_arq_bench(rds.url, concurrency=c, requests=n, max_tokens=tokens,
                                                    prompt=prompt, warmup=min(c, 4)))
                    out[name][c] = lat(res)
        finally:
            rds.stop()
    return out


# -- report --------------------------------------------------------------------------------

def f(v, unit: str = "", digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}{unit}"


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    def fmt(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return [fmt(headers), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)]


def errors_note(*blocks: dict) -> str:
    errs: dict[str, int] = {}
    for b in blocks:
        for k, v in (b.get("errors") or {}).items():
            errs[k] = errs.get(k, 0) + v
    return "errors: none" if not errs else "errors: " + ", ".join(f"{k} {v}" for k, v in sorted(errs.items()))


def machine_note(block: dict) -> str:
    m = block.get("machine")
    if not m:
        return ""
    return (f"machine during this section: {m['busy_cores']:.2f} of {os.cpu_count()} cores busy, "
            f"{m['other_cores']:.2f} of them by other work")


def report(results: dict, env: dict) -> str:
    out = [f"streamfleet fleet benchmarks: {env['cores']} cores, {env['cpu']}, Python {env['python']}, "
           f"redis-server {env['redis']}, load average before {env['load']}",
           f"echo engine (no model cost), {PROMPT_TOKENS}-token prompts, WebSocket clients in the benchmark process"
           + (" (quick run)" if env["quick"] else "")]
    if "overhead" in results:
        o = results["overhead"]
        out += ["", f"[a] broker overhead: fleet (1 gateway + 1 worker) vs one-process baseline, "
                    f"{o['delay_ms']:g} ms/step, {o['max_tokens']} tokens/request (ms)"]
        rows = []
        for c in (1, 64):
            b, fl = o["baseline"][c], o["fleet"][c]
            for key, name in (("ttft_p50", "TTFT p50"), ("ttft_p99", "TTFT p99"), ("itl_p50", "ITL p50"),
                              ("itl_p99", "ITL p99")):
                added = fl[key] - b[key] if fl[key] is not None and b[key] is not None else None
                goal = ""
                if c == 1 and key == "ttft_p50":
                    goal = f"<= 1 ms: {verdict(added is not None and added <= 1.0)}"
                elif c == 64 and key == "ttft_p99":
                    goal = f"<= 5 ms: {verdict(added is not None and added <= 5.0)}"
                rows.append([str(c), name, f(b[key], digits=2), f(fl[key], digits=2),
                             ("+" if added is not None and added >= 0 else "") + f(added, digits=2), goal])
        out += table(["concurrency", "metric", "baseline", "fleet", "added by fleet", "goal"], rows)
        for c in (1, 64):
            b, fl = o["baseline"][c].get("cpu_us_per_token"), o["fleet"][c].get("cpu_us_per_token")
            if b and fl:
                out.append(f"CPU per token at concurrency {c}: baseline {b['baseline']:.0f} us; fleet "
                           + ", ".join(f"{k} {v:.0f} us" for k, v in fl.items())
                           + f" (sum {sum(fl.values()):.0f} us)")
        out.append(errors_note(*(v for k, v in o["baseline"].items() if k != "machine"),
                               *(v for k, v in o["fleet"].items() if k != "machine")))
        out.append(machine_note(o))
    if "throughput" in results:
        t = results["throughput"]
        share = t["cpu_share"]
        gw = share.get("gateway") or 0.0
        out += ["", f"[b] gateway throughput: 1 gateway process, {t['streams']} WebSocket streams, 2 echo workers "
                    f"(0 ms/step, max_batch 128), {t['max_tokens']} tokens/request"]
        out += table(["figure", "value"], [
            ["tokens/s delivered", f(t["tokens_per_s"], digits=0)],
            ["goal >= 30,000 tokens/s", verdict(t["tokens_per_s"] >= 30_000)],
            ["gateway CPU (cores)", f(gw, digits=2)],
            ["tokens/s per gateway core", f(t["tokens_per_s"] / gw if gw else None, digits=0)],
            ["CPU of the others (cores)", ", ".join(f"{k} {v:.2f}" for k, v in share.items() if k != "gateway")],
            ["ITL p50 / p99 (ms)", f"{f(t['itl_p50'])} / {f(t['itl_p99'])}"],
        ])
        out.append(errors_note(t))
        out.append(machine_note(t))
    if "scaleout" in results:
        s = results["scaleout"]
        out += ["", f"[c] scale-out: {s['concurrency']} closed-loop clients spread over the gateways, "
                    f"{s['delay_ms']:g} ms/step, max_batch {s['max_batch']}, {s['max_tokens']} tokens/request"]
        out += table(["setup", "tokens/s", "TTFT p50 (ms)", "ratio"], [
            ["1 gateway x 1 worker", f(s["1x1"]["tokens_per_s"]), f(s["1x1"]["ttft_p50"]), "1.00x"],
            ["2 gateways x 2 workers", f(s["2x2"]["tokens_per_s"]), f(s["2x2"]["ttft_p50"]), f"{s['ratio']:.2f}x"],
        ])
        out.append(f"goal >= 1.8x: {verdict(s['ratio'] >= 1.8)}; " + errors_note(s["1x1"], s["2x2"]))
        out.append(machine_note(s))
    if "arq" in results:
        a = results["arq"]
        out += ["", f"[d] queue choice: Redis Streams (the fleet, via its gateway) vs arq (client straight to Redis), "
                    f"{a['delay_ms']:g} ms/step, {a['max_tokens']} tokens/request (ms)"]
        rows = []
        for c in (1, 64):
            fl = a["fleet"][c]
            for name in ("arq 0.5 s", "arq 10 ms"):
                q = a[name][c]
                rows.append([str(c), f"{name} poll", f(fl["ttft_p50"]), f(q["ttft_p50"]),
                             f"{q['ttft_p50'] / fl['ttft_p50']:.1f}x" if fl["ttft_p50"] else "-",
                             f(fl["ttft_p99"]), f(q["ttft_p99"])])
        out += table(["concurrency", "arq setting", "Streams TTFT p50", "arq TTFT p50", "arq/Streams",
                      "Streams p99", "arq p99"], rows)
        out.append(errors_note(*a["arq 0.5 s"].values(), *a["arq 10 ms"].values()))
        out.append(machine_note(a))
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(BENCHES), help=f"comma-separated subset of {','.join(BENCHES)}")
    ap.add_argument("--quick", action="store_true", help="shorter runs (about a minute in all)")
    ap.add_argument("--json", default=None, help="also write every figure to this JSON file")
    benchtable.add_argument(ap)
    args = ap.parse_args()
    chosen = [b.strip() for b in args.only.split(",") if b.strip()]
    unknown = sorted(set(chosen) - set(BENCHES))
    if unknown:
        ap.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHES)}")
    if "arq" in chosen:
        try:
            import arq  # noqa: F401
        except ImportError:
            ap.error("the arq benchmark needs arq: pip install -e '.[dev]'")
    plan = Plan.quick() if args.quick else Plan()
    env = {"cores": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
           "python": platform.python_version(), "quick": args.quick,
           "load": " ".join(f"{x:.2f}" for x in os.getloadavg())}
    version = subprocess.run([find_redis_server(), "--version"], capture_output=True, text=True).stdout
    env["redis"] = version.split()[2][2:]
    results: dict = {}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sf-bench-") as tmp:
        engines = write_model(Path(tmp))
        runs = {"overhead": lambda: run_overhead(plan, engines), "throughput": lambda: run_throughput(plan, engines),
                "scaleout": lambda: run_scaleout(plan, engines),
                "arq": lambda: run_arq(plan, engines, results.get("overhead", {}).get("fleet"))}
        for name in BENCHES:
            if name in chosen:
                with MachineMeter() as mm:
                    results[name] = runs[name]()
                results[name]["machine"] = {"busy_cores": mm.busy, "other_cores": mm.other}
    env["elapsed_s"] = round(time.monotonic() - t0, 1)
    text = report(results, env)
    print(text)
    print(f"\n(ran {', '.join(chosen)} in {env['elapsed_s']:.0f} s)")
    if args.json:
        import orjson

        Path(args.json).write_bytes(orjson.dumps({"env": env, "results": results}, option=orjson.OPT_INDENT_2
                                                 | orjson.OPT_NON_STR_KEYS))
    return 0


if __name__ == "__main__":
    sys.exit(benchtable.main(main))
