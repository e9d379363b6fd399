#!/usr/bin/env python
"""Voice at scale on one gateway: VAD at the gateway against VAD off, side by side.

Many voice WebSockets stay open while few of their users speak. With VAD at the
gateway only utterances reach a worker; with VAD off (``SF_VAD=off``) every
connection's audio is one long utterance from its first frame: the one-slot-per-
connection design, where silent connections hold speech slots.

For each mode, in one run, on a private redis-server: one gateway (``SF_VAD`` = the
detector, then ``off``), ``--workers`` speech workers on ``asr-en`` (PocketSphinx), then

  * ``--connections`` voice WebSockets (default 800), each sending ``start`` and then
    audio in real time in ``--frame-ms`` frames: ``--speaking`` of them (default 80)
    speak flite sentences with ``--gap-s`` of silence (low room noise, -59 dBFS) between,
    the others send only that room noise;
  * after ``--seconds`` of audio every connection sends ``stop`` and waits up to
    ``--drain-s`` for its finals.

Printed per mode: utterances open at once (the slots the design needs) and worker slots
busy (sampled each second from the workers' heartbeats), tasks waiting in the lanes, the
finals received, final latency after the end of speech p50/p99 (arrival of the final
minus the time the sentence's last sample was sent), the workers' real-time factor (CPU
seconds per second of utterance audio), and the gateway's CPU and memory per connection.

    python -m scripts.bench_voice [--connections 800] [--speaking 80] [--vad silero]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx
import orjson
import psutil
import redis
import websockets

from scripts.procstats import cpu_s, family
from streamfleet.devkit.speech import SENTENCES, flite_missing, noise, speech
from streamfleet.launcher import EmbeddedRedis, Fleet, free_port, wait_ready
from streamfleet.shared.keys import Keys
from streamfleet.shared.schema import Heartbeat

BYTES_PER_MS = 32
MODEL = "asr-en"
#: room tone under everything: white noise at -59 dBFS, about 44 dB under flite's speech
ROOM_NOISE = 60


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))] if s else float("nan")


@dataclass
class Conn:
    """One client: its audio plan, and what came back."""

    audio: bytes
    speech_spans: list[tuple[int, int]]  # (start, end) stream offsets in ms of each sentence
    t0: float = 0.0                      # wall time of stream offset 0
    lag_ms: float = 0.0                  # how far behind real time its sending fell, at most
    finals: list[tuple[float, dict]] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)


def plan(n: int, speaking: int, seconds: float, gap_s: float, rng: random.Random,
         sentences: list[bytes]) -> list[Conn]:
    total = int(seconds * 1000) * BYTES_PER_MS
    room = noise(int(seconds * 1000) + 2000, amplitude=ROOM_NOISE, seed=1)
    conns = []
    for k in range(n):
        at = rng.randrange(0, 2000) * BYTES_PER_MS  # each connection's own slice of the room tone
        base = bytearray(room[at:at + total])
        spans = []
        if k < speaking:
            pos = int(rng.uniform(0.2, gap_s) * 1000)  # speakers start at different times
            while True:
                pcm = sentences[rng.randrange(len(sentences))]
                ms = len(pcm) // BYTES_PER_MS
                if pos + ms > seconds * 1000 - 200:
                    break
                b = pos * BYTES_PER_MS
                base[b:b + len(pcm)] = pcm  # speech in place of the room tone (flite is 43 dB louder)
                spans.append((pos, pos + ms))
                pos += ms + int(rng.uniform(0.5, 1.5) * gap_s * 1000)
        conns.append(Conn(bytes(base), spans))
    return conns


async def run_conn(url: str, c: Conn, frame_ms: int, started: asyncio.Event, drain_s: float,
                   ready: list[int]) -> None:
    step = frame_ms * BYTES_PER_MS
    async with websockets.connect(url, max_size=None, compression=None, open_timeout=60,
                                  ping_interval=None) as ws:
        await ws.send(orjson.dumps({"type": "start", "model": MODEL, "sample_rate": 16000,
                                    "encoding": "pcm_s16le"}).decode())

        async def reader() -> None:
            try:
                await read()
            except websockets.ConnectionClosed as exc:  # by the gateway (rcvd) or by this client (sent)
                close = exc.rcvd or exc.sent
                c.errors.append({"code": f"closed {close.code} {close.reason}" if close else "closed"})

        async def read() -> None:
            async for raw in ws:
                f = orjson.loads(raw)
                t = f.get("type")
                if t == "started":
                    ready[0] += 1
                elif t == "final":
                    c.finals.append((time.monotonic(), f))
                elif t == "error":
                    c.errors.append(f)
                elif t == "stopped":
                    return

        rd = asyncio.create_task(reader())
        await started.wait()
        c.t0 = time.monotonic()
        for n, i in enumerate(range(0, len(c.audio), step)):
            due = c.t0 + n * frame_ms / 1000
            now = time.monotonic()
            if due > now:
                await asyncio.sleep(due - now)
            else:
                c.lag_ms = max(c.lag_ms, (now - due) * 1000)
            if rd.done():  # the connection closed
                return
            await ws.send(c.audio[i:i + step])
        await ws.send('{"type":"stop"}')
        try:
            await asyncio.wait_for(rd, drain_s)
        except TimeoutError:
            pass


def latencies(conns: list[Conn]) -> list[float]:
    """Final latency after the end of speech (of the speakers' finals), in ms."""
    after_speech = []
    for c in conns:
        for arrived, f in c.finals:
            end = f["end_ms"]
            said = [e for s, e in c.speech_spans if s < end and e > f["start_ms"]]
            if said and f.get("text"):
                after_speech.append((arrived - (c.t0 + max(said) / 1000)) * 1000)
    return after_speech


def scrape(metrics_url: str, series: str) -> float:
    """One series' value from a Prometheus endpoint (0 when absent)."""
    for line in httpx.get(metrics_url, timeout=5).text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def open_utterances(metrics_url: str) -> int:
    """Utterances the gateway has open (queued or transcribing): the slots they need."""
    return int(scrape(metrics_url, 'streamfleet_active_streams{transport="voice"}'))


def audio_decoded(metrics_url: str) -> float:
    return scrape(metrics_url, f'streamfleet_worker_audio_seconds_total{{model="{MODEL}"}}')


async def sample_slots(rds: redis.Redis, keys: Keys, metrics_url: str, out: list[tuple[int, int, int, int]],
                       done: asyncio.Event) -> None:
    """Each second: worker slots busy, worker slots in all, tasks no worker has read yet,
    utterances open at the gateway."""
    lanes = list(keys.lanes(MODEL).values())
    while not done.is_set():
        hbs = [Heartbeat.decode(v) for v in (await asyncio.to_thread(rds.hvals, keys.workers(MODEL)))]
        waiting = 0
        for lane in lanes:
            try:
                groups = await asyncio.to_thread(rds.xinfo_groups, lane)
                waiting += sum(int(g.get("lag") or 0) for g in groups)
            except redis.ResponseError:
                pass
        try:
            needed = await asyncio.to_thread(open_utterances, metrics_url)
        except httpx.HTTPError:  # a gateway too busy to answer in 5 s: the sample is lost
            needed = -1
        out.append((sum(h.slots_used for h in hbs), sum(h.max_batch for h in hbs), waiting, needed))
        try:
            await asyncio.wait_for(done.wait(), 1.0)
        except TimeoutError:
            pass


async def measure(args, http: str, metrics_url: str, rds_url: str, gw: psutil.Process,
                  workers: list[tuple[psutil.Process, str]], sentences: list[bytes], vad: str) -> dict:
    url = http.replace("http", "ws") + "/v1/audio/stream"
    rng = random.Random(args.seed)
    conns = plan(args.connections, args.speaking, args.seconds, args.gap_s, rng, sentences)
    started, ready = asyncio.Event(), [0]
    rss0 = gw.memory_info().rss
    tasks = []
    for c in conns:  # open in batches of 100 so the handshakes do not time out together
        tasks.append(asyncio.create_task(run_conn(url, c, args.frame_ms, started, args.drain_s, ready)))
        if len(tasks) % 100 == 0:
            while ready[0] < len(tasks) - 5 and not any(t.done() for t in tasks):
                await asyncio.sleep(0.05)
    while ready[0] < len(conns):
        if any(t.done() for t in tasks):
            for t in tasks:
                if t.done() and t.exception():
                    raise RuntimeError(f"a voice connection failed to start: {t.exception()!r}")
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)
    rss1 = gw.memory_info().rss
    rds = redis.Redis.from_url(rds_url)
    keys = Keys()
    samples: list[tuple[int, int, int, int]] = []
    done = asyncio.Event()
    sampler = asyncio.create_task(sample_slots(rds, keys, metrics_url, samples, done))
    gw_cpu0 = cpu_s(family(gw))
    wk_cpu0 = [cpu_s(family(w)) for w, _ in workers]
    wk_audio0 = [audio_decoded(url) for _, url in workers]
    t_start = time.monotonic()
    started.set()
    speaking = []  # each second: connections inside a sentence (VAD on) / streaming (VAD off)
    for k in range(int(args.seconds)):
        await asyncio.sleep(max(0.0, t_start + k + 0.5 - time.monotonic()))
        ms = (k + 0.5) * 1000
        speaking.append(len(conns) if vad == "off" else
                        sum(1 for c in conns if any(s <= ms < e for s, e in c.speech_spans)))
    await asyncio.sleep(max(0.0, t_start + args.seconds - time.monotonic()))
    gw_cpu = cpu_s(family(gw)) - gw_cpu0
    gw_wall = time.monotonic() - t_start
    await asyncio.gather(*tasks, return_exceptions=True)
    wk_cpu = [cpu_s(family(w)) - c0 for (w, _), c0 in zip(workers, wk_cpu0)]
    wk_audio = [audio_decoded(url) - a0 for (_, url), a0 in zip(workers, wk_audio0)]
    done.set()
    await sampler
    rds.close()

    finals = [f for c in conns for _, f in c.finals]
    after_speech = latencies(conns)
    in_run = samples[:int(args.seconds)]
    errors: dict[str, int] = {}
    for c in conns:
        for e in c.errors:
            errors[e.get("code", "?")] = errors.get(e.get("code", "?"), 0) + 1
    sentences_said = sum(len(c.speech_spans) for c in conns)
    return {
        "vad": vad,
        "sentences": sentences_said,
        "finals": len(finals),
        "finals_with_text": sum(1 for f in finals if f.get("text")),
        "busy_mean": statistics.mean(s[0] for s in in_run) if in_run else float("nan"),
        "busy_max": max((s[0] for s in in_run), default=0),
        "capacity": max((s[1] for s in samples), default=0),
        "waiting_max": max((s[2] for s in samples), default=0),
        "waiting_end": in_run[-1][2] if in_run else 0,
        "latency_p50": pct(after_speech, 50), "latency_p99": pct(after_speech, 99),
        "latency_n": len(after_speech),
        "rtf": [c / a if a else float("nan") for c, a in zip(wk_cpu, wk_audio)],
        "worker_cpu": [x / gw_wall for x in wk_cpu],
        "audio_decoded_s": sum(wk_audio),
        "gw_cores": gw_cpu / gw_wall,
        "gw_cpu_ms_per_conn_s": gw_cpu / gw_wall / args.connections * 1000,
        "gw_kib_per_conn": (rss1 - rss0) / args.connections / 1024,
        "client_lag_ms": max(c.lag_ms for c in conns),
        "errors": errors,
        "open_mean": statistics.mean([s[3] for s in in_run if s[3] >= 0] or [float("nan")]),
        "open_max": max((s[3] for s in in_run), default=0),
        "speaking_mean": statistics.mean(speaking) if speaking else float("nan"),
        "speaking_max": max(speaking, default=0),
    }


def run_mode(args, vad: str, sentences: list[bytes]) -> dict:
    rds = EmbeddedRedis().start()
    env = dict(os.environ, SF_REDIS_URL=rds.url, SF_LOG_LEVEL="warning",
               SF_MAX_CONNECTIONS=str(args.connections + 100), SF_VAD=vad)
    fleet = Fleet()
    try:
        port, mport = free_port(), free_port()
        gw = fleet.start("gateway", ["gateway", "--port", str(port), "--grpc-port", "0"],
                         dict(env, SF_METRICS_PORT=str(mport)))
        wports = [free_port() for _ in range(args.workers)]
        wenv = dict(env, **({"SF_MAX_BATCH": str(args.slots)} if args.slots else {}))
        workers = [fleet.start(f"worker{k}", ["worker", "--model", MODEL], dict(wenv, SF_METRICS_PORT=str(p)))
                   for k, p in enumerate(wports)]
        http = f"http://127.0.0.1:{port}"
        if not wait_ready(http, abort=lambda: bool(fleet.dead())):
            raise RuntimeError(f"fleet not ready: {fleet.dead()}")
        time.sleep(1.0)
        return asyncio.run(measure(args, http, f"http://127.0.0.1:{mport}/metrics", rds.url, psutil.Process(gw.pid),
                                   [(psutil.Process(w.pid), f"http://127.0.0.1:{p}/metrics")
                                    for w, p in zip(workers, wports)], sentences, vad))
    finally:
        fleet.stop()
        rds.stop()


def report(args, results: list[dict]) -> None:
    print(f"\none gateway, {args.connections} voice WebSockets ({args.speaking} speaking, "
          f"{args.frame_ms} ms frames, {args.seconds:g} s), {args.workers} speech workers on {MODEL} "
          f"(PocketSphinx), {os.cpu_count()} cores")
    rows = [
        ("sentences spoken", lambda r: f"{r['sentences']}"),
        ("finals (with text)", lambda r: f"{r['finals']} ({r['finals_with_text']})"),
        ("speaking at once (VAD off: streaming), mean / max",
         lambda r: f"{r['speaking_mean']:.1f} / {r['speaking_max']}"),
        ("utterances open at the gateway, mean / max", lambda r: f"{r['open_mean']:.1f} / {r['open_max']}"),
        ("worker slots busy, mean / max", lambda r: f"{r['busy_mean']:.1f} / {r['busy_max']} of {r['capacity']}"),
        ("tasks waiting for a slot, max / at end", lambda r: f"{r['waiting_max']} / {r['waiting_end']}"),
        ("final latency after speech p50 / p99", lambda r: f"{r['latency_p50']:.0f} / {r['latency_p99']:.0f} ms"
         if r['latency_n'] else "no finals"),
        ("finals of the sentences within the drain", lambda r: f"{r['latency_n']} of {r['sentences']}"),
        ("worker RTF (CPU s per s of audio decoded), each", lambda r: " ".join(f"{x:.2f}" for x in r["rtf"])),
        ("audio decoded by the workers", lambda r: f"{r['audio_decoded_s']:.0f} s"),
        ("worker CPU (cores), each", lambda r: " ".join(f"{x:.2f}" for x in r["worker_cpu"])),
        ("gateway CPU (cores)", lambda r: f"{r['gw_cores']:.2f}"),
        ("gateway CPU per connection", lambda r: f"{r['gw_cpu_ms_per_conn_s']:.2f} ms/s"),
        ("gateway memory per connection", lambda r: f"{r['gw_kib_per_conn']:.1f} KiB"),
        ("client send lag, max", lambda r: f"{r['client_lag_ms']:.0f} ms"),
        ("errors", lambda r: ", ".join(f"{k} {v}" for k, v in r["errors"].items()) or "none"),
    ]
    names = [f"VAD {r['vad']}" if r["vad"] != "off" else "VAD off" for r in results]
    w = max(len(n) for n, _ in rows)
    print(f"{'':{w}}  " + "  ".join(f"{n:>22}" for n in names))
    for name, fmt in rows:
        print(f"{name:{w}}  " + "  ".join(f"{fmt(r):>22}" for r in results))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connections", type=int, default=800)
    ap.add_argument("--speaking", type=int, default=80)
    ap.add_argument("--seconds", type=float, default=60.0, help="seconds of audio per connection")
    ap.add_argument("--gap-s", type=float, default=8.0, help="mean silence between a speaker's sentences")
    ap.add_argument("--frame-ms", type=int, default=100, choices=range(10, 101), metavar="10..100")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--slots", type=int, default=0, help="decoder slots per worker (0: engine.toml's, 2)")
    ap.add_argument("--vad", default="silero", choices=["silero", "webrtc", "energy"])
    ap.add_argument("--modes", default="on,off", help="on (the --vad detector), off, or both")
    ap.add_argument("--drain-s", type=float, default=30.0, help="how long after stop to wait for finals")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if (why := flite_missing()) is not None:
        raise SystemExit(why)
    sentences = [speech(s) for s in SENTENCES]
    results = []
    for mode in args.modes.split(","):
        vad = args.vad if mode == "on" else "off"
        print(f"... VAD {vad}", flush=True)
        results.append(run_mode(args, vad, sentences))
    report(args, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
