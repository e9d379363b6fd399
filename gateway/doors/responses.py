"""The OpenAI Responses API: ``POST /v1/responses`` (streamed as typed SSE events or
not), ``GET /v1/responses/{id}`` and ``DELETE /v1/responses/{id}`` (docs/openai.md,
"The Responses API").

A Responses body becomes a chat completions body (``gateway/protocols/responses_mapping.py``) and
takes the chat door's path from there: ``request_payload``, ``Validator.check``, one
``ClientRequest`` made by ``Hub.request`` (admission, rate limit, lanes, deadline, the
client leaving), so the same request is admitted and refused as it would be on
``/v1/chat/completions``. This module does the I/O: the body (read as the chat door reads
it), the stored responses in Redis, the response or its event stream.

Stored responses (``store``, true by default): the finished response and the conversation
up to it, as a ``StoredResponse`` under ``sf:resp:{response_id}`` for
``SF_RESPONSES_TTL_S``, written before the client gets the response's end (so that a
``previous_response_id`` sent right after finds it, on any gateway). A response belongs
to its tenant as a request does (``RequestRecord.owner``: the API key; with auth off,
whoever has its id): another tenant's ``GET``, ``DELETE`` or ``previous_response_id`` is
404 as if it did not exist.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from streamfleet.gateway.admission.gate import owner_of
from streamfleet.gateway.edge.httpbody import DISCONNECTED, client_host, open_json, read_to_end
from streamfleet.gateway.edge.httperror import openai_error_response
from streamfleet.gateway.protocols.openai_mapping import ResponseShape, request_payload
from streamfleet.gateway.protocols.responses_mapping import (
    RESPONSE_ID,
    ResponseEvents,
    ResponsesRequest,
    chat_body,
    output_as_input,
    parse_request,
    renamed,
)
from streamfleet.gateway.protocols.sse import KEEPALIVE, SSE_HEADERS, sse_frame
from streamfleet.gateway.requests.lifecycle import ClientRequest, Events
from streamfleet.gateway.requests.observe import stop_events, trace_id_from
from streamfleet.gateway.requests.request_stream import TICK
from streamfleet.shared.errors import ErrorCode, NotFoundError, StreamfleetError, UnavailableError, ValidationError
from streamfleet.shared.logging import get_logger
from streamfleet.shared.metrics import gateway as metrics
from streamfleet.shared.redis import BROKER_ERRORS
from streamfleet.shared.schema import DoneEvent, ErrorEvent, PromptEvent, StoredResponse, TokenEvent

if TYPE_CHECKING:
    from streamfleet.gateway.admission.auth import Identity
    from streamfleet.gateway.hub import Hub

__all__ = ["router", "create"]

log = get_logger("gateway.responses")
router = APIRouter()


def _json(data: object, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def _frames(events: list[dict[str, Any]]) -> bytes:
    """Events as SSE, each with its ``event:`` line (its type), as OpenAI sends them."""
    return b"".join(b"event: " + ev["type"].encode() + b"\n" + sse_frame(ev) for ev in events)


def _owner(identity: Identity | None) -> str:
    """The tenant a response belongs to: the API key's; "" with auth off (whoever has its id)."""
    return owner_of(identity) or ""


def _not_found(response_id: str, param: str | None = None) -> NotFoundError:
    return NotFoundError(f"no response with id {response_id!r}", code=ErrorCode.unknown_request, param=param)


async def _load(hub: Hub, response_id: object, owner: str, param: str | None = None) -> StoredResponse:
    """The stored response ``response_id`` of ``owner``.

    Raises:
        NotFoundError: none (expired, deleted, never stored, another tenant's).
        UnavailableError: Redis cannot be read.
    """
    if not isinstance(response_id, str) or not RESPONSE_ID.fullmatch(response_id):
        raise _not_found(str(response_id)[:64], param)
    try:
        raw = await hub.broker.redis.get(hub.broker.keys.response(response_id))
    except BROKER_ERRORS as exc:
        raise UnavailableError(f"message broker unavailable: {exc}", retry_after_ms=1000) from exc
    if raw is None:
        raise _not_found(response_id, param)
    try:
        stored = StoredResponse.decode(raw)
    except ValueError:
        log.warning("malformed stored response", response_id=response_id)
        raise _not_found(response_id, param) from None
    if not hmac.compare_digest(stored.owner.encode(), owner.encode()):
        raise _not_found(response_id, param)
    return stored


async def _save(hub: Hub, stored: StoredResponse) -> None:
    """Store a finished response (``store``), or say in it that it was not stored:
    larger than ``SF_RESPONSES_MAX_BYTES``, or Redis away (``"store": false``)."""
    response = stored.response
    raw = stored.encode()
    limit = hub.settings.responses_max_bytes
    if len(raw) > limit:
        log.warning("response not stored: too large", response_id=response["id"], bytes=len(raw), limit=limit)
        response["store"] = False
        return
    try:
        await hub.broker.redis.set(hub.broker.keys.response(response["id"]), raw,
                                   px=max(1, int(hub.settings.responses_ttl_s * 1000)))
    except BROKER_ERRORS as exc:
        log.warning("response not stored: redis unavailable", response_id=response["id"], error=str(exc))
        response["store"] = False


async def create(request: Request) -> Response:
    """``POST /v1/responses``."""
    hub: Hub = request.app.state.hub
    chat_path = False  # from here on an error names a chat completions field (``renamed``)
    try:
        identity, body = await open_json(request, hub)
        if body is None:
            log.debug("client left mid-body", path=request.url.path)
            return Response(status_code=499)
        req = parse_request(body, hub.settings.refuse_unsupported)
        if req.ignored:
            log.warning("unsupported parameters ignored (SF_REFUSE_UNSUPPORTED=false)", params=list(req.ignored))
        owner = _owner(identity)
        conversation: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = await _load(hub, req.previous_response_id, owner, "previous_response_id")
            conversation = previous.input + output_as_input(previous.response)
        conversation += req.items
        limit = hub.settings.responses_max_bytes
        if req.store and len(orjson.dumps(conversation)) > limit:
            raise ValidationError(f"the conversation is larger than a stored response may be ({limit} bytes, "
                                  f"SF_RESPONSES_MAX_BYTES): start a new one, or send \"store\": false",
                                  code=ErrorCode.invalid_request, param="input")
        chat_path = True
        payload = request_payload(chat_body(req, conversation), True,
                                  priority_header=request.headers.get("x-priority"))
        draft = hub.validator.check(payload)
        creq = hub.request("http", identity=identity, peer=client_host(request))
        await creq.submit(draft, trace_id=trace_id_from(request.headers.get("traceparent")))
    except StreamfleetError as exc:
        metrics.refusals.labels("http", str(exc.code)).inc()
        return openai_error_response(renamed(exc) if chat_path else exc)

    creq.watch()  # a revoked key ends the stream
    events = creq.events("sse" if req.stream else "http")
    shape = ResponseShape(True, creq.id, creq.model, draft.tools)
    out = ResponseEvents(shape, req, draft.params.temperature, draft.params.top_p)
    save = _saver(hub, req, owner, conversation)
    if req.stream:
        return StreamingResponse(_sse(hub, creq, events, out, save), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    try:
        return await _collect(request, events, out, save)
    finally:
        await creq.close(reason="http_disconnect")


#: stores a response once it is whole (``_saver``)
Save = Callable[[dict[str, Any]], Awaitable[None]]


def _saver(hub: Hub, req: ResponsesRequest, owner: str, conversation: list[dict[str, Any]]) -> Save:
    async def save(response: dict[str, Any]) -> None:
        if req.store:
            await _save(hub, StoredResponse(owner, response, conversation))
    return save


async def _sse(hub: Hub, req: ClientRequest, events: Events, out: ResponseEvents, save: Save) -> AsyncIterator[bytes]:
    """The event stream of one response; keepalives from the stream itself
    (``RequestStream.tick_s``). The response is stored before its last event goes out."""
    assert req.stream is not None  # (submitted)
    req.stream.tick_s = hub.settings.sse_keepalive_s
    try:
        yield _frames(out.start())
        async for ev in events:
            if ev is TICK:
                yield KEEPALIVE
            elif isinstance(ev, TokenEvent):
                got = out.token(ev)
                if got:
                    yield _frames(got)
            elif isinstance(ev, DoneEvent):
                tail = out.end(ev)
                await save(out.response)
                yield _frames(tail)
                req.delivered()
                return
            elif isinstance(ev, ErrorEvent):
                tail = out.fail(ev.error())
                await save(out.response)
                yield _frames(tail)
                req.delivered()
                return
    finally:
        with anyio.CancelScope(shield=True):
            await stop_events(None, events)
        await req.close(hub.settings.sse_resume_grace_s, "http_disconnect")


async def _collect(request: Request, events: Events, out: ResponseEvents, save: Save) -> Response:
    """Not streamed: the whole response, cancelled if the client leaves."""
    def token(ev: TokenEvent | PromptEvent) -> None:
        assert isinstance(ev, TokenEvent)  # a Responses request asks for no prompt log probabilities
        out.token(ev)

    ev = await read_to_end(request, events, token)
    if ev is DISCONNECTED:
        return Response(status_code=499)
    if isinstance(ev, ErrorEvent):
        return openai_error_response(ev.error())
    out.end(ev)
    await save(out.response)
    return _json(out.response)


async def _caller(request: Request) -> str:
    """The tenant of a GET or DELETE (authenticated as any request)."""
    hub: Hub = request.app.state.hub
    return _owner(await hub.admission.authenticate(request.headers.get("authorization")))


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    return await create(request)


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str) -> Response:
    """A stored response, as it was returned."""
    hub: Hub = request.app.state.hub
    try:
        owner = await _caller(request)
        if request.query_params.get("stream") not in (None, "false"):
            raise ValidationError("'stream' is not supported when retrieving a response (there are no background "
                                  "responses here)", code=ErrorCode.invalid_request, param="stream")
        if request.query_params.getlist("include"):
            raise ValidationError("'include' is not supported by streamfleet's Responses API",
                                  code=ErrorCode.invalid_request, param="include")
        stored = await _load(hub, response_id, owner)
    except StreamfleetError as exc:
        return openai_error_response(exc)
    return _json(stored.response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> Response:
    """Delete a stored response: ``{"id", "object": "response", "deleted": true}``."""
    hub: Hub = request.app.state.hub
    try:
        owner = await _caller(request)
        await _load(hub, response_id, owner)
        try:
            await hub.broker.redis.delete(hub.broker.keys.response(response_id))
        except BROKER_ERRORS as exc:
            raise UnavailableError(f"message broker unavailable: {exc}", retry_after_ms=1000) from exc
    except StreamfleetError as exc:
        return openai_error_response(exc)
    return _json({"id": response_id, "object": "response", "deleted": True})
