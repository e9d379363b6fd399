"""The Redis wire, below every socket this package opens itself: RESP encoding
(``pack``), the cluster slot of a key or sharded channel (``slot_of``), and opening an
``asyncio.Protocol`` socket to Redis as redis-py's URL keywords say (``open_socket``:
TCP, unix socket or TLS, AUTH, CLIENT SETNAME). Used by the pub/sub sockets
(``shared.pubsub``), the pipelined command socket (``shared.command_socket``) and the
redis-py layer (``shared.redis``)."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping
from typing import Any

from redis.crc import key_slot
from redis.exceptions import AuthenticationError, ConnectionError as RedisConnectionError, ResponseError

__all__ = ["pack", "slot_of", "open_socket", "fail_all"]


def pack(*args: bytes | str | int) -> bytes:
    """One command in RESP."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        if isinstance(a, str):
            a = a.encode()
        elif isinstance(a, int):
            a = b"%d" % a
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def slot_of(key: bytes | str) -> int:
    """The cluster hash slot of a key or sharded channel (its ``{tag}`` if it has one)."""
    return key_slot(key.encode() if isinstance(key, str) else key)


def fail_all(waiting: list[asyncio.Future[Any]], exc: Exception, lost: asyncio.Future[Exception | None]) -> None:
    """A socket is gone: every reply still awaited fails with ``exc``, and ``lost`` says so."""
    for fut in waiting:
        if not fut.done():
            fut.set_exception(exc)
    if not lost.done():
        lost.set_result(exc)


def _ssl_context(params: Mapping[str, Any]) -> ssl.SSLContext:
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


class RedisSocket(asyncio.Protocol):
    """What ``open_socket`` opens: a protocol that sends one command and awaits its reply,
    and closes (``shared.pubsub.PubSubConnection``, ``shared.command_socket.CommandConnection``)."""

    async def command(self, *args: bytes | str | int, timeout: float) -> object:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


async def open_socket(params: Mapping[str, Any], proto: RedisSocket, timeout: float,
                   client_name: str | None, what: str) -> None:
    """Open ``proto``'s socket (an ``asyncio.Protocol`` with an awaitable
    ``command(*args, timeout=)`` and ``close()``) as ``params`` say (redis-py's connection keywords: host and
    port or a unix ``path``, TLS by ``connection_class``, credentials), authenticate and
    name it."""
    loop = asyncio.get_running_loop()
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
    except (TimeoutError, OSError, ssl.SSLError) as exc:
        raise RedisConnectionError(f"cannot connect to Redis for {what}: {exc}") from exc
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
    except (ResponseError, AuthenticationError) as exc:
        proto.close()
        refused = str(exc)
        if isinstance(exc, AuthenticationError) or "NOAUTH" in refused or "WRONGPASS" in refused \
                or "invalid" in refused.lower():
            raise AuthenticationError(f"Redis refused the {what} connection's credentials: {exc}") from exc
        raise RedisConnectionError(f"Redis refused the {what} connection: {exc}") from exc
    except TimeoutError as exc:
        proto.close()
        raise RedisConnectionError(f"Redis did not answer the {what} handshake") from exc
