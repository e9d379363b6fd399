"""The HTTP doors' waits on their client (``gateway/doors/openai.py``, ``gateway/doors/responses.py``,
``gateway/doors/transcriptions.py``): a request's body, read no further than a limit, work that
ends when its client leaves, and a request not streamed read to its end."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final, TypeVar

import orjson
import structlog
from starlette.requests import ClientDisconnect, Request

from streamfleet.gateway.edge import guard
from streamfleet.gateway.requests.observe import stop_events
from streamfleet.gateway.requests.request_stream import Tick
from streamfleet.shared.errors import ErrorCode, UnavailableError, ValidationError
from streamfleet.shared.schema import DoneEvent, ErrorEvent, Event, PromptEvent, TokenEvent

if TYPE_CHECKING:
    from streamfleet.gateway.admission.auth import Identity
    from streamfleet.gateway.hub import Hub

__all__ = ["DISCONNECTED", "Disconnected", "client_host", "read_body", "open_json", "until_disconnect", "read_to_end"]

T = TypeVar("T")


class Disconnected(enum.Enum):
    """The type of ``DISCONNECTED`` (one value: ``x is DISCONNECTED`` narrows a result)."""

    DISCONNECTED = "disconnected"


#: what ``until_disconnect`` returns when the client left before the work was done
DISCONNECTED: Final = Disconnected.DISCONNECTED


def client_host(request: Request) -> str:
    """The client's address as the server saw it ("" when unknown): with auth off, the
    tenant of its requests' fair share (``ClientRequest.tenant``)."""
    return request.client.host if request.client is not None else ""


async def read_body(request: Request, limit: int) -> bytes | None:
    """The body, read at most ``limit`` bytes far: a declared or actual size past it is
    ``frame_too_large`` (413) without reading (or keeping) the rest. None when the client
    left mid-body.

    Raises:
        ValidationError: ``frame_too_large``.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ValidationError(f"body of {int(declared)} bytes exceeds the limit of {limit}",
                              code=ErrorCode.frame_too_large)
    parts: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ValidationError(f"body of more than {limit} bytes exceeds the limit of {limit}",
                                      code=ErrorCode.frame_too_large)
            parts.append(chunk)
    except ClientDisconnect:
        return None
    return b"".join(parts)


async def open_json(request: Request, hub: Hub) -> tuple[Identity | None, dict[str, Any] | None]:
    """The opening every JSON door of the OpenAI API shares, cheapest first: refused while
    the gateway drains; who is asking (its key's identity, None with auth off) before a
    byte of the body is read, so an unauthenticated body costs nothing; a key known out of
    its rate limit refused (429) before the body; then the body, read no further than
    ``SF_MAX_FRAME_BYTES``, parsed, and an object. Returns the identity and the body, or
    the identity and None when the client left mid-body (answer 499: nobody is there).

    Raises:
        StreamfleetError: draining, auth, rate limit, size, bad JSON, not an object.
    """
    if hub.draining:
        raise UnavailableError("this gateway is shutting down; retry", retry_after_ms=0, code=ErrorCode.shutting_down)
    identity = await hub.admission.authenticate(request.headers.get("authorization"))
    if identity is not None:  # every log line of this request names its key
        structlog.contextvars.bind_contextvars(key_id=identity.key_id)
        guard.authenticated(request.scope)  # off its address's count before auth (gateway/edge/guard.py)
    hub.admission.spent(identity)
    raw = await read_body(request, hub.settings.max_frame_bytes)
    if raw is None:  # the client's doing, not the gateway's: no traceback, no error log
        return identity, None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ValidationError(f"the body is not valid JSON: {exc.msg}", code=ErrorCode.invalid_json) from exc
    # before anything reads a field: valid JSON that is not an object gets the code the
    # WebSocket gives the same frame
    if not isinstance(body, dict):
        raise ValidationError("the request body must be a JSON object", code=ErrorCode.invalid_frame)
    return identity, body


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | Disconnected:
    """``work``'s result, or ``DISCONNECTED`` when the client leaves first (the work is
    cancelled, and awaited); the work's exception is raised."""
    async def disconnected() -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            return DISCONNECTED
        return task.result()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def read_to_end(request: Request, events: AsyncGenerator[Event | Tick, None],
                      on_token: Callable[[TokenEvent | PromptEvent], object]) -> DoneEvent | ErrorEvent | Disconnected:
    """A request not streamed: its events read, each token (and each ``PromptEvent`` of a
    request that asked for its prompt's log probabilities) handed to ``on_token``, until
    its end (the ``DoneEvent`` or ``ErrorEvent``, returned), or ``DISCONNECTED`` when the
    client leaves first (the read is cancelled). The events are closed either way.

    Raises:
        RuntimeError: the events broke ``RequestStream``'s promise (another event where
            the end belongs, or no end); a request not streamed has no ``tick_s``.
    """
    async def consume() -> DoneEvent | ErrorEvent:
        async for ev in events:
            if isinstance(ev, (TokenEvent, PromptEvent)):
                on_token(ev)
            elif isinstance(ev, (DoneEvent, ErrorEvent)):
                return ev
            else:
                raise RuntimeError(f"a request not streamed got {ev!r} before its end")
        raise RuntimeError("a request's events stopped before its end")

    try:
        return await until_disconnect(request, consume())
    finally:
        await stop_events(None, events)
