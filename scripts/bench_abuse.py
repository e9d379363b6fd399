#!/usr/bin/env python
"""Issue 36's measurement: one tenant cannot stall the fleet.

A private fleet (``AbuseFleet``): a private redis-server, one gateway with auth on (three
keys: ``victim``, a normal tier; ``attacker``, a low tier with a small rate limit;
``bulk``, unlimited, for the hostile grammars that must reach the worker), a text worker
on the generated ``tiny-gpt`` model and, when a voice attack runs, a speech worker on
``asr-en``. Then for each attack, one after the other:

  * the victim alone: a short completion over HTTP (``victim`` key, a fresh connection
    each, one started every 200 ms whatever became of the last, as independent clients
    would), or for voice a flite sentence said in real time on a voice socket and the
    time from the end of the speech to its final; the median of ``--runs``;
  * the same beside the attack (the attacker runs in a process of its own, so that its
    CPU and its GIL are not the victim's client's); where the
    attack's costly part ends by itself (a request answered, a header sent) the victim's
    requests go on until it has, so that they span it;
  * whether the victim got an error (a non-200, a timeout, an error frame, no final);
  * what the attacker got back (status and error code or message, or the first voice
    ``error`` frame, or the gateway closing the connection) and how long after sending
    the costly part;
  * figures of the attack's own (worker RSS growth over the hostile grammars, gateway CPU
    over the big header, connections the gateway closed...).

Attacks (``--only`` takes one name or several, comma-separated):

  regex           ``guided_regex`` ``((a{50}){50}){50}`` (a new literal in front of each)
  schema-pattern  the same as a JSON-schema ``pattern`` (anchored) in ``response_format``
  tool-pattern    the same inside a tool's ``parameters`` (``tool_choice: required``)
  deep-schema     a JSON schema nested 300 deep in ``response_format``
  grammar-memory  100 distinct hostile grammars (``bulk`` key, so that no rate limit hides
                  them from the worker): the text worker's RSS growth (psutil)
  big-header      an unauthenticated request with a 64 MiB header; the gateway's CPU
  refused-flood   the ``attacker`` key, its bucket emptied, floods requests that each
                  carry a distinct JSON schema (refused by the rate limit, or not)
  half-open       1,000 connections that send half a request line and wait (pre-auth)
  h2-idle         500 HTTP/2 connections on the gRPC port that never open a stream
  voice-3x        the attacker talks without pause on four voice sockets at 3x real time
  voice-150fps    the attacker sends 150 frames of 100 ms a second on one socket

Goals (issue 36), each marked met or not: the victim's median time within 1.5x of its
time alone and no victim error; the attacker refused with a 4xx (HTTP) or an ``error``
frame (voice) within 100 ms of sending the costly part (for voice: of the first frame
past the gateway's real-time allowance, ``SF_AUDIO_MAX_REALTIME`` and
``SF_AUDIO_REALTIME_BURST_S`` when the gateway has them, else of the first frame);
the worker's RSS growth <= 50 MB over 100 distinct hostile grammars; with 1,000 idle
pre-auth connections held a legitimate request answered in <= 100 ms. The idle
connection attacks have no refusal goal (the connections the gateway closes, and when,
are shown).

Every attack is bounded in time (victim requests time out, attackers stop at the end of
their window, a stalled fleet is restarted before the next attack), so a run ends in a
few minutes even where a stall happens. Nothing here is a test: the figures depend on
the machine and what else runs on it.

    python -m scripts.bench_abuse [--only regex,big-header] [--runs 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import orjson
import psutil
import redis
import websockets

from scripts.bench_fleet import table
from scripts.procstats import cpu_s, family, rss_mib, stop
from streamfleet.devkit.speech import SENTENCES, flite_missing, silence, speech
from streamfleet.launcher import EmbeddedRedis, free_port, spawn, stop_processes, wait_ready
from streamfleet.shared.aio import raise_open_files_limit
from streamfleet.shared.keys import Keys

TEXT_MODEL = "tiny-gpt"
SPEECH_MODEL = "asr-en"
#: the attacker's tier is small; the victim's is a normal paying customer's, unthrottled
#: here so that its own runs never meet a limit; ``bulk`` carries the hostile grammars
#: that must reach the worker
TIERS = {
    "attacker": {"requests_per_minute": 60, "burst": 10, "max_streams": 4, "max_lane": "normal",
                 "max_connections": 8},
    "victim": {"requests_per_minute": None, "burst": 0, "max_streams": None, "max_lane": "high"},
    "bulk": {"requests_per_minute": None, "burst": 0, "max_streams": None, "max_lane": "normal"},
}
VICTIM_BODY = {"model": TEXT_MODEL, "prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True,
               "temperature": 0}
#: the catastrophic regular expression of issue 36 (a literal in front makes each distinct);
#: on tiny-gpt's 1,024 tokens each of its token masks takes about 50 ms and its first one
#: some 45 MB (a larger vocabulary costs more), so the attacker asks for ATTACK_TOKENS
HOSTILE = "((a{50}){50}){50}"
ATTACK_TOKENS = 200
BYTES_PER_MS = 32  # 16 kHz PCM16 mono
GOAL_RATIO = 1.5
GOAL_REFUSAL_MS = 100.0
GOAL_GROWTH_MB = 50.0
GOAL_IDLE_LEGIT_MS = 100.0
#: an attacker request gets no longer than this for an answer
ATTACK_TIMEOUT_S = 20.0
#: a victim request (text) gets no longer than this
VICTIM_TIMEOUT_S = 10.0
#: the most worker memory growth the grammar attack is let cause (the machine is shared)
MEMORY_CAP_MB = 2048.0


def hostile(i: int) -> str:
    return f"x{i}" + HOSTILE


def pattern_schema(regex: str) -> dict:
    """A schema whose one string must match ``regex``, anchored: JSON Schema's ``pattern``
    matches anywhere in the string, so an unanchored one is ``.*(regex).*``, which any
    string meets and which costs nothing to enforce."""
    return {"type": "object", "properties": {"s": {"type": "string", "pattern": f"^{regex}$"}}, "required": ["s"],
            "additionalProperties": False}


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def flood_schema(i: int) -> dict:
    """A legitimate, moderately costly schema, distinct for each ``i``."""
    props = {f"p{k}_{i}": {"type": "string", "pattern": f"^[a-z]{{1,{20 + k}}}$"} for k in range(24)}
    return {"type": "object", "properties": props, "required": list(props)[:4]}


# -- the fleet -----------------------------------------------------------------------------

class AbuseFleet:
    """A private Redis, one gateway with auth on, a text worker, a speech worker when
    asked; each process logs to a file of its own under ``workdir``."""

    def __init__(self, workdir: Path, speech: bool) -> None:
        self.workdir = workdir
        self.with_speech = speech
        self.redis: EmbeddedRedis | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self.port = self.grpc_port = self.metrics_port = 0
        self.victim_key = self.attacker_key = self.bulk_key = ""
        self.keys = Keys()
        self.restarts: list[str] = []

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def voice_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/audio/stream"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SF_") and k != "REDIS_URL"}
        env.update(SF_REDIS_URL=self.redis.url, SF_LOG_LEVEL="warning", SF_LOG_FORMAT="json",
                   SF_AUTH_ENABLED="true", SF_TIERS=orjson.dumps(TIERS).decode(), SF_DEFAULT_MODEL=TEXT_MODEL,
                   PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
        env.update(extra)
        return env

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")
        p = spawn([sys.executable, "-m", "streamfleet", *args], env=env, stdout=log,
                  stderr=subprocess.STDOUT)
        log.close()
        self.procs[name] = p
        return p

    def dead(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is not None]

    def view(self) -> FleetView:
        return FleetView(self.http, self.voice_url, self.port, self.grpc_port, self.victim_key, self.attacker_key,
                         self.bulk_key, {n: p.pid for n, p in self.procs.items()})

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def start(self) -> None:
        self.redis = EmbeddedRedis().start()
        self.port, self.grpc_port, self.metrics_port = free_port(), free_port(), free_port()
        self.victim_key, self.attacker_key, self.bulk_key = _add_keys(self.redis.url)
        self.start_gateway()
        self.start_worker()
        if self.with_speech:
            self.start_speech()
        self.wait()

    def start_gateway(self) -> None:
        self._spawn("gateway", ["gateway", "--port", str(self.port)],
                    self.env(SF_GRPC_PORT=str(self.grpc_port), SF_METRICS_PORT=str(self.metrics_port)))

    def start_worker(self) -> None:
        self._spawn("worker", ["worker", "--model", TEXT_MODEL], self.env(SF_MODEL=TEXT_MODEL, SF_THREADS="1"))

    def start_speech(self) -> None:
        self._spawn("speech", ["worker", "--model", SPEECH_MODEL], self.env(SF_MODEL=SPEECH_MODEL))

    def wait(self, timeout: float = 120.0) -> None:
        models = (TEXT_MODEL, SPEECH_MODEL) if self.with_speech else (TEXT_MODEL,)
        if not wait_ready(self.http, abort=lambda: bool(self.dead()), timeout=timeout,
                          pid=self.pid("gateway"), models=models):
            raise RuntimeError(f"fleet not ready (exited: {self.dead() or 'none'}); logs in {self.workdir}")

    def clear_lanes(self, model: str) -> None:
        r = redis.Redis.from_url(self.redis.url)
        try:
            r.delete(*self.keys.lanes(model).values())
        finally:
            r.close()

    def lane_backlog(self, model: str) -> int:
        r = redis.Redis.from_url(self.redis.url, socket_timeout=5)
        try:
            return sum(int(r.xlen(k)) for k in self.keys.lanes(model).values())
        finally:
            r.close()

    def restart(self, names: list[str], why: str) -> None:
        """Stop ``names`` (SIGKILL after 5 s), drop the tasks queued for their models
        (a hostile task would stall the new worker too), start them again."""
        for name in names:
            if name in self.procs:
                stop(self.procs.pop(name), timeout=5.0)
        if "worker" in names:
            self.clear_lanes(TEXT_MODEL)
            self.start_worker()
        if "speech" in names:
            self.clear_lanes(SPEECH_MODEL)
            self.start_speech()
        if "gateway" in names:
            self.start_gateway()
        self.restarts.append(f"{'+'.join(names)}: {why}")
        self.wait()

    def close(self) -> None:
        stop_processes(self.procs.values(), timeout=10.0)
        if self.redis is not None:
            self.redis.stop()


@dataclass(frozen=True)
class FleetView:
    """What an attacker (a process of its own) knows of the fleet."""

    http: str
    voice_url: str
    port: int
    grpc_port: int
    victim_key: str
    attacker_key: str
    bulk_key: str
    pids: dict[str, int]

    def pid(self, name: str) -> int:
        return self.pids[name]


def _add_keys(redis_url: str) -> tuple[str, str, str]:
    """The victim's, the attacker's and the bulk key, as `streamfleet keys add` makes them."""
    from streamfleet.gateway.admission.auth import KeyStore
    from streamfleet.shared.redis import connect
    from streamfleet.shared.tiers import parse_tiers

    async def main() -> tuple[str, str, str]:
        client = connect(redis_url)
        try:
            store = KeyStore(client, Keys(), tiers=parse_tiers(orjson.dumps(TIERS).decode()), cache_ttl_s=0)
            return tuple([(await store.add(name, name))[0] for name in ("victim", "attacker", "bulk")])
        finally:
            await client.aclose()

    return asyncio.run(main())


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# -- what the victim and the attacker see ---------------------------------------------------

@dataclass
class Answer:
    """One HTTP answer: status (0 = none), error code or message, milliseconds."""

    status: int
    what: str
    ms: float

    @property
    def refused(self) -> bool:
        return 400 <= self.status < 500

    def label(self) -> str:
        if self.status == 200:
            return "200 (accepted)"
        return f"{self.status} {self.what}".strip() if self.status else self.what


def _error_of(r: httpx.Response) -> str:
    try:
        err = r.json().get("error")
    except ValueError:
        return r.text[:60].strip()
    if isinstance(err, dict):
        return str(err.get("code") or err.get("type") or err.get("message", ""))[:60]
    return str(err)[:60] if err else ""


async def post(client: httpx.AsyncClient, url: str, body: dict, key: str | None, timeout: float) -> Answer:
    t0 = time.perf_counter()
    try:
        r = await client.post(url, json=body, headers=bearer(key) if key else {}, timeout=timeout)
    except httpx.TimeoutException:
        return Answer(0, f"no answer in {timeout:.0f} s", timeout * 1000)
    except httpx.HTTPError as exc:
        return Answer(0, type(exc).__name__, (time.perf_counter() - t0) * 1000)
    ms = (time.perf_counter() - t0) * 1000
    return Answer(r.status_code, "" if r.status_code == 200 else _error_of(r), ms)


async def victim_once(fleet: AbuseFleet, timeout: float = VICTIM_TIMEOUT_S) -> Answer:
    """A short completion on a fresh connection (the accept path is part of what is measured)."""
    async with httpx.AsyncClient() as client:
        return await post(client, fleet.http + "/v1/completions", VICTIM_BODY, fleet.victim_key, timeout)


async def text_victim(fleet: AbuseFleet, runs: int, window_s: float, over=None,
                      every_s: float = 0.2) -> list[Answer]:
    """Victim requests started every ``every_s`` whatever became of the earlier ones (a
    client does not wait for a stalled fleet to send its next request): ``runs`` of them
    and, while an attack whose costly part ends by itself is not ``over`` (an event), more,
    so that they span it; none started after ``window_s``."""
    t0 = time.monotonic()
    probes: list[asyncio.Task] = []
    while len(probes) < runs or (over is not None and not over.is_set()):
        if time.monotonic() - t0 >= window_s:
            break
        probes.append(asyncio.create_task(victim_once(fleet)))
        await asyncio.sleep(max(0.0, t0 + len(probes) * every_s - time.monotonic()))
    return list(await asyncio.gather(*probes))


class VoiceSocket:
    """One voice WebSocket: every frame the gateway sends, with its arrival time."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.frames: list[tuple[float, dict]] = []
        self.closed: str | None = None
        self.changed = asyncio.Event()
        self.reader = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, fleet: AbuseFleet, key: str) -> VoiceSocket:
        ws = await websockets.connect(f"{fleet.voice_url}?api_key={key}", max_size=None, open_timeout=20,
                                      ping_interval=None, compression=None)
        v = cls(ws)
        await ws.send(orjson.dumps({"type": "start", "model": SPEECH_MODEL, "sample_rate": 16000,
                                    "encoding": "pcm_s16le"}).decode())
        return v

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                if isinstance(raw, str):
                    self.frames.append((time.monotonic(), orjson.loads(raw)))
                    self.changed.set()
        except websockets.ConnectionClosed as exc:
            close = exc.rcvd or exc.sent
            self.closed = f"closed {close.code} {close.reason}".strip() if close else "closed"
        finally:
            self.closed = self.closed or "closed"
            self.changed.set()

    def of(self, kind: str) -> list[tuple[float, dict]]:
        return [(t, f) for t, f in self.frames if f.get("type") == kind]

    async def wait_for(self, predicate, timeout: float) -> tuple[float, dict] | None:
        deadline = time.monotonic() + timeout
        while True:
            for t, f in self.frames:
                if predicate(f):
                    return t, f
            left = deadline - time.monotonic()
            if left <= 0 or self.closed:
                return None
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except TimeoutError:
                pass

    async def send_realtime(self, pcm: bytes, frame_ms: int = 20, until: Callable[[], bool] = lambda: False) -> None:
        step = frame_ms * BYTES_PER_MS
        t0 = time.monotonic()
        for n, i in enumerate(range(0, len(pcm), step), 1):
            if until() or self.closed:
                return
            await self.ws.send(pcm[i:i + step])
            await asyncio.sleep(max(0.0, t0 + n * frame_ms / 1000 - time.monotonic()))

    async def close(self) -> None:
        self.reader.cancel()
        try:
            await asyncio.wait_for(self.ws.close(), 5)
        except (TimeoutError, websockets.WebSocketException, OSError):
            pass


async def voice_victim(fleet: AbuseFleet, runs: int, window_s: float, over=None,
                       every_s: float = 0.0) -> list[Answer]:
    """Up to ``runs`` sentences said in real time on one socket: from the end of the
    speech to its final (an error frame, a closed socket or no final in time: an error)."""
    deadline = time.monotonic() + window_s
    out: list[Answer] = []
    try:
        v = await VoiceSocket.open(fleet, fleet.victim_key)
    except (TimeoutError, OSError, websockets.WebSocketException) as exc:
        return [Answer(0, f"connect: {type(exc).__name__}", 0.0)]
    try:
        if await v.wait_for(lambda f: f.get("type") in ("started", "error"), 20) is None:
            return [Answer(0, "no started frame", 20000.0)]
        sentence = speech(SENTENCES[2])
        for k in range(runs):
            if deadline - time.monotonic() <= (1.0 if k == 0 else 15.0):  # (room for a delayed final)
                break
            finals, errors = len(v.of("final")), len(v.of("error"))
            await v.send_realtime(silence(300) + sentence)
            spoken = time.monotonic()
            got = asyncio.Event()
            trailing = asyncio.create_task(v.send_realtime(silence(60_000), until=got.is_set))
            left = max(1.0, deadline - time.monotonic())
            hit = await v.wait_for(lambda f: (f.get("type") == "final" and len(v.of("final")) > finals)
                                   or (f.get("type") == "error" and len(v.of("error")) > errors), left)
            got.set()
            await asyncio.gather(trailing, return_exceptions=True)
            if hit is None:
                out.append(Answer(0, v.closed or f"no final in {left:.0f} s", (time.monotonic() - spoken) * 1000))
                break
            t, frame = hit
            if frame["type"] == "error" or not v.of("final")[finals][1].get("text"):
                err = frame if frame["type"] == "error" else {"code": "empty final"}
                out.append(Answer(0, str(err.get("code")), (t - spoken) * 1000))
            else:
                t, _ = v.of("final")[finals]
                out.append(Answer(200, "", (t - spoken) * 1000))
            await asyncio.sleep(0.3)
    finally:
        await v.close()
    return out


# -- attacks -------------------------------------------------------------------------------

@dataclass
class AttackContext:
    """What the attacker's process shares with the measuring one (``multiprocessing``
    events)."""

    fleet: FleetView
    started: object  # the costly part is on
    #: the costly part is over (set by attacks that end by themselves: a request answered,
    #: a header sent); the victim's runs go on until then
    over: object
    stop: object  # the victim is done


@dataclass
class Outcome:
    """What the attacker got, and the attack's own figures."""

    refused_with: str = "-"
    refusal_ms: float | None = None
    refused: bool | None = None  # a documented refusal (4xx, error frame); None: not asked for
    extra: dict = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)  # goals of the attack's own


async def stopped(ctx: AttackContext, timeout: float) -> bool:
    """Wait up to ``timeout`` for the victim to be done; whether it is."""
    deadline = time.monotonic() + timeout
    while not ctx.stop.is_set() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return ctx.stop.is_set()


def summarize_answers(answers: list[Answer], share: float = 1.0) -> tuple[str, float | None, bool]:
    """The most common answer, the median time of the refusals (else of all), and whether
    at least ``share`` of the answers were refusals."""
    if not answers:
        return "no answer", None, False
    counts: dict[str, int] = {}
    for a in answers:
        counts[a.label()] = counts.get(a.label(), 0) + 1
    top = max(counts, key=counts.get)
    refused = [a.ms for a in answers if a.refused]
    label = top if len(counts) == 1 else f"{top} ({counts[top]}/{len(answers)})"
    return label, statistics.median(refused or [a.ms for a in answers]), len(refused) >= share * len(answers)


async def one_request_attack(ctx: AttackContext, path: str, body: dict) -> Outcome:
    """One hostile request with the attacker's key, answered or not within ATTACK_TIMEOUT_S."""
    fleet = ctx.fleet
    async with httpx.AsyncClient() as client:
        ctx.started.set()
        a = await post(client, fleet.http + path, body, fleet.attacker_key, ATTACK_TIMEOUT_S)
    ctx.over.set()
    await stopped(ctx, ATTACK_TIMEOUT_S)
    return Outcome(a.label(), a.ms, a.refused)


async def attack_regex(ctx: AttackContext) -> Outcome:
    return await one_request_attack(ctx, "/v1/completions", {"model": TEXT_MODEL, "prompt": "a",
                                                            "max_tokens": ATTACK_TOKENS, "guided_regex": hostile(0)})


async def attack_schema_pattern(ctx: AttackContext) -> Outcome:
    fmt = {"type": "json_schema", "json_schema": {"name": "h", "schema": pattern_schema(hostile(1))}}
    return await one_request_attack(ctx, "/v1/chat/completions", {
        "model": TEXT_MODEL, "messages": [{"role": "user", "content": "a"}], "max_tokens": ATTACK_TOKENS,
        "response_format": fmt})


async def attack_tool_pattern(ctx: AttackContext) -> Outcome:
    tools = [{"type": "function", "function": {"name": "f", "parameters": pattern_schema(hostile(2))}}]
    return await one_request_attack(ctx, "/v1/chat/completions", {
        "model": TEXT_MODEL, "messages": [{"role": "user", "content": "a"}], "max_tokens": ATTACK_TOKENS,
        "tools": tools, "tool_choice": "required"})


async def attack_deep_schema(ctx: AttackContext) -> Outcome:
    fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": deep_schema(300)}}
    return await one_request_attack(ctx, "/v1/chat/completions", {
        "model": TEXT_MODEL, "messages": [{"role": "user", "content": "a"}], "max_tokens": 8, "response_format": fmt})


async def attack_grammar_memory(ctx: AttackContext, count: int = 100, budget_s: float = 90.0) -> Outcome:
    """``count`` distinct hostile grammars, two at a time, with the unlimited ``bulk`` key;
    the text worker's RSS (and its children's) sampled throughout: its growth is the
    highest sample less the first. Stops early past ``budget_s`` or MEMORY_CAP_MB."""
    fleet = ctx.fleet
    worker = psutil.Process(fleet.pid("worker"))
    gateway = psutil.Process(fleet.pid("gateway"))
    rss0, gw0 = rss_mib(family(worker)), rss_mib(family(gateway))
    peak = [rss0, gw0]
    answers: list[Answer] = []
    deadline = time.monotonic() + budget_s
    sent = [0]
    capped = [False]

    async def sample() -> None:
        while True:
            peak[0] = max(peak[0], rss_mib(family(worker)))
            peak[1] = max(peak[1], rss_mib(family(gateway)))
            if peak[0] - rss0 > MEMORY_CAP_MB:
                capped[0] = True
            await asyncio.sleep(0.2)

    async def sender(client: httpx.AsyncClient, lane: int) -> None:
        while sent[0] < count and time.monotonic() < deadline and not capped[0]:
            i = sent[0]
            sent[0] += 1
            body = {"model": TEXT_MODEL, "prompt": "a", "max_tokens": 4, "guided_regex": hostile(1000 + i)}
            left = max(1.0, min(ATTACK_TIMEOUT_S, deadline - time.monotonic()))
            answers.append(await post(client, fleet.http + "/v1/completions", body, fleet.bulk_key, left))

    sampler = asyncio.create_task(sample())
    ctx.started.set()
    try:
        async with httpx.AsyncClient() as client:
            await asyncio.gather(sender(client, 0), sender(client, 1))
        await asyncio.sleep(1.0)  # what a compile still running adds
    finally:
        sampler.cancel()
        ctx.over.set()
    label, ms, refused = summarize_answers(answers)
    growth = peak[0] - rss0
    why = " (memory cap)" if capped[0] else (" (time budget)" if sent[0] < count else "")
    return Outcome(label, ms, refused, extra={
        "grammars_sent": sent[0], "grammars_answered": len(answers), "worker_rss_growth_mb": round(growth, 1),
        "gateway_rss_growth_mb": round(peak[1] - gw0, 1), "stopped_early": why.strip(" ()") or None},
        checks={f"worker RSS +{growth:.0f} MB over {sent[0]} of {count} hostile grammars{why} (goal <= "
                f"{GOAL_GROWTH_MB:.0f} MB over {count})": growth <= GOAL_GROWTH_MB and sent[0] >= count})


async def attack_big_header(ctx: AttackContext, size: int = 64 << 20) -> Outcome:
    """An unauthenticated request whose one header is ``size`` bytes, sent on a thread;
    the answer (or the gateway closing the socket) timed from the first byte sent."""
    fleet = ctx.fleet
    gateway = psutil.Process(fleet.pid("gateway"))
    cpu0 = cpu_s(family(gateway))
    result: dict = {}

    def run() -> None:
        sock = socket.create_connection(("127.0.0.1", fleet.port), timeout=ATTACK_TIMEOUT_S)
        got = bytearray()
        first: list[float] = []

        def reader() -> None:  # the answer's head and body, or the socket closed
            try:
                while True:
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    if not first:
                        first.append(time.perf_counter())
                    got.extend(chunk)
                    head, sep, body = bytes(got).partition(b"\r\n\r\n")
                    if sep:
                        length = [ln.split(b":", 1)[1] for ln in head.lower().split(b"\r\n")
                                  if ln.startswith(b"content-length:")]
                        if len(body) >= (int(length[0]) if length else 0):
                            break
            except (OSError, ValueError):
                pass
            if not first:
                first.append(time.perf_counter())
            result["closed"] = True

        rd = threading.Thread(target=reader, daemon=True)
        t0 = time.perf_counter()
        result["t0"] = t0
        rd.start()
        ctx.started.set()
        try:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"X-Padding: ")
            chunk = b"a" * (1 << 20)
            result["sent_mb"] = 0
            for _ in range(size // len(chunk)):
                if not rd.is_alive():  # answered (or closed) before the header was all sent
                    break
                sock.sendall(chunk)
                result["sent_mb"] += 1
            sock.sendall(b"\r\nContent-Length: 2\r\n\r\n{}")
        except OSError as exc:
            result["send_error"] = type(exc).__name__
        result["sent_s"] = time.perf_counter() - t0
        rd.join(ATTACK_TIMEOUT_S)
        result["ms"] = ((first[0] if first else time.perf_counter()) - t0) * 1000
        result["response"] = bytes(got[:4096])
        sock.close()

    try:
        await asyncio.to_thread(run)
    finally:
        ctx.over.set()
    await stopped(ctx, ATTACK_TIMEOUT_S)
    head = result.get("response", b"")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else 0
    if status:
        body = head.partition(b"\r\n\r\n")[2]
        try:
            err = orjson.loads(body).get("error", {})
            what = err.get("code", "") if isinstance(err, dict) else str(err)
        except (orjson.JSONDecodeError, AttributeError):
            what = head.split(b"\r\n", 1)[0].decode(errors="replace")[13:]
        label = f"{status} {what}".strip()
    else:
        label = "closed, no answer" if result.get("closed") else "no answer"
    return Outcome(label, result.get("ms"), 400 <= status < 500, extra={
        "gateway_cpu_s": round(cpu_s(family(gateway)) - cpu0, 2), "header_sent_mb": result.get("sent_mb"),
        "send_s": round(result.get("sent_s", 0.0), 2), "send_error": result.get("send_error")})


async def attack_refused_flood(ctx: AttackContext, concurrency: int = 16) -> Outcome:
    """Empty the attacker's bucket with cheap requests, then flood requests that each
    carry a distinct JSON schema until the victim is done."""
    fleet = ctx.fleet
    answers: list[Answer] = []
    n = [0]
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency)) as client:
        url = fleet.http + "/v1/chat/completions"
        cheap = {"model": TEXT_MODEL, "messages": [{"role": "user", "content": "a"}], "max_tokens": 1}
        for _ in range(40):  # the burst, at most
            if (await post(client, url, cheap, fleet.attacker_key, ATTACK_TIMEOUT_S)).status == 429:
                break
        deadline = time.monotonic() + 60.0

        async def loop() -> None:
            while not ctx.stop.is_set() and time.monotonic() < deadline:
                n[0] += 1
                fmt = {"type": "json_schema", "json_schema": {"name": "f", "schema": flood_schema(n[0])}}
                body = dict(cheap, max_tokens=8, response_format=fmt)
                answers.append(await post(client, url, body, fleet.attacker_key, 5.0))

        ctx.started.set()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
    # (the bucket refills: a request a second gets through, as it should)
    label, ms, refused = summarize_answers(answers, share=0.9)
    refusals = sorted(a.ms for a in answers if a.refused)
    return Outcome(label, ms, refused, extra={
        "requests": len(answers), "refused": len(refusals),
        "refusal_p90_ms": round(refusals[int(0.9 * (len(refusals) - 1))], 1) if refusals else None})


async def _hold_connections(ctx: AttackContext, port: int, count: int, opening: bytes, hold_s: float,
                            batch: int = 100) -> Outcome:
    """Open ``count`` connections that each send ``opening`` and then nothing; hold them
    until the victim is done and at least ``hold_s`` has passed. Which of them the
    gateway closed (and when, after their opening), and what it sent first."""
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = []
    closed: list[tuple[float, bytes]] = []  # (seconds after opening, what the gateway sent)
    refused_at_connect = [0]

    async def open_one() -> None:
        try:
            r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
        except (TimeoutError, OSError):
            refused_at_connect[0] += 1
            return
        w.write(opening)
        conns.append((r, w, time.monotonic()))

    for i in range(0, count, batch):
        await asyncio.gather(*(open_one() for _ in range(min(batch, count - i))))

    async def watch(r: asyncio.StreamReader, t0: float) -> None:
        got = bytearray()
        try:
            while chunk := await r.read(4096):
                got.extend(chunk[:65536 - len(got)])
        except OSError:
            pass
        closed.append((time.monotonic() - t0, bytes(got)))

    began = time.monotonic()
    watchers = [asyncio.create_task(watch(r, t0)) for r, _, t0 in conns]
    ctx.started.set()
    await stopped(ctx, 120)
    await asyncio.sleep(max(0.0, began + hold_s - time.monotonic()))
    open_at_end = len(conns) - len(closed)
    for t in watchers:
        t.cancel()
    for _, w, _ in conns:
        w.close()
    await asyncio.sleep(0.1)
    firsts: dict[str, int] = {}
    for _, got in closed:
        if got.startswith(b"HTTP/1.1 "):
            key = got.split(b"\r\n", 1)[0].decode(errors="replace")[9:]
        elif 7 in _h2_frame_types(got):
            key = "GOAWAY"
        else:
            key = "closed"
        firsts[key] = firsts.get(key, 0) + 1
    top = max(firsts, key=firsts.get) if firsts else None
    label = (f"{top}: {len(closed)}/{len(conns)} closed" if top else f"all {len(conns)} held {hold_s:.0f} s")
    if refused_at_connect[0]:
        label += f", {refused_at_connect[0]} refused at connect"
    return Outcome(label, statistics.median(t for t, _ in closed) * 1000 if closed else None, None, extra={
        "opened": len(conns), "refused_at_connect": refused_at_connect[0], "closed_by_gateway": len(closed),
        "open_at_end": open_at_end, "held_s": round(time.monotonic() - began, 1), "first_bytes": firsts})


async def attack_half_open(ctx: AttackContext) -> Outcome:
    return await _hold_connections(ctx, ctx.fleet.port, 1000, b"POST /v1/compl", hold_s=12.0)


#: the HTTP/2 client preface and an empty SETTINGS frame: a connection that opens no call
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def _h2_frame_types(data: bytes) -> list[int]:
    """The types of the whole HTTP/2 frames in ``data`` (SETTINGS 4, PING 6, GOAWAY 7...)."""
    types = []
    while len(data) >= 9:
        length = int.from_bytes(data[:3], "big")
        types.append(data[3])
        data = data[9 + length:]
    return types


async def attack_h2_idle(ctx: AttackContext) -> Outcome:
    return await _hold_connections(ctx, ctx.fleet.grpc_port, 500, H2_PREFACE, hold_s=12.0)


def _realtime_allowance() -> tuple[float, float] | None:
    """The gateway's real-time allowance for a voice socket (its ``audio_max_realtime``
    and ``audio_realtime_burst_s`` defaults), None where it has none."""
    from streamfleet.shared.settings import GatewaySettings

    fields = GatewaySettings.model_fields
    if "audio_max_realtime" not in fields or "audio_realtime_burst_s" not in fields:
        return None
    rt, burst = fields["audio_max_realtime"].default, fields["audio_realtime_burst_s"].default
    return (float(rt), float(burst)) if rt else None


async def _voice_attack(ctx: AttackContext, sockets: int, frame_ms: int, frames_per_s: float) -> Outcome:
    """The attacker talks without pause (flite's sentences back to back) on ``sockets``
    sockets, each sending ``frames_per_s`` frames of ``frame_ms`` a second, until the
    victim is done. The refusal: the first ``error`` frame (or close) on any socket,
    timed from the first frame past the gateway's real-time allowance."""
    fleet = ctx.fleet
    talk = b"".join(speech(s) for s in SENTENCES)
    talk = talk * max(1, int(120_000 * BYTES_PER_MS // len(talk)))
    allowance = _realtime_allowance()
    costly: list[float] = []  # when a socket's audio first went past the allowance
    sent_audio_s = [0.0]
    socks: list[VoiceSocket] = []
    refusals: list[tuple[float, str]] = []
    for _ in range(sockets):
        try:
            v = await VoiceSocket.open(fleet, fleet.attacker_key)
        except (TimeoutError, OSError, websockets.WebSocketException) as exc:
            refusals.append((time.monotonic(), f"connect: {type(exc).__name__}"))
            continue
        if await v.wait_for(lambda f: f.get("type") in ("started", "error"), 20) is None:
            refusals.append((time.monotonic(), v.closed or "no started frame"))
        socks.append(v)
    first_frame: list[float] = []

    async def talker(v: VoiceSocket, offset: int) -> None:
        step = frame_ms * BYTES_PER_MS
        t0 = time.monotonic()
        pos = offset * step * 37 % len(talk)
        n = 0
        while not ctx.stop.is_set() and not v.closed and time.monotonic() - t0 < 150:
            pcm = talk[pos:pos + step]
            pos = (pos + step) % (len(talk) - step)
            try:
                await v.ws.send(pcm)
            except websockets.WebSocketException:
                return
            now = time.monotonic()
            if not first_frame:
                first_frame.append(now)
            n += 1
            sent_audio_s[0] += frame_ms / 1000
            if allowance is not None and not costly and n * frame_ms / 1000 > (now - t0) * allowance[0] + allowance[1]:
                costly.append(now)
            await asyncio.sleep(max(0.0, t0 + n / frames_per_s - time.monotonic()))

    ctx.started.set()
    talkers = [asyncio.create_task(talker(v, k)) for k, v in enumerate(socks)]
    await stopped(ctx, 200)
    for t in talkers:
        t.cancel()
    await asyncio.gather(*talkers, return_exceptions=True)
    for v in socks:
        for t, f in v.of("error"):
            refusals.append((t, f"error {f.get('code')}"))
        if v.closed and v.closed != "closed":
            refusals.append((time.monotonic(), v.closed))
        await v.close()
    refusals.sort()
    ref = costly[0] if costly else (first_frame[0] if first_frame else None)
    if refusals:
        codes: dict[str, int] = {}
        for _, what in refusals:
            codes[what] = codes.get(what, 0) + 1
        label = ", ".join(f"{k} x{n}" for k, n in sorted(codes.items(), key=lambda kv: -kv[1])[:2])
        first_after = [t for t, _ in refusals if ref is None or t >= ref - 0.001]
        ms = (first_after[0] - ref) * 1000 if first_after and ref is not None else None
        return Outcome(label, ms, True, extra={"sockets": len(socks), "audio_sent_s": round(sent_audio_s[0], 1),
                                               "error_frames": len(refusals),
                                               "timed_from": "past the allowance" if costly else "first frame"})
    return Outcome("none (all audio taken)", None, False, extra={
        "sockets": len(socks), "audio_sent_s": round(sent_audio_s[0], 1), "error_frames": 0})


async def attack_voice_3x(ctx: AttackContext) -> Outcome:
    return await _voice_attack(ctx, sockets=4, frame_ms=100, frames_per_s=30.0)


async def attack_voice_150fps(ctx: AttackContext) -> Outcome:
    return await _voice_attack(ctx, sockets=1, frame_ms=100, frames_per_s=150.0)


@dataclass(frozen=True)
class Attack:
    name: str
    run: Callable[[AttackContext], Awaitable[Outcome]]
    victim: str = "text"  # text | voice
    window_s: float = 25.0  # the victim's runs under attack start within this
    ends: bool = False  # its costly part ends by itself (the victim's runs span it)
    every_s: float = 0.2  # a text victim's request is started this often
    idle_goal: bool = False  # the legitimate request must take <= GOAL_IDLE_LEGIT_MS
    refusal_goal: bool = True


ATTACKS = {a.name: a for a in (
    Attack("regex", attack_regex, ends=True),
    Attack("schema-pattern", attack_schema_pattern, ends=True),
    Attack("tool-pattern", attack_tool_pattern, ends=True),
    Attack("deep-schema", attack_deep_schema, ends=True),
    Attack("grammar-memory", attack_grammar_memory, window_s=100.0, ends=True, every_s=1.0,
           refusal_goal=False),
    Attack("big-header", attack_big_header, ends=True),
    Attack("refused-flood", attack_refused_flood, window_s=15.0),
    Attack("half-open", attack_half_open, idle_goal=True, refusal_goal=False),
    Attack("h2-idle", attack_h2_idle, idle_goal=True, refusal_goal=False),
    Attack("voice-3x", attack_voice_3x, victim="voice", window_s=75.0),
    Attack("voice-150fps", attack_voice_150fps, victim="voice", window_s=75.0),
)}


# -- running and reporting ------------------------------------------------------------------

@dataclass
class Row:
    attack: str
    alone_ms: float | None
    under_ms: float | None
    ratio: float | None
    victim_runs: int
    victim_errors: list[str]
    refused_with: str
    refusal_ms: float | None
    goal_met: bool
    unmet: list[str]
    extra: dict
    alone_runs_ms: list[float] = field(default_factory=list)
    under_runs_ms: list[float] = field(default_factory=list)
    restarted: str | None = None


def _attacker(name: str, ctx: AttackContext, results) -> None:
    """The attacker's process: one attack, its ``Outcome`` put on ``results`` (as a dict:
    the classes of a ``-m`` module pickle by another name in a spawned child)."""
    try:
        out = asyncio.run(ATTACKS[name].run(ctx))
    except BaseException as exc:  # an attacker that broke: say so, the others go on
        out = Outcome(f"attack failed: {type(exc).__name__}: {exc}"[:80], None, False)
    results.put(asdict(out))


async def attacked(fleet: AbuseFleet, attack: Attack, measure) -> tuple[list[Answer], Outcome]:
    """Run ``attack`` in a process of its own (its CPU and its GIL are not the victim's)
    and ``measure`` the victim beside it."""
    mp = multiprocessing.get_context("spawn")
    ctx = AttackContext(fleet.view(), mp.Event(), mp.Event(), mp.Event())
    results = mp.Queue()
    proc = mp.Process(target=_attacker, args=(attack.name, ctx, results), daemon=True)
    proc.start()
    try:
        t0 = time.monotonic()
        while not ctx.started.is_set() and proc.is_alive() and time.monotonic() - t0 < 60:
            await asyncio.sleep(0.02)
        await asyncio.sleep(2.0 if attack.victim == "voice" else 0.1)  # the attack under way
        under = await measure(fleet, attack.window_s, ctx.over if attack.ends else None, attack.every_s)
        ctx.stop.set()
        try:
            outcome = Outcome(**await asyncio.to_thread(results.get, True, 240))
        except Exception:
            outcome = Outcome("attack gave no outcome (exited or timed out)", None, False)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
    return under, outcome


async def settle(fleet: AbuseFleet, voice: bool, budget_s: float = 20.0) -> str | None:
    """Until a victim request succeeds (and, for voice, the speech lanes are empty);
    past ``budget_s`` restart what is stuck. Returns what was restarted, if anything."""
    deadline = time.monotonic() + budget_s
    why = None
    while time.monotonic() < deadline:
        dead = fleet.dead()
        if dead:
            why = f"exited: {', '.join(dead)}"
            break
        a = await victim_once(fleet, min(VICTIM_TIMEOUT_S, max(1.0, deadline - time.monotonic())))
        if a.status == 200 and (not voice or await asyncio.to_thread(fleet.lane_backlog, SPEECH_MODEL) == 0):
            return None
        why = "no answer" if a.status != 200 else "speech backlog"
        await asyncio.sleep(0.5)
    names = ["gateway", "worker"] + (["speech"] if fleet.with_speech and (voice or "speech" in fleet.dead()) else [])
    await asyncio.to_thread(fleet.restart, names, why or "stalled")
    return f"{'+'.join(names)} ({why})"


def _median(answers: list[Answer]) -> float | None:
    return statistics.median(a.ms for a in answers) if answers else None


async def run_attack(fleet: AbuseFleet, attack: Attack, runs: int) -> Row:
    restarted = await settle(fleet, voice=attack.victim == "voice")
    worker_rss0 = rss_mib(family(psutil.Process(fleet.pid("worker"))))
    measure = voice_victim if attack.victim == "voice" else text_victim
    alone = await measure(fleet, runs, 60.0)
    under, outcome = await attacked(fleet, attack, lambda f, *a: measure(f, runs, *a))
    a_ms, u_ms = _median(alone), _median(under)
    ratio = u_ms / a_ms if a_ms and u_ms is not None else None
    errors = [a.label() for a in under if a.status != 200]
    unmet = []
    if ratio is None or ratio > GOAL_RATIO:
        unmet.append(f"victim {ratio:.1f}x its time alone" if ratio is not None else "victim not measured")
    if errors:
        unmet.append(f"victim errors: {', '.join(sorted(set(errors)))}")
    if attack.refusal_goal:
        if not outcome.refused:
            unmet.append("attacker not refused")
        elif outcome.refusal_ms is None or outcome.refusal_ms > GOAL_REFUSAL_MS:
            unmet.append(f"refusal after {outcome.refusal_ms or float('nan'):.0f} ms")
    if attack.idle_goal and (u_ms is None or u_ms > GOAL_IDLE_LEGIT_MS):
        unmet.append(f"legitimate request {u_ms or float('nan'):.0f} ms (goal <= {GOAL_IDLE_LEGIT_MS:.0f})")
    unmet += [name for name, ok in outcome.checks.items() if not ok]
    extra = dict(outcome.extra, checks=outcome.checks)
    if len(under) > runs:  # runs spanning an attack: their spread too
        extra.update(victim_runs_under=len(under), victim_max_ms=round(max(a.ms for a in under)))
    if "worker" not in fleet.dead() and rss_mib(family(psutil.Process(fleet.pid("worker")))) - worker_rss0 > 1024:
        # the machine is shared: a worker bloated by hostile grammars does not stay so
        await asyncio.to_thread(fleet.restart, ["worker"], f"its memory after {attack.name}")
    return Row(attack.name, a_ms, u_ms, ratio, len(under), errors, outcome.refused_with, outcome.refusal_ms,
               not unmet, unmet, extra, [round(a.ms, 1) for a in alone], [round(a.ms, 1) for a in under], restarted)


def _f(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def report(rows: list[Row], env: dict) -> str:
    out = [f"issue 36 abuse benchmark: {env['cores']} cores, Python {env['python']}, load average before "
           f"{env['load']}; one gateway (auth on), a {TEXT_MODEL} worker"
           + (f", an {SPEECH_MODEL} worker" if env["speech"] else "") + f"; median of {env['runs']} victim runs"]
    headers = ["attack", "victim alone (ms)", "victim under attack (ms)", "ratio", "victim errors",
               "attacker refused with", "time to refusal (ms)", "goal met"]
    body = [[r.attack, _f(r.alone_ms), _f(r.under_ms), "-" if r.ratio is None else f"{r.ratio:.2f}x",
             f"{len(r.victim_errors)}/{r.victim_runs}", r.refused_with[:48], _f(r.refusal_ms),
             "met" if r.goal_met else "NOT met"] for r in rows]
    out += table(headers, body)
    out.append("")
    for r in rows:
        notes = list(r.unmet)
        figures = {k: v for k, v in r.extra.items() if k != "checks" and v not in (None, {}, "")}
        line = f"  {r.attack}: " + ("; ".join(notes) if notes else "all goals met")
        if figures:
            line += " | " + ", ".join(f"{k}={v}" for k, v in figures.items())
        if r.restarted:
            line += f" | restarted before it: {r.restarted}"
        out.append(line)
    return "\n".join(out)


async def main_async(args, names: list[str], workdir: Path) -> tuple[list[Row], dict]:
    speech_needed = any(ATTACKS[n].victim == "voice" for n in names)
    fleet = AbuseFleet(workdir, speech=speech_needed)
    env = {"cores": os.cpu_count(), "python": platform.python_version(), "runs": args.runs,
           "load": " ".join(f"{x:.2f}" for x in os.getloadavg()), "speech": speech_needed}
    print(f"... starting the fleet (logs in {workdir})", flush=True)
    await asyncio.to_thread(fleet.start)
    rows: list[Row] = []
    try:
        for name in names:
            print(f"... {name}", flush=True)
            row = await run_attack(fleet, ATTACKS[name], args.runs)
            rows.append(row)
            print(f"    victim {_f(row.alone_ms)} -> {_f(row.under_ms)} ms, errors {len(row.victim_errors)}; "
                  f"attacker: {row.refused_with} after {_f(row.refusal_ms)} ms; "
                  f"{'met' if row.goal_met else 'NOT met'}", flush=True)
    finally:
        env["restarts"] = fleet.restarts
        await asyncio.to_thread(fleet.close)
    return rows, env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="attacks to run, comma-separated (default: all): "
                    + ", ".join(ATTACKS))
    ap.add_argument("--runs", type=int, default=5, help="victim runs alone and under each attack (median)")
    ap.add_argument("--json", default="", help="write the figures to this file")
    ap.add_argument("--keep-logs", action="store_true", help="keep the processes' logs (their folder is printed)")
    args = ap.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(ATTACKS)
    unknown = [n for n in names if n not in ATTACKS]
    if unknown:
        ap.error(f"unknown attack(s) {', '.join(unknown)}; known: {', '.join(ATTACKS)}")
    if any(ATTACKS[n].victim == "voice" for n in names) and (why := flite_missing()) is not None:
        ap.error(f"the voice attacks need flite: {why}")
    raise_open_files_limit(4096)  # 1,000 idle connections and the rest
    workdir = Path(tempfile.mkdtemp(prefix="sf-abuse-"))
    rows, env = asyncio.run(main_async(args, names, workdir))
    print()
    print(report(rows, env))
    if env.get("restarts"):
        print("restarts: " + "; ".join(env["restarts"]))
    if args.json:
        Path(args.json).write_text(orjson.dumps({"env": env, "results": [asdict(r) for r in rows]},
                                                option=orjson.OPT_INDENT_2).decode())
        print(f"figures written to {args.json}")
    if not args.keep_logs:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
