#!/usr/bin/env python
"""A soak: the fleet at a steady fraction of its measured capacity for a long time, with
a real client mix, to show that nothing grows (memory, Redis keys) and nothing slows
down (TTFT p99) as hours of traffic go through.

One gateway, one echo worker (``--delay-ms`` per step, the benchmarks' engine) and a
private Redis with ``SF_LOG_TTL_S`` = ``--log-ttl-s`` (120 s: the value docs/operations.md
recommends at high request rates, so the request logs reach their steady count within
the run instead of after ten minutes) and ``SF_SSE_RESUME_GRACE_S`` = 30 (an SSE client
that drops may come back, as a WebSocket client may by default). First a capacity probe: closed loops over both
doors at ``--probe-concurrency`` for ``--probe-s`` seconds, whose tokens/s is the
capacity. Then ``--minutes`` of open-loop load (Poisson arrivals) at ``--load`` × that
capacity, each arrival one of:

  ws_short / ws_long     a ``generate`` on one of ``--ws-connections`` long-lived,
                         multiplexed WebSocket connections (16 / 128 tokens)
  sse_short / sse_long   an OpenAI SSE stream (16 / 128 tokens)
  ws_cancel              a long request cancelled (``cancel`` frame) after 4 tokens
  sse_cancel             a long SSE stream whose client hangs up after 4 tokens
  ws_resume              a long request on its own connection, dropped after 8 tokens,
                         resumed on a new connection (``resume`` from the next index)
  sse_resume             a long SSE stream dropped after 8 tokens, resumed with
                         ``Last-Event-ID``

Every stream is checked: indices 0, 1, 2 … each once, and a finished request has as many
tokens as it asked for (a resumed one counted across both connections). Each interval
(``--interval-s``, 60) it records the memory of the gateway, the worker and Redis, Redis's
``used_memory`` and key count, and the TTFT p99, tokens/s and errors of the requests
that ended in it; at the end it prints the table, the growth over the second half of the
run, and draws ``soak.png`` (matplotlib, when installed) next to ``soak.json``.

    python -m scripts.soak --minutes 30 --load 0.8 --out /tmp/soak
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import random
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import redis.asyncio as aioredis
import websockets

from scripts.bench_fleet import MODEL, write_model
from scripts.bench_peers import Workload, streamfleet
from scripts.procstats import rss_mib
from streamfleet.bench import run_bench
from streamfleet.bench_clients import _SseClient
from streamfleet.bench_config import BenchConfig
from streamfleet.bench_stats import RequestRecord, percentile

SHORT, LONG = 16, 128
#: the client mix: kind -> (share of arrivals, tokens asked for)
MIX = {"ws_short": (0.40, SHORT), "ws_long": (0.10, LONG), "sse_short": (0.25, SHORT), "sse_long": (0.08, LONG),
       "ws_cancel": (0.05, LONG), "sse_cancel": (0.04, LONG), "ws_resume": (0.05, LONG), "sse_resume": (0.03, LONG)}
CANCEL_AFTER, DROP_AFTER = 4, 8


@dataclass(slots=True)
class Outcome:
    kind: str
    start: float
    end: float = 0.0
    first: float | None = None
    tokens: int = 0
    error: str | None = None

    @property
    def ttft_ms(self) -> float | None:
        return (self.first - self.start) * 1000 if self.first is not None else None


@dataclass
class Interval:
    t_min: float
    rss_mib: dict[str, float]
    redis_used_mib: float
    redis_keys: int
    requests: int
    tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    errors: dict[str, int] = field(default_factory=dict)


class StreamCheck:
    """Indices in order, each once."""

    def __init__(self, out: Outcome, start_index: int = 0) -> None:
        self.out = out
        self.next = start_index

    def token(self, index: int, now: float) -> None:
        if index != self.next:
            self.out.error = self.out.error or f"index_{'gap' if index > self.next else 'repeat'}"
        self.next = max(self.next, index + 1)
        self.out.tokens += 1
        if self.out.first is None:
            self.out.first = now


class WsConn:
    """One WebSocket connection; frames go to the handler registered for their id."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.ws = None
        self.handlers: dict[str, asyncio.Queue] = {}
        self.reader: asyncio.Task | None = None

    async def open(self) -> WsConn:
        self.ws = await websockets.connect(self.url, max_size=2**22, compression=None, ping_interval=None)
        self.reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                frame = orjson.loads(raw)
                q = self.handlers.get(frame.get("id"))
                if q is not None:
                    q.put_nowait(frame)
        except websockets.ConnectionClosed:
            pass
        finally:
            for q in self.handlers.values():
                q.put_nowait({"type": "closed"})

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self.reader is not None:
            await asyncio.gather(self.reader, return_exceptions=True)

    async def run(self, out: Outcome, cid: str, frame: dict, want: int, *, cancel_after: int = 0,
                  drop_after: int = 0, check: StreamCheck | None = None) -> dict | None:
        """One request (``generate`` or ``resume``) on this connection, which must end
        with ``want`` tokens in all: returns its ``accepted`` frame; fills ``out``.
        ``drop_after``: drop the connection (no close frame) after that many tokens; the
        caller resumes."""
        q: asyncio.Queue = asyncio.Queue()
        self.handlers[cid] = q
        check = check or StreamCheck(out)
        accepted = None
        try:
            await self.ws.send(orjson.dumps(dict(frame, id=cid)).decode())
            while True:
                f = await q.get()
                kind = f["type"]
                if kind == "token":
                    check.token(f["index"], time.perf_counter())
                    if cancel_after and out.tokens == cancel_after:
                        await self.ws.send(orjson.dumps({"type": "cancel", "id": cid}).decode())
                    if drop_after and out.tokens == drop_after:  # a dropped connection: no close frame
                        self.ws.transport.abort()
                        return accepted
                elif kind == "accepted":
                    accepted = f
                elif kind == "done":
                    reason = "cancelled" if cancel_after else "length"
                    if f["finish_reason"] != reason:
                        out.error = out.error or f"finish_{f['finish_reason']}"
                    elif not cancel_after and check.next != want:
                        out.error = out.error or "short"
                    return accepted
                elif kind == "error":
                    out.error = out.error or f["code"]
                    return accepted
                elif kind == "closed":
                    out.error = out.error or "connection_closed"
                    return accepted
        finally:
            self.handlers.pop(cid, None)


class Client:
    """The soak's client mix over one fleet."""

    def __init__(self, url: str, ws_connections: int, seed: int) -> None:
        self.url = url
        self.ws_url = url.replace("http", "ws", 1) + "/v1/stream"
        self.rng = random.Random(seed)
        self.ids = itertools.count()
        self.pool: list[WsConn] = []
        self.ws_connections = ws_connections
        self.sse = _SseClient(url, BenchConfig(url=url, transport="sse", model=MODEL, timeout=120))
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=120.0))
        self.outcomes: list[Outcome] = []

    async def open(self) -> None:
        self.pool = [await WsConn(self.ws_url).open() for _ in range(self.ws_connections)]
        await self.sse.open()

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.pool), return_exceptions=True)
        await self.sse.close()
        await self.http.aclose()

    def frame(self, n: int) -> dict:
        return {"type": "generate", "prompt": f"soak {n}", "max_tokens": n, "ignore_eos": True, "model": MODEL,
                "temperature": 0}

    def body(self, n: int) -> dict:
        return {"model": MODEL, "prompt": "soak", "max_tokens": n, "ignore_eos": True, "stream": True,
                "temperature": 0, "stream_options": {"include_usage": True}}

    async def one(self, kind: str) -> None:
        tokens = MIX[kind][1]
        out = Outcome(kind, time.perf_counter())
        self.outcomes.append(out)
        run = {"ws_short": self._ws_plain, "ws_long": self._ws_plain, "sse_short": self._sse_plain,
               "sse_long": self._sse_plain, "ws_cancel": self._ws_cancel, "sse_cancel": self._sse_cancel,
               "ws_resume": self._ws_resume, "sse_resume": self._sse_resume}[kind]
        try:
            async with asyncio.timeout(120):
                await run(out, tokens)
        except TimeoutError:
            out.error = out.error or "timeout"
        except (OSError, httpx.HTTPError, websockets.WebSocketException) as exc:
            out.error = out.error or type(exc).__name__
        out.end = time.perf_counter()

    async def _ws_plain(self, out: Outcome, n: int) -> None:
        conn = self.pool[next(self.ids) % len(self.pool)]
        await conn.run(out, f"q{next(self.ids)}", self.frame(n), n)

    async def _ws_cancel(self, out: Outcome, n: int) -> None:
        conn = self.pool[next(self.ids) % len(self.pool)]
        await conn.run(out, f"q{next(self.ids)}", self.frame(n), n, cancel_after=CANCEL_AFTER)

    async def _ws_resume(self, out: Outcome, n: int) -> None:
        check = StreamCheck(out)
        first = await WsConn(self.ws_url).open()
        try:
            accepted = await first.run(out, "a", self.frame(n), n, drop_after=DROP_AFTER, check=check)
        finally:
            await first.close()
        if out.error or accepted is None:
            return
        again = await WsConn(self.ws_url).open()
        try:
            resume = {"type": "resume", "request_id": accepted["request_id"], "from_index": check.next}
            if accepted.get("resume_token"):
                resume["resume_token"] = accepted["resume_token"]
            await again.run(out, "b", resume, n, check=check)
        finally:
            await again.close()

    async def _sse_plain(self, out: Outcome, n: int) -> None:
        rec = RequestRecord(lane="normal", start=out.start)
        await self.sse.request(rec, self.body(n))
        out.first = rec.first
        out.tokens = rec.tokens
        out.error = rec.error or (None if rec.tokens == n else "short")

    async def _sse_lines(self, out: Outcome, n: int, *, stop_after: int, headers: dict | None = None,
                         check: StreamCheck | None = None) -> str | None:
        """One SSE stream read line by line; stops (hangs up) after ``stop_after`` tokens.
        Returns the last ``id:`` seen."""
        last_id = None
        check = check or StreamCheck(out)
        async with self.http.stream("POST", self.url + "/v1/completions", json=self.body(n),
                                    headers=headers or {}) as r:
            if r.status_code != 200:
                out.error = f"http_{r.status_code}"
                return None
            async for line in r.aiter_lines():
                if line.startswith("id: "):
                    last_id = line[4:]
                elif line.startswith("data: ") and line != "data: [DONE]":
                    chunk = orjson.loads(line[6:])
                    if "error" in chunk:
                        out.error = out.error or chunk["error"].get("code", "error")
                        return last_id
                    for choice in chunk.get("choices") or ():
                        if choice.get("text") and last_id:
                            check.token(int(last_id.rsplit(":", 1)[1]), time.perf_counter())
                    if stop_after and out.tokens >= stop_after:
                        return last_id
        if not stop_after and check.next != n:
            out.error = out.error or "short"
        return last_id

    async def _sse_cancel(self, out: Outcome, n: int) -> None:
        await self._sse_lines(out, n, stop_after=CANCEL_AFTER)

    async def _sse_resume(self, out: Outcome, n: int) -> None:
        check = StreamCheck(out)
        last = await self._sse_lines(out, n, stop_after=DROP_AFTER, check=check)
        if out.error or last is None:
            return
        await self._sse_lines(out, n, stop_after=0, headers={"Last-Event-ID": last}, check=check)


async def probe(url: str, concurrency: int, seconds: float) -> float:
    """Tokens/s of closed loops over both doors at once (half the concurrency each)."""
    half = max(1, concurrency // 2)
    cfgs = [BenchConfig(url=url, transport=t, concurrency=half, model=MODEL, max_tokens=SHORT, duration=seconds,
                        warmup=half, timeout=120) for t in ("ws", "sse")]
    results = await asyncio.gather(*(run_bench(c, preflight=False, warn=None) for c in cfgs))
    return sum(r.tokens / max(r.wall_s, 1e-9) for r in results)


async def soak(args, url: str, procs, redis_url: str) -> tuple[float, list[Interval]]:
    capacity = await probe(url, args.probe_concurrency, args.probe_s)
    # tokens a request of each kind actually streams: a cancelled one stops after CANCEL_AFTER
    mean_tokens = sum(share * (CANCEL_AFTER if kind.endswith("_cancel") else n) for kind, (share, n) in MIX.items())
    rate = args.load * capacity / mean_tokens
    print(f"capacity {capacity:,.0f} tokens/s; soak at {args.load:.0%}: {rate:.1f} requests/s "
          f"({rate * mean_tokens:,.0f} tokens/s) for {args.minutes:g} min", flush=True)
    client = Client(url, args.ws_connections, args.seed)
    await client.open()
    r = aioredis.Redis.from_url(redis_url)
    kinds, weights = list(MIX), [share for share, _ in MIX.values()]
    rng = random.Random(args.seed)
    tasks: set[asyncio.Task] = set()
    intervals: list[Interval] = []
    t0 = time.perf_counter()
    end = t0 + args.minutes * 60

    async def sample() -> None:
        next_at = t0 + args.interval_s
        while True:
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            now = time.perf_counter()
            # what ended since the last sample; what still runs waits for the next
            batch, client.outcomes = client.outcomes, []
            done = [o for o in batch if o.end]
            client.outcomes.extend(o for o in batch if not o.end)
            ttfts = [t for o in done if o.error is None and (t := o.ttft_ms) is not None]
            info = await r.info("memory")
            parts = procs(by_name=True)
            iv = Interval(t_min=(now - t0) / 60, rss_mib={name: rss_mib(ps) for name, ps in parts.items()},
                          redis_used_mib=info["used_memory"] / 2**20, redis_keys=await r.dbsize(),
                          requests=len(done), tokens_per_s=sum(o.tokens for o in done) / args.interval_s,
                          ttft_p50_ms=percentile(ttfts, 50), ttft_p99_ms=percentile(ttfts, 99),
                          errors=dict(Counter(o.error for o in done if o.error)))
            intervals.append(iv)
            print(row(iv), flush=True)
            next_at += args.interval_s

    print(header(), flush=True)
    sampler = asyncio.create_task(sample())
    arrival = t0
    try:
        while True:
            arrival += rng.expovariate(rate)
            if arrival >= end:
                break
            await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
            t = asyncio.create_task(client.one(rng.choices(kinds, weights)[0]))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
        await asyncio.sleep(max(0.0, t0 + args.minutes * 60 + 1 - time.perf_counter()))
    finally:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
        await client.close()
        await r.aclose()
    return capacity, intervals


def header() -> str:
    return (f"{'min':>5}{'gateway':>9}{'worker':>8}{'redis':>7}{'redis used':>11}{'keys':>8}{'req':>7}"
            f"{'tok/s':>8}{'TTFT p50':>10}{'p99':>8}  errors")


def row(iv: Interval) -> str:
    f = lambda v: f"{v:.1f}" if v is not None else "-"  # noqa: E731
    return (f"{iv.t_min:>5.1f}{iv.rss_mib['gateway']:>9.1f}{iv.rss_mib['worker']:>8.1f}{iv.rss_mib['redis']:>7.1f}"
            f"{iv.redis_used_mib:>11.1f}{iv.redis_keys:>8}{iv.requests:>7}{iv.tokens_per_s:>8.0f}"
            f"{f(iv.ttft_p50_ms):>10}{f(iv.ttft_p99_ms):>8}  {iv.errors or ''}")


def growth(intervals: list[Interval]) -> dict[str, float]:
    """Least-squares slope per minute over the second half of the run (after warm-up and
    after the logs reach their steady count), for each series."""
    half = intervals[len(intervals) // 2:]
    if len(half) < 2:
        return {}
    series = {f"{name} RSS MiB": [iv.rss_mib[name] for iv in half] for name in half[0].rss_mib}
    series.update({"redis used MiB": [iv.redis_used_mib for iv in half],
                   "redis keys": [float(iv.redis_keys) for iv in half],
                   "TTFT p99 ms": [iv.ttft_p99_ms or 0.0 for iv in half]})
    xs = [iv.t_min for iv in half]
    mx = sum(xs) / len(xs)
    out = {}
    for name, ys in series.items():
        my = sum(ys) / len(ys)
        out[name] = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return out


def chart(intervals: list[Interval], path: Path, title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed, so no chart was drawn (pip install matplotlib)"
    xs = [iv.t_min for iv in intervals]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name in intervals[0].rss_mib:
        axes[0].plot(xs, [iv.rss_mib[name] for iv in intervals], label=f"{name} RSS")
    axes[0].plot(xs, [iv.redis_used_mib for iv in intervals], label="redis used_memory", linestyle="--")
    axes[0].set(title="memory (MiB)", xlabel="minute", ylim=(0, None))
    axes[0].legend(fontsize=8)
    axes[1].plot(xs, [iv.redis_keys for iv in intervals])
    axes[1].set(title="Redis keys", xlabel="minute", ylim=(0, None))
    axes[2].plot(xs, [iv.ttft_p99_ms for iv in intervals], label="p99")
    axes[2].plot(xs, [iv.ttft_p50_ms for iv in intervals], label="p50")
    axes[2].set(title="TTFT (ms)", xlabel="minute", ylim=(0, None))
    axes[2].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--load", type=float, default=0.8, help="fraction of the probed capacity")
    ap.add_argument("--interval-s", type=float, default=60.0)
    ap.add_argument("--probe-s", type=float, default=20.0)
    ap.add_argument("--probe-concurrency", type=int, default=256)
    ap.add_argument("--ws-connections", type=int, default=32)
    ap.add_argument("--delay-ms", type=float, default=10.0)
    ap.add_argument("--log-ttl-s", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=None, help="folder for soak.json and soak.png")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="sf-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    w = Workload(write_model(Path(tempfile.mkdtemp(prefix="sf-soak-engines-"))), delay_ms=args.delay_ms)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; echo engine {args.delay_ms:g} ms/step; "
          f"SF_LOG_TTL_S={args.log_ttl_s:g}", flush=True)
    # SSE clients that drop may resume within 30 s (as WebSocket clients may by default)
    with streamfleet(w, {"SF_LOG_TTL_S": str(args.log_ttl_s), "SF_SSE_RESUME_GRACE_S": "30"}) as (url, procs):
        capacity, intervals = asyncio.run(soak(args, url, procs, procs.redis_url))
    slopes = growth(intervals)
    if slopes:
        print("\nper minute over the second half: " + ", ".join(f"{k} {v:+.3f}" for k, v in slopes.items()))
    totals = Counter()
    for iv in intervals:
        totals.update(iv.errors)
    print(f"requests {sum(iv.requests for iv in intervals):,}, errors {dict(totals) or 0}")
    (out / "soak.json").write_bytes(orjson.dumps({"capacity_tokens_per_s": capacity, "load": args.load,
                                                 "intervals": intervals, "growth_per_min": slopes},
                                                option=orjson.OPT_SERIALIZE_DATACLASS | orjson.OPT_INDENT_2))
    title = (f"streamfleet soak: {args.minutes:g} min at {args.load:.0%} of {capacity:,.0f} tokens/s "
             f"(1 gateway, 1 echo worker, {os.cpu_count()} cores)")
    problem = chart(intervals, out / "soak.png", title)
    print(problem or f"chart: {out / 'soak.png'}")
    print(f"data: {out / 'soak.json'}")
    return 1 if totals else 0


if __name__ == "__main__":
    raise SystemExit(main())
