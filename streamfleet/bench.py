"""`streamfleet bench`: a load generator for a running fleet, over WebSocket, SSE or gRPC.

Each request asks for a fixed number of tokens (``ignore_eos: true``), so every run of
the same settings moves the same amount of text. Per request it records the time to
the first token (TTFT, from sending the request), the gaps between tokens (inter-token
latency, ITL) and the end-to-end time; the result has their p50/p90/p99, tokens/s,
requests/s and the errors by code.

Load shapes:

* closed loop (default): ``concurrency`` clients send their next request as soon as
  the previous one ends;
* open loop (``rate``): requests start at Poisson arrival times, ``rate`` per second on
  average, whatever is still running. Latencies count from the scheduled arrival, so a
  client that falls behind does not hide the wait (no coordinated omission).

Connections: over WebSocket, ``concurrency`` connections (a closed-loop client each;
open-loop requests round-robin over them, multiplexed by id); over SSE each request is
one HTTP stream on a pool of keep-alive connections, read straight off the socket; over
gRPC one ``Generate`` call per request, on one HTTP/2 channel per
``GRPC_CALLS_PER_CHANNEL`` of concurrency (round-robin).

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
import ssl
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TextIO
from urllib.parse import urlsplit

import httpx
import orjson
import websockets
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from streamfleet.client import PRIORITIES, default_grpc_target, fleet_error_code, urls
from streamfleet.v1 import inference_pb2 as pb
from streamfleet.v1 import inference_pb2_grpc as pb_grpc

__all__ = ["BenchConfig", "BenchResult", "Comparison", "RequestRecord", "BenchError", "run_bench", "run_comparison",
           "percentile", "summarize", "write_png"]

TRANSPORTS = ("ws", "sse", "grpc")
#: concurrent Generate calls per gRPC channel (one HTTP/2 connection each), well below
#: the gateway's SF_GRPC_MAX_CONCURRENT_STREAMS (256)
GRPC_CALLS_PER_CHANNEL = 64
#: the service the gRPC preflight asks the health service about
GRPC_SERVICE = pb.DESCRIPTOR.services_by_name["Inference"].full_name
LANES = ("high", "normal", "mixed")


class BenchError(Exception):
    """The benchmark could not run at all (bad settings, gateway unreachable)."""


@dataclass
class BenchConfig:
    """What to run. ``requests`` and ``duration`` may both be set (whichever ends
    first); with neither, 100 requests."""

    url: str = "http://127.0.0.1:8000"
    transport: str = "ws"
    #: gRPC host:port; None = the url's host, port 50051 (``run_bench`` fills it in)
    grpc_target: str | None = None
    concurrency: int = 8
    requests: int | None = None
    duration: float | None = None
    #: open loop: mean requests per second (Poisson arrivals); None = closed loop
    rate: float | None = None
    #: approximate prompt length: the word "hello" repeated (ignored when ``prompt`` is set)
    prompt_tokens: int = 32
    prompt: str | None = None
    max_tokens: int = 64
    #: high | normal | mixed (half and half, at random)
    lane: str = "normal"
    model: str | None = None
    temperature: float = 0.0
    api_key: str | None = None
    #: seconds one request may take before it counts as a ``timeout`` error
    timeout: float = 120.0
    #: requests run (closed loop, same concurrency) before measuring; not counted
    warmup: int = 0
    seed: int = 0
    #: per-message deflate on WebSockets (browsers negotiate it); off measures the fleet, not zlib
    compression: bool = False
    #: draw a progress line on stderr
    progress: bool = False

    def check(self) -> None:
        """Raises BenchError for settings that cannot run."""
        if self.transport not in TRANSPORTS:
            raise BenchError(f"transport must be one of {', '.join(TRANSPORTS)}, not {self.transport!r}")
        if self.lane not in LANES:
            raise BenchError(f"lane must be one of {', '.join(LANES)}, not {self.lane!r}")
        if self.concurrency < 1:
            raise BenchError("concurrency must be at least 1")
        if self.requests is not None and self.requests < 1:
            raise BenchError("requests must be at least 1")
        if self.duration is not None and self.duration <= 0:
            raise BenchError("duration must be > 0")
        if self.rate is not None and self.rate <= 0:
            raise BenchError("rate must be > 0")
        if self.max_tokens < 1:
            raise BenchError("max_tokens must be at least 1")
        if self.prompt is None and self.prompt_tokens < 1:
            raise BenchError("prompt_tokens must be at least 1")
        if not self.url.startswith(("http://", "https://", "ws://", "wss://")):
            raise BenchError(f"url must start with http://, https://, ws:// or wss://, not {self.url!r}")

    @property
    def total_requests(self) -> int | None:
        if self.requests is None and self.duration is None:
            return 100
        return self.requests

    def prompt_text(self) -> str:
        return self.prompt if self.prompt is not None else " ".join(["hello"] * self.prompt_tokens)

    def describe(self) -> str:
        """The load in words: mode, prompt, tokens per request, lane."""
        c = self
        mode = f"open loop at {c.rate:g} req/s" if c.rate else f"closed loop, concurrency {c.concurrency}"
        prompt = f"prompt {len(c.prompt)} chars" if c.prompt is not None else f"prompt ~{c.prompt_tokens} tokens"
        return f"{mode}, {prompt}, {c.max_tokens} max tokens, lane {c.lane}"


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it (times in seconds, ``perf_counter`` clock)."""

    lane: str
    start: float
    end: float | None = None
    #: arrival time of every token (WebSocket, gRPC: each token frame; SSE: each chunk with text)
    token_times: list[float] = field(default_factory=list)
    #: completion tokens the server reported (``usage``), else the token frames counted
    tokens: int = 0
    error: str | None = None
    #: the streamed text, kept for the run's first request only (shown as its sample)
    text: list[str] | None = None

    @property
    def first(self) -> float | None:
        """When the first token arrived."""
        return self.token_times[0] if self.token_times else None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    @property
    def ttft_ms(self) -> float | None:
        return (self.first - self.start) * 1000 if self.first is not None else None

    @property
    def e2e_ms(self) -> float | None:
        return (self.end - self.start) * 1000 if self.end is not None else None

    def itl_ms(self) -> list[float]:
        t = self.token_times
        return [(b - a) * 1000 for a, b in zip(t, t[1:])]


def percentile(values: list[float], p: float) -> float | None:
    """Linear-interpolated percentile (numpy's default) of ``values``; None when empty."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(values: list[float]) -> dict[str, float | int | None]:
    """count, mean, min, p50, p90, p99, max of ``values``."""
    if not values:
        return {"count": 0, "mean": None, "min": None, "p50": None, "p90": None, "p99": None, "max": None}
    return {"count": len(values), "mean": sum(values) / len(values), "min": min(values),
            "p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99),
            "max": max(values)}


@dataclass
class BenchResult:
    config: BenchConfig
    records: list[RequestRecord]
    wall_s: float

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.ok]

    @property
    def errors(self) -> dict[str, int]:
        return dict(Counter(r.error for r in self.records if r.error is not None))

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.records)

    def ttft_ms(self) -> list[float]:
        return [r.ttft_ms for r in self.ok if r.ttft_ms is not None]

    def itl_ms(self) -> list[float]:
        return [x for r in self.ok for x in r.itl_ms()]

    def e2e_ms(self) -> list[float]:
        return [r.e2e_ms for r in self.ok]

    def sample(self) -> str | None:
        """The text the first request streamed (None when it kept none)."""
        first = self.records[0] if self.records else None
        return "".join(first.text) if first is not None and first.text is not None else None

    def to_dict(self) -> dict[str, Any]:
        ok = len(self.ok)
        wall = max(self.wall_s, 1e-9)
        cfg = asdict(self.config)
        cfg.pop("api_key", None)
        cfg["api_key_set"] = self.config.api_key is not None
        if self.config.transport != "grpc":
            del cfg["grpc_target"]
        cfg["mode"] = "open" if self.config.rate else "closed"
        return {
            "config": cfg,
            "requests": {"total": len(self.records), "ok": ok, "failed": len(self.records) - ok},
            "errors": self.errors,
            "tokens": self.tokens,
            "wall_s": self.wall_s,
            "tokens_per_s": self.tokens / wall,
            "requests_per_s": ok / wall,
            "ttft_ms": summarize(self.ttft_ms()),
            "itl_ms": summarize(self.itl_ms()),
            "e2e_ms": summarize(self.e2e_ms()),
            "sample": self.sample(),
        }

    def render(self) -> str:
        d = self.to_dict()
        c = self.config
        lines = [
            f"streamfleet bench: {c.transport} -> {c.grpc_target if c.transport == 'grpc' else c.url}",
            f"  {c.describe()}",
            f"  requests  {d['requests']['ok']} ok, {d['requests']['failed']} failed in {d['wall_s']:.2f} s"
            f"  ({d['requests_per_s']:.1f} req/s)",
            f"  tokens    {d['tokens']} completion tokens  ({d['tokens_per_s']:.1f} tokens/s)",
            "",
            f"  {'':10}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}{'max':>10}   (ms)",
        ]
        for name, key in (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
            s = d[key]
            cells = "".join(f"{s[k]:10.1f}" if s[k] is not None else f"{'-':>10}"
                            for k in ("p50", "p90", "p99", "mean", "max"))
            lines.append(f"  {name:10}{cells}")
        errs = d["errors"]
        lines.append("")
        lines.append("  errors    " + (", ".join(f"{k}: {v}" for k, v in sorted(errs.items())) if errs else "none"))
        if d["sample"]:
            text = d["sample"].replace("\n", " ")
            lines.append(f"  sample    {text[:100]!r}{'…' if len(text) > 100 else ''}  (the first request's text)")
        return "\n".join(lines)


# -- transports ------------------------------------------------------------------------

class _WsConn:
    """One WebSocket; a reader task routes frames to requests by id."""

    def __init__(self, url: str, cfg: BenchConfig) -> None:
        self.url = url
        self.cfg = cfg
        self.ws = None
        self.live: dict[str, tuple[RequestRecord, asyncio.Future]] = {}
        self.reader: asyncio.Task | None = None
        self._ids = itertools.count()

    async def open(self) -> None:
        headers = {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else None
        self.ws = await websockets.connect(self.url, max_size=None, additional_headers=headers,
                                           compression="deflate" if self.cfg.compression else None,
                                           open_timeout=10, ping_interval=None)
        self.reader = asyncio.create_task(self._read())

    async def close(self) -> None:
        if self.ws is not None:
            try:
                await self.ws.close()
            except Exception:
                pass
        if self.reader is not None:
            self.reader.cancel()
            try:
                await self.reader
            except BaseException:
                pass

    def _fail_all(self, code: str) -> None:
        for rec, fut in self.live.values():
            if rec.error is None:
                rec.error = code
            if not fut.done():
                fut.set_result(None)
        self.live.clear()

    async def _read(self) -> None:
        loads, perf = orjson.loads, time.perf_counter
        try:
            async for raw in self.ws:
                now = perf()
                msg = loads(raw)
                item = self.live.get(msg.get("id"))
                if item is None:
                    continue
                rec, fut = item
                kind = msg.get("type")
                if kind == "token":
                    rec.token_times.append(now)
                    if rec.text is not None:
                        rec.text.append(msg.get("text") or "")
                elif kind == "done":
                    rec.end = now
                    usage = msg.get("usage") or {}
                    rec.tokens = int(usage.get("completion_tokens", len(rec.token_times)))
                    del self.live[msg["id"]]
                    fut.set_result(None)
                elif kind == "error":
                    rec.error = str(msg.get("code") or "error")
                    rec.end = now
                    rec.tokens = len(rec.token_times)
                    del self.live[msg["id"]]
                    fut.set_result(None)
            self._fail_all("connection_closed")
        except websockets.ConnectionClosed:
            self._fail_all("connection_closed")
        except Exception:
            self._fail_all("client_error")
            raise

    async def request(self, rec: RequestRecord, frame: dict) -> None:
        cid = f"b{next(self._ids)}"
        frame["id"] = cid
        fut = asyncio.get_running_loop().create_future()
        self.live[cid] = (rec, fut)
        try:
            await self.ws.send(orjson.dumps(frame).decode())
        except websockets.ConnectionClosed:
            self.live.pop(cid, None)
            rec.error = "connection_closed"
            return
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.cfg.timeout)
        except asyncio.TimeoutError:
            if self.live.pop(cid, None) is not None:
                rec.error = "timeout"
                try:
                    await self.ws.send(orjson.dumps({"type": "cancel", "id": cid}).decode())
                except websockets.ConnectionClosed:
                    pass


class _HttpStream(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection of ``_SseClient``, reading one streamed
    response at a time straight from the socket (no reader task, no line iterator): each
    read is parsed in ``data_received`` and every SSE event in it is stamped with the
    read's arrival time. It parses what a streaming server sends (a status line, headers,
    then a chunked or ``Content-Length`` body) and nothing more."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.got_bytes = False
        self.buf = bytearray()
        self.rec: RequestRecord | None = None
        self.done: asyncio.Future | None = None
        self.state = "head"
        self.status = 0
        self.keep_alive = True
        self.chunked = False
        self.left = 0  # body bytes still due (Content-Length), or the current chunk's
        self.until_close = False  # neither: the body ends when the server closes
        self.body = bytearray()  # an error response's body
        self.events = bytearray()  # SSE text not yet split into events
        self.chunks = 0

    # -- asyncio.Protocol ---------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.done is not None and not self.done.done():
            if self.until_close and exc is None:
                self._finish()
            else:
                self.done.set_exception(ConnectionError("the server closed the connection"))

    def data_received(self, data: bytes) -> None:
        if self.done is None or self.done.done():
            return  # nothing asked for: a stray byte after a response ends
        self.got_bytes = True
        self.buf += data
        try:
            self._parse(time.perf_counter())
        except (ValueError, IndexError) as exc:
            self.keep_alive = False
            self.done.set_exception(ConnectionError(f"malformed response: {exc}"))

    # -- one request ----------------------------------------------------------------------
    def start(self, rec: RequestRecord, head: bytes, body: bytes) -> asyncio.Future:
        self.rec, self.state, self.status, self.chunks = rec, "head", 0, 0
        self.keep_alive, self.chunked, self.left, self.until_close = True, False, 0, False
        self.got_bytes = False
        self.buf.clear()
        self.body.clear()
        self.events.clear()
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(head + body)
        return self.done

    def _parse(self, now: float) -> None:
        buf = self.buf
        while not self.done.done():
            if self.state == "head":
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                lines = bytes(buf[:end]).split(b"\r\n")
                del buf[:end + 4]
                self.status = int(lines[0].split(b" ", 2)[1])
                length = None
                for line in lines[1:]:
                    name, _, value = line.partition(b":")
                    name, value = name.strip().lower(), value.strip().lower()
                    if name == b"content-length":
                        length = int(value)
                    elif name == b"transfer-encoding":
                        self.chunked = b"chunked" in value
                    elif name == b"connection":
                        self.keep_alive = value != b"close"
                if self.chunked:
                    self.state = "size"
                elif length is not None:
                    self.state, self.left = "data", length
                else:  # the body runs to the end of the connection
                    self.state, self.left, self.keep_alive, self.until_close = "data", 1 << 62, False, True
            elif self.state == "size":
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                size = int(bytes(buf[:end]).split(b";", 1)[0], 16)
                del buf[:end + 2]
                if size == 0:
                    self.state = "trailer"
                else:
                    self.state, self.left = "data", size
            elif self.state == "data":
                if not buf:
                    return
                take = buf[:self.left]
                del buf[:len(take)]
                self.left -= len(take)
                self._body(take, now)
                if self.left == 0:
                    if self.chunked:
                        self.state = "crlf"
                    else:
                        self._finish()
            elif self.state == "crlf":
                if len(buf) < 2:
                    return
                del buf[:2]
                self.state = "size"
            else:  # "trailer": none expected; the body ends with an empty line
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                del buf[:end + 2]
                if end == 0:
                    self._finish()

    def _body(self, data: bytearray, now: float) -> None:
        if self.status != 200:
            self.body += data
            return
        self.events += data
        ev = self.events
        rec = self.rec
        while (end := ev.find(b"\n\n")) >= 0:
            block = bytes(ev[:end])
            del ev[:end + 2]
            for line in block.split(b"\n"):
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:]
                if payload == b"[DONE]":
                    rec.end = now
                    continue
                chunk = orjson.loads(payload)
                if "error" in chunk:
                    rec.error = str((chunk["error"] or {}).get("code") or "error")
                    continue
                for choice in chunk.get("choices") or ():
                    if choice.get("text"):
                        self.chunks += 1
                        rec.token_times.append(now)
                        if rec.text is not None:
                            rec.text.append(choice["text"])
                if chunk.get("usage"):
                    rec.tokens = int(chunk["usage"].get("completion_tokens", self.chunks))

    def _finish(self) -> None:
        rec = self.rec
        if self.status != 200:
            try:
                rec.error = str(orjson.loads(bytes(self.body))["error"]["code"])
            except (orjson.JSONDecodeError, KeyError, TypeError):
                rec.error = f"http_{self.status}"
        else:
            if rec.end is None and rec.error is None:
                rec.error = "stream_truncated"
            if not rec.tokens:
                rec.tokens = self.chunks
        self.state = "done"
        self.done.set_result(None)

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True


class _SseClient:
    """SSE streams to /v1/completions over a pool of keep-alive HTTP/1.1 connections,
    one request at a time on each (as an HTTP client library would pool them), read by
    ``_HttpStream``: per token, one parse of the chunk and a timestamp, so the client's
    own CPU stays small next to the server's (its cost is printed by the benchmarks)."""

    def __init__(self, base: str, cfg: BenchConfig) -> None:
        self.base = base
        self.cfg = cfg
        parts = urlsplit(base)
        self.tls = parts.scheme == "https"
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = parts.path.rstrip("/")
        self.idle: list[_HttpStream] = []
        self.all: set[_HttpStream] = set()

    async def open(self) -> None:  # connections open as requests need them
        conn = await self._connect()
        self.idle.append(conn)

    async def close(self) -> None:
        for conn in self.all:
            conn.close()
        self.all.clear()
        self.idle.clear()

    async def _connect(self) -> _HttpStream:
        loop = asyncio.get_running_loop()
        ctx = ssl.create_default_context() if self.tls else None
        async with asyncio.timeout(10.0):
            _, conn = await loop.create_connection(_HttpStream, self.host, self.port, ssl=ctx)
        self.all.add(conn)
        return conn

    def _idle(self) -> _HttpStream | None:
        """A kept-alive connection still open, or None."""
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                return conn
        return None

    def _head(self, rec: RequestRecord, body: bytes) -> bytes:
        lines = [f"POST {self.prefix}/v1/completions HTTP/1.1", f"Host: {self.host}:{self.port}",
                 "Content-Type: application/json", "Accept: text/event-stream",
                 f"Content-Length: {len(body)}", f"X-Priority: {rec.lane}"]
        if self.cfg.api_key:
            lines.append(f"Authorization: Bearer {self.cfg.api_key}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    async def request(self, rec: RequestRecord, body: dict) -> None:
        raw = orjson.dumps(body)
        head = self._head(rec, raw)
        conn: _HttpStream | None = None
        try:
            async with asyncio.timeout(self.cfg.timeout):
                for attempt in range(2):
                    conn = self._idle()
                    reused = conn is not None
                    if conn is None:
                        conn = await self._connect()
                    try:
                        await conn.start(rec, head, raw)
                        break
                    except ConnectionError:
                        # a kept-alive connection the server had closed before reading this
                        # request: once more on a fresh one
                        if reused and not conn.got_bytes and attempt == 0:
                            conn.close()
                            self.all.discard(conn)
                            continue
                        raise
        except TimeoutError:
            rec.error = "timeout"
        except (ConnectionError, OSError):
            rec.error = rec.error or "connection_error"
        finally:
            if conn is not None:
                if conn.state == "done" and conn.keep_alive and not conn.closed:
                    self.idle.append(conn)
                else:
                    conn.close()
                    self.all.discard(conn)
        if rec.end is None:
            rec.end = time.perf_counter()


class _GrpcChannel:
    """One gRPC channel (its own HTTP/2 connection); one ``Generate`` call per request."""

    def __init__(self, target: str, cfg: BenchConfig) -> None:
        self.target = target
        self.cfg = cfg
        self.channel: aio.Channel | None = None
        self.stub: pb_grpc.InferenceStub | None = None
        self.metadata = (("authorization", f"Bearer {cfg.api_key}"),) if cfg.api_key else None

    async def open(self) -> None:
        # a local subchannel pool: channels to the same target share one connection otherwise
        self.channel = aio.insecure_channel(self.target, options=[("grpc.use_local_subchannel_pool", 1)])
        await asyncio.wait_for(self.channel.channel_ready(), 10)
        self.stub = pb_grpc.InferenceStub(self.channel)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()

    async def request(self, rec: RequestRecord, message: pb.GenerateRequest) -> None:
        perf = time.perf_counter
        call = self.stub.Generate(message, metadata=self.metadata)
        try:
            async with asyncio.timeout(self.cfg.timeout):
                async for event in call:
                    now = perf()
                    kind = event.WhichOneof("event")
                    if kind == "token":
                        rec.token_times.append(now)
                        if rec.text is not None:
                            rec.text.append(event.token.text)
                    elif kind == "done":
                        rec.end = now
                        rec.tokens = event.done.usage.completion_tokens
        except TimeoutError:
            rec.error = "timeout"  # the read was cancelled, and with it the call
        except aio.AioRpcError as exc:
            rec.error = fleet_error_code(exc) or exc.code().name
            rec.end = perf()
            rec.tokens = len(rec.token_times)
        if rec.end is None and rec.error is None:
            rec.error = "stream_truncated"  # the call ended OK without its Done


# -- the run -----------------------------------------------------------------------------

_Conn = _WsConn | _SseClient | _GrpcChannel


class _Run:
    def __init__(self, cfg: BenchConfig, ws_url: str, base: str, on_start=None) -> None:
        self.cfg = cfg
        self.on_start = on_start
        self.ws_url = ws_url
        self.base = base
        #: a request's payload in the transport's form: ``(number, lane) -> payload``
        self.payload = {"ws": self._frame, "sse": self._body, "grpc": self._message}[cfg.transport]
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
            n = math.ceil(c.concurrency / GRPC_CALLS_PER_CHANNEL)
            return [_GrpcChannel(c.grpc_target, c) for _ in range(n)], c.grpc_target
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
        await conn.request(rec, self.payload(i, lane))
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
                    await self._open(conns, deadline)
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

    async def _open(self, conns: list[_Conn], deadline: float | None) -> None:
        limit = self.cfg.total_requests
        tasks: set[asyncio.Task] = set()
        arrival = self.t0
        k = 0
        while True:
            arrival += self.rng.expovariate(self.cfg.rate)
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
        filled = int(round(frac * width))
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
    if grpc:
        config = replace(config, grpc_target=config.grpc_target or default_grpc_target(config.url))
    if preflight:
        note = await (_grpc_preflight(config.grpc_target) if grpc else _preflight(config, ws_url, base))
        if note and warn is not None:
            print(f"warning: {note}", file=warn)
    return config, ws_url, base


@dataclass
class Comparison:
    """The same load over several transports, one after another."""

    results: list[BenchResult]

    @property
    def baseline(self) -> BenchResult:
        """The run the ratios divide by: the WebSocket's, else the first."""
        return next((r for r in self.results if r.config.transport == "ws"), self.results[0])

    @staticmethod
    def _figures(result: BenchResult) -> dict[str, float | None]:
        ttft = result.ttft_ms()
        return {"ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
                "itl_p50_ms": percentile(result.itl_ms(), 50),
                "tokens_per_s": result.tokens / max(result.wall_s, 1e-9)}

    def to_dict(self) -> dict[str, Any]:
        base = self._figures(self.baseline)
        table = []
        for r in self.results:
            figures = self._figures(r)
            ratios = {k: (v / base[k] if v is not None and base[k] else None) for k, v in figures.items()}
            table.append({"transport": r.config.transport, "ok": len(r.ok), "failed": len(r.records) - len(r.ok),
                          **figures, "ratios": ratios})
        return {"baseline": self.baseline.config.transport, "table": table, "runs": [r.to_dict() for r in self.results]}

    #: the table's columns: heading, key of a row of ``to_dict()["table"]``
    FIGURES = (("TTFT p50", "ttft_p50_ms"), ("TTFT p99", "ttft_p99_ms"), ("ITL p50", "itl_p50_ms"),
               ("tokens/s", "tokens_per_s"))
    RATIOS = (("TTFT p50", "ttft_p50_ms"), ("TTFT p99", "ttft_p99_ms"), ("tokens/s", "tokens_per_s"))

    def render(self) -> str:
        d = self.to_dict()
        c = self.results[0].config
        names = ", ".join(r.config.transport for r in self.results)
        where = c.url + "".join(f", gRPC {r.config.grpc_target}" for r in self.results if r.config.transport == "grpc")
        columns = self.FIGURES + self.RATIOS
        lines = [
            f"streamfleet bench: {names} -> {where}",
            f"  {c.describe()}; the transports one after another",
            "",
            f"  {'':{24 + 10 * len(self.FIGURES)}}{'ratio to ' + d['baseline']:^{10 * len(self.RATIOS)}}".rstrip(),
            f"  {'transport':10}{'ok':>6}{'failed':>8}" + "".join(f"{heading:>10}" for heading, _ in columns),
        ]

        def cell(v: float | None, fmt: str) -> str:
            return f"{v:10{fmt}}" if v is not None else f"{'-':>10}"

        for row in d["table"]:
            lines.append(f"  {row['transport']:10}{row['ok']:6d}{row['failed']:8d}"
                         + "".join(cell(row[key], ".1f") for _, key in self.FIGURES)
                         + "".join(cell(row["ratios"][key], ".2f") for _, key in self.RATIOS))
        lines += ["", "  (ms; a ratio above 1 is a slower TTFT, or more tokens/s)"]
        errors = {f"{r.config.transport} {k}": v for r in self.results for k, v in r.errors.items()}
        lines.append("  errors    " + (", ".join(f"{k}: {v}" for k, v in sorted(errors.items())) if errors else "none"))
        return "\n".join(lines)


async def run_comparison(configs: Sequence[BenchConfig], *, preflight: bool = True,
                         warn: TextIO | None = sys.stderr) -> Comparison:
    """``run_bench`` for each config in turn (the same load over different transports);
    every config is checked, and every gateway asked, before the first run starts.

    Raises:
        BenchError: bad settings, or a gateway cannot be reached.
    """
    runs = [await _prepare(config, preflight, warn) for config in configs]
    return Comparison([await _Run(*run).run() for run in runs])


def write_png(results: BenchResult | Sequence[BenchResult], path: str) -> str | None:
    """Plot the latency distributions (CDFs of TTFT, ITL, E2E) of one run, or of several
    runs (a comparison) on the same axes, to ``path``; returns an error message instead
    when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed, so no plot was written (pip install matplotlib)"
    runs = [results] if isinstance(results, BenchResult) else list(results)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (name, series) in zip(axes, (("TTFT", BenchResult.ttft_ms), ("inter-token latency", BenchResult.itl_ms),
                                         ("end-to-end", BenchResult.e2e_ms))):
        counts = []
        for result in runs:
            values = series(result)
            counts.append(str(len(values)))
            if not values:
                continue
            s = sorted(values)
            ys = [(i + 1) / len(s) for i in range(len(s))]
            p50, p99 = percentile(s, 50), percentile(s, 99)
            if len(runs) == 1:
                ax.plot(s, ys, drawstyle="steps-post")
                for p, v, style in ((50, p50, ":"), (99, p99, "--")):
                    ax.axvline(v, linestyle=style, color="grey")
                    ax.text(v, 0.02 + (0.1 if p == 99 else 0), f" p{p} {v:.1f}", fontsize=8)
            else:
                ax.plot(s, ys, drawstyle="steps-post", label=f"{result.config.transport}: p50 {p50:.1f}, p99 {p99:.1f}")
        if len(runs) > 1:
            ax.legend(fontsize=8)
        ax.set_title(f"{name} ({'/'.join(counts)} samples)")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction ≤ x")
        ax.grid(alpha=0.3)
    c = runs[0].config
    fig.suptitle(f"streamfleet bench: {', '.join(r.config.transport for r in runs)}, concurrency {c.concurrency}"
                 + (f", {c.rate:g} req/s" if c.rate else "") + f", {c.max_tokens} tokens/request")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
