"""The load generator's protocol clients, one per transport `streamfleet bench` drives.

Each has ``open()``, ``close()`` and ``request(record, payload)``, which sends one
request, stamps every token's arrival on its ``RequestRecord`` (``perf_counter``
clock) and sets its end, token count or error code:

* ``_WsConn``: one WebSocket; a reader task routes frames to requests by id, so
  requests can be multiplexed on it;
* ``_SseClient``: SSE streams to ``/v1/completions`` on a pool of keep-alive HTTP/1.1
  connections (``_HttpStream``), read straight off the socket;
* ``_GrpcChannel``: one gRPC channel (its own HTTP/2 connection), one ``Generate``
  call per request.

How many of each a run opens, and what it sends, is ``streamfleet/bench.py``'s.
"""

from __future__ import annotations

import asyncio
import itertools
import ssl
import time
from urllib.parse import urlsplit

import orjson
import websockets
from grpc import aio
from websockets.asyncio.client import ClientConnection

from streamfleet.bench_config import BenchConfig
from streamfleet.bench_stats import RequestRecord
from streamfleet.client import fleet_error_code
from streamfleet.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc

__all__ = ["_GrpcChannel", "_HttpStream", "_SseClient", "_WsConn"]


class _WsConn:
    """One WebSocket; a reader task routes frames to requests by id."""

    def __init__(self, url: str, cfg: BenchConfig) -> None:
        self.url = url
        self.cfg = cfg
        self.ws: ClientConnection | None = None
        self.live: dict[str, tuple[RequestRecord, asyncio.Future[None]]] = {}
        self.reader: asyncio.Task | None = None
        self._ids = itertools.count()

    async def open(self) -> None:
        headers = {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else None
        self.ws = await websockets.connect(self.url, max_size=None, additional_headers=headers,
                                           compression="deflate" if self.cfg.compression else None,
                                           open_timeout=10, ping_interval=None)
        self.reader = asyncio.create_task(self._read())

    @property
    def socket(self) -> ClientConnection:
        """The open WebSocket (``open``)."""
        if self.ws is None:
            raise RuntimeError("the WebSocket is not open: open() first")
        return self.ws

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
            async for raw in self.socket:
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
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.live[cid] = (rec, fut)
        try:
            await self.socket.send(orjson.dumps(frame).decode())
        except websockets.ConnectionClosed:
            self.live.pop(cid, None)
            rec.error = "connection_closed"
            return
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.cfg.timeout)
        except TimeoutError:
            if self.live.pop(cid, None) is not None:
                rec.error = "timeout"
                try:
                    await self.socket.send(orjson.dumps({"type": "cancel", "id": cid}).decode())
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
        self.done: asyncio.Future[None] | None = None
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
    def start(self, rec: RequestRecord, head: bytes, body: bytes) -> asyncio.Future[None]:
        self.rec, self.state, self.status, self.chunks = rec, "head", 0, 0
        self.keep_alive, self.chunked, self.left, self.until_close = True, False, 0, False
        self.got_bytes = False
        self.buf.clear()
        self.body.clear()
        self.events.clear()
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.done = done
        if self.transport is None:
            raise RuntimeError("start() before the connection was made")
        self.transport.write(head + body)
        return done

    def _under_way(self) -> tuple[RequestRecord, asyncio.Future[None]]:
        """The request being read (``start``)."""
        if self.rec is None or self.done is None:
            raise RuntimeError("no request under way: start() one first")
        return self.rec, self.done

    def _parse(self, now: float) -> None:
        buf = self.buf
        _, done = self._under_way()
        while not done.done():
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
        rec, _ = self._under_way()
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
        rec, done = self._under_way()
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
        done.set_result(None)

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
        if self.stub is None:
            raise RuntimeError("the gRPC channel is not open: open() first")
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
