"""The gateway's pub/sub connection: a socket read by an ``asyncio.Protocol``.

Every token a gateway delivers arrives as one pub/sub message, so this is the busiest
code path in the process. redis-py's ``PubSub.get_message`` costs a coroutine, a timeout
context, a health check and a dict per message; here the socket's bytes go straight to
hiredis in ``data_received`` and each parsed message is handed to
``on_message(channel, data)`` synchronously (docs/status.md has the figures). The rest
of the gateway's Redis traffic (enqueue, cancels, logs) stays on redis-py.

The connection speaks RESP2 and knows what a pub/sub-only client needs: AUTH (user and
password from the URL), TLS (``rediss://``), unix sockets, SUBSCRIBE with its
acknowledgement, UNSUBSCRIBE, PING. It does not reconnect by itself: ``lost`` resolves
when the socket is gone and the owner (``gateway.broker.Broker``) opens a new one.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from typing import Callable

import hiredis
from redis.asyncio.connection import parse_url
from redis.exceptions import AuthenticationError, ConnectionError as RedisConnectionError, ResponseError

from streamfleet.shared.redis import pack

__all__ = ["PubSubConnection", "open_pubsub", "pack"]

OnMessage = Callable[[bytes, bytes], None]

_PUSH_KINDS = frozenset((b"message", b"subscribe", b"unsubscribe", b"pmessage", b"psubscribe",
                         b"punsubscribe", b"pong"))


class PubSubConnection(asyncio.Protocol):
    """One subscriber socket. ``on_message(channel, data)`` runs inside ``data_received``:
    it must be quick and must not raise (what it raises is logged by the caller's
    wrapper, never here)."""

    def __init__(self, on_message: OnMessage) -> None:
        self.on_message = on_message
        self.transport: asyncio.Transport | None = None
        self._reader = hiredis.Reader(replyError=ResponseError)
        self._replies: deque[asyncio.Future] = deque()  # plain command replies (AUTH), in order
        self._acks: dict[bytes, list[asyncio.Future]] = {}  # channel -> SUBSCRIBE acknowledgements
        self._pongs: deque[asyncio.Future] = deque()
        loop = asyncio.get_running_loop()
        self.lost: asyncio.Future = loop.create_future()  # result: the exception, or None

    # -- asyncio.Protocol ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        try:
            while True:
                reply = reader.gets()
                if reply is False:
                    return
                if type(reply) is list and reply and reply[0] in _PUSH_KINDS:
                    kind = reply[0]
                    if kind == b"message":
                        self.on_message(reply[1], reply[2])
                    elif kind == b"subscribe":
                        for fut in self._acks.pop(reply[1], ()):
                            if not fut.done():
                                fut.set_result(None)
                    elif kind == b"pong":
                        if self._pongs:
                            fut = self._pongs.popleft()
                            if not fut.done():
                                fut.set_result(None)
                    continue
                if reply == b"PONG" and self._pongs and not self._replies:  # PING before any SUBSCRIBE
                    fut = self._pongs.popleft()
                    if not fut.done():
                        fut.set_result(None)
                elif self._replies:  # AUTH and other commands sent before subscribing
                    fut = self._replies.popleft()
                    if not fut.done():
                        if isinstance(reply, ResponseError):
                            fut.set_exception(reply)
                        else:
                            fut.set_result(reply)
                elif isinstance(reply, ResponseError):  # a refused SUBSCRIBE or PING (NOAUTH, ACL)
                    self._refused(reply)
        except hiredis.ProtocolError as exc:
            self._fail(RedisConnectionError(f"pub/sub protocol error: {exc}"))
            if self.transport is not None:
                self.transport.abort()

    def _refused(self, error: ResponseError) -> None:
        waiting = [*self._pongs, *(f for fs in self._acks.values() for f in fs)]
        self._pongs.clear()
        self._acks.clear()
        for fut in waiting:
            if not fut.done():
                fut.set_exception(error)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RedisConnectionError(f"pub/sub connection lost: {exc}" if exc else "pub/sub connection closed"))

    def _fail(self, exc: Exception) -> None:
        waiting = [*self._replies, *self._pongs, *(f for fs in self._acks.values() for f in fs)]
        self._replies.clear()
        self._pongs.clear()
        self._acks.clear()
        for fut in waiting:
            if not fut.done():
                fut.set_exception(exc)
        if not self.lost.done():
            self.lost.set_result(exc)

    # -- commands --------------------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        return self.transport is not None and not self.lost.done()

    def _write(self, data: bytes) -> None:
        if not self.is_open:
            raise RedisConnectionError("pub/sub connection is closed")
        self.transport.write(data)

    async def command(self, *args: bytes | str | int, timeout: float) -> object:
        """A command answered by a plain reply (only before the first SUBSCRIBE)."""
        fut = asyncio.get_running_loop().create_future()
        self._replies.append(fut)
        self._write(pack(*args))
        return await asyncio.wait_for(fut, timeout)

    async def subscribe(self, *channels: str | bytes, timeout: float) -> None:
        """SUBSCRIBE and wait until Redis acknowledged every channel: a message published
        after this returns reaches this connection."""
        if not channels:
            return
        loop = asyncio.get_running_loop()
        futs = []
        for ch in channels:
            key = ch.encode() if isinstance(ch, str) else ch
            fut = loop.create_future()
            self._acks.setdefault(key, []).append(fut)
            futs.append(fut)
        self._write(pack(b"SUBSCRIBE", *channels))
        await asyncio.wait_for(asyncio.gather(*futs), timeout)

    def unsubscribe(self, *channels: str | bytes) -> None:
        """UNSUBSCRIBE without waiting (messages already in flight are dropped by the owner)."""
        if channels and self.is_open:
            self.transport.write(pack(b"UNSUBSCRIBE", *channels))

    async def ping(self, timeout: float) -> None:
        """PING in subscribed mode; raises if no PONG within ``timeout``."""
        fut = asyncio.get_running_loop().create_future()
        self._pongs.append(fut)
        self._write(pack(b"PING"))
        await asyncio.wait_for(fut, timeout)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _ssl_context(params: dict) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=params.get("ssl_ca_certs"))
    reqs = params.get("ssl_cert_reqs")
    if isinstance(reqs, str):
        reqs = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}.get(reqs.lower())
    if reqs == ssl.CERT_NONE:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if params.get("ssl_certfile"):
        ctx.load_cert_chain(params["ssl_certfile"], params.get("ssl_keyfile"))
    return ctx


async def open_pubsub(url: str, on_message: OnMessage, *, timeout: float = 5.0,
                      client_name: str | None = None) -> PubSubConnection:
    """Connect (and authenticate) a subscriber socket to the Redis at ``url``.

    Raises:
        redis.exceptions.ConnectionError: unreachable, refused, or authentication failed.
    """
    params = parse_url(url)
    loop = asyncio.get_running_loop()
    proto = PubSubConnection(on_message)
    try:
        if params.get("path"):
            await asyncio.wait_for(loop.create_unix_connection(lambda: proto, params["path"]), timeout)
        else:
            tls = None
            conn_class = params.get("connection_class")
            if conn_class is not None and "SSL" in conn_class.__name__:
                tls = _ssl_context(params)
            await asyncio.wait_for(loop.create_connection(lambda: proto, params.get("host", "localhost"),
                                                          int(params.get("port", 6379)), ssl=tls), timeout)
    except (OSError, asyncio.TimeoutError, ssl.SSLError) as exc:
        raise RedisConnectionError(f"cannot connect to Redis for pub/sub: {exc}") from exc
    try:
        password = params.get("password")
        if password is not None:
            username = params.get("username")
            auth = ("AUTH", username, password) if username else ("AUTH", password)  # parse_url unquoted them
            await proto.command(*auth, timeout=timeout)
        if client_name:
            try:  # a name for CLIENT LIST; an ACL user without client|setname still gets its socket
                await proto.command("CLIENT", "SETNAME", client_name, timeout=timeout)
            except ResponseError as exc:
                if "NOAUTH" in str(exc):
                    raise
    except ResponseError as exc:
        proto.close()
        if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc) or "invalid" in str(exc).lower():
            raise AuthenticationError(f"Redis refused the pub/sub connection's credentials: {exc}") from exc
        raise RedisConnectionError(f"Redis refused the pub/sub connection: {exc}") from exc
    except asyncio.TimeoutError as exc:
        proto.close()
        raise RedisConnectionError("Redis did not answer the pub/sub handshake") from exc
    return proto
