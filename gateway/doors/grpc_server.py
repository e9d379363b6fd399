"""gRPC adapter: the ``streamfleet.v1.Inference`` service of
``proto/streamfleet/v1/inference.proto``, with the standard health service and server
reflection, on its own port of every gateway process (``SF_GRPC_PORT``; docs/grpc.md).

It is a third thin door over the same request lifecycle as the WebSocket and the OpenAI
HTTP API: a ``GenerateRequest`` is mapped to the WebSocket's generate payload and goes
through ``Validator.check``; ``gateway.requests.lifecycle.ClientRequest`` admits, enqueues, resumes
and cancels; events are rendered by ``frames.render`` and copied field for field into
messages. A ``Stream`` call is a ``gateway.services.session.Session``, as a WebSocket is.

* ``Generate`` / ``Resume``: ``Accepted``, ``Token``\\*, then ``Done`` (status OK) or an
  error status (``status_code``) whose trailers carry the fleet's error code, the retry
  delay (``retry-after-ms`` and ``google.rpc.RetryInfo``) and a ``google.rpc.ErrorInfo``.
* The call's deadline bounds the request's queue deadline; a call that ends early (the
  client cancelled it, its deadline passed, its connection went) cancels the request,
  which its worker stops at its next step.
* Health (``grpc.health.v1``): SERVING exactly when ``GET /readyz`` would answer 200,
  NOT_SERVING from the start of a drain.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal, NoReturn, TypeVar, assert_never, get_args

import anyio
import grpc
import orjson
import structlog
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped]
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from streamfleet.gateway.admission.gate import revoked_error
from streamfleet.gateway.admission.kinds import TextRequest
from streamfleet.gateway.admission.validation import GenerateField
from streamfleet.gateway.protocols.frames import accepted_frame, render, resume_fields
from streamfleet.gateway.requests.lifecycle import ClientRequest
from streamfleet.gateway.requests.observe import stop_events, trace_id_from
from streamfleet.gateway.requests.request_stream import Tick
from streamfleet.gateway.services.session import CallReader, Session
from streamfleet.gateway.services.voice import VoiceConnection
from streamfleet.shared.errors import ErrorCode, GenerationError, StreamfleetError, UnavailableError, ValidationError
from streamfleet.shared.logging import get_logger
from streamfleet.shared.metrics import gateway as metrics
from streamfleet.shared.schema import DoneEvent, EmbeddingEvent, ErrorEvent
from streamfleet.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from streamfleet.gateway.admission.auth import Identity
    from streamfleet.gateway.hub import Hub

__all__ = ["SERVICE", "GrpcDoor", "GrpcListenError", "InferenceService", "status_code", "generate_payload",
           "server_frame", "generate_event"]

log = get_logger("gateway.grpc")

#: a message a session call (``Stream``, ``Listen``) sends
M = TypeVar("M")

SERVICE = pb.DESCRIPTOR.services_by_name["Inference"].full_name  # "streamfleet.v1.Inference"
#: ErrorInfo.domain of the fleet's errors
ERROR_DOMAIN = "streamfleet"
#: seconds between two readiness checks behind the health service
HEALTH_PERIOD_S = 1.0
#: a Stream call with nothing to send looks this often whether a drain has begun
STREAM_CHECK_S = 1.0
#: frames a Stream call queues for a client that reads slower than its requests produce;
#: past it, the requests wait (as a WebSocket's wait on the socket)
STREAM_OUTBOX = 256
#: clients may ping this often at most (the server's keepalive enforcement)
MIN_CLIENT_PING_S = 10.0

#: the status of each error code where its HTTP status alone does not decide it
_BY_CODE: dict[ErrorCode, grpc.StatusCode] = {
    ErrorCode.unauthorized: grpc.StatusCode.UNAUTHENTICATED,
    ErrorCode.forbidden: grpc.StatusCode.PERMISSION_DENIED,
    ErrorCode.timeout: grpc.StatusCode.DEADLINE_EXCEEDED,
}
_BY_STATUS: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}

_PRIORITY: dict[int, str | None] = {pb.PRIORITY_UNSPECIFIED: None, pb.PRIORITY_NORMAL: "normal",
                                    pb.PRIORITY_HIGH: "high"}


def _lane(priority: int) -> str | None:
    """The lane a ``Priority`` asks for (None: unspecified, the door's default).

    Raises:
        ValidationError: a value this gateway does not know.
    """
    if priority not in _PRIORITY:
        raise ValidationError(f"'priority' {priority} is not a Priority value; use PRIORITY_NORMAL or "
                              f"PRIORITY_HIGH", code=ErrorCode.out_of_range, param="priority")
    return _PRIORITY[priority]


def grpc_carries(name: GenerateField) -> Literal["optional", "flag", "repeated", "own", "no"]:
    """How a ``GenerateRequest`` carries each field of the generate payload: a field of
    the same name that is ``optional`` (copied when set), a ``flag`` (a bool: true when
    set), ``repeated`` (copied when not empty), or ``own`` (``generate_payload`` maps it
    itself: the frame's id, renamed structured outputs, the priority enum, messages,
    tools); ``no``: not a field here. Exhaustive: a field added to ``GenerateField`` is a
    type error here until it is placed (docs/architecture.md, "Adding a field to a
    request")."""
    match name:
        case ("max_tokens" | "temperature" | "top_p" | "top_k" | "seed" | "timeout" | "presence_penalty"
              | "frequency_penalty" | "repetition_penalty" | "min_p" | "min_tokens" | "top_logprobs"
              | "parallel_tool_calls"):
            return "optional"
        case "ignore_eos" | "logprobs" | "include_stop_str_in_output":
            return "flag"
        case "stop" | "stop_token_ids":
            return "repeated"
        case ("id" | "model" | "prompt" | "messages" | "tools" | "tool_choice" | "logit_bias" | "priority"
              | "response_format" | "guided_json" | "guided_regex" | "guided_choice" | "guided_grammar"):
            return "own"
        case "n" | "best_of":
            return "no"
        case _:
            assert_never(name)


_OPTIONAL = tuple(f for f in get_args(GenerateField) if grpc_carries(f) == "optional")
_FLAGS = tuple(f for f in get_args(GenerateField) if grpc_carries(f) == "flag")
_REPEATED = tuple(f for f in get_args(GenerateField) if grpc_carries(f) == "repeated")


class GrpcListenError(Exception):
    """The gRPC port cannot be bound."""


def status_code(code: ErrorCode) -> grpc.StatusCode:
    """The gRPC status of a fleet error code (docs/grpc.md, "Status codes")."""
    from streamfleet.shared.errors import STATUS_BY_CODE

    return _BY_CODE.get(code) or _BY_STATUS.get(STATUS_BY_CODE.get(code, 500), grpc.StatusCode.INTERNAL)


def error_trailers(exc: StreamfleetError) -> tuple[tuple[str, str | bytes], ...]:
    """The trailing metadata of a failed call: ``streamfleet-error-code`` (and
    ``-param``), ``retry-after-ms``, and ``grpc-status-details-bin`` (a
    ``google.rpc.Status`` with an ``ErrorInfo`` and, for a refusal, a ``RetryInfo``)."""
    info = error_details_pb2.ErrorInfo(reason=str(exc.code), domain=ERROR_DOMAIN)
    if exc.param:
        info.metadata["param"] = exc.param
    details = [info]
    md: list[tuple[str, str | bytes]] = [("streamfleet-error-code", str(exc.code))]
    if exc.param:
        md.append(("streamfleet-error-param", exc.param))
    if exc.retry_after_ms is not None:
        ms = max(0, int(exc.retry_after_ms))
        details.append(error_details_pb2.RetryInfo(
            retry_delay=duration_pb2.Duration(seconds=ms // 1000, nanos=(ms % 1000) * 1_000_000)))
        md.append(("retry-after-ms", str(ms)))
    packed = []
    for d in details:
        a = any_pb2.Any()
        a.Pack(d)
        packed.append(a)
    status = status_pb2.Status(code=status_code(exc.code).value[0], message=exc.message, details=packed)
    md.append(("grpc-status-details-bin", status.SerializeToString()))
    return tuple(md)


async def abort(context: aio.ServicerContext, exc: StreamfleetError) -> NoReturn:
    await context.abort(status_code(exc.code), exc.message, trailing_metadata=error_trailers(exc))
    raise AssertionError("ServicerContext.abort returned")  # (it raises)


# -- messages <-> the WebSocket's frames ----------------------------------------------------
def generate_payload(req: pb.GenerateRequest, client_id: str | None) -> dict[str, Any]:
    """The WebSocket generate frame of a ``GenerateRequest``: set fields only, so an unset
    one takes the gateway's default exactly as an absent JSON field does.

    Raises:
        ValidationError: an enum value this gateway does not know.
    """
    p: dict[str, Any] = {"type": "generate"}
    if client_id:
        p["id"] = client_id
    if req.model:
        p["model"] = req.model
    if req.HasField("prompt"):
        p["prompt"] = req.prompt
    if req.messages:
        p["messages"] = [_message(m) for m in req.messages]
    if req.tools:
        p["tools"] = [_tool(t) for t in req.tools]
    if req.tool_choice:
        choice = req.tool_choice
        p["tool_choice"] = choice if choice in ("none", "auto", "required") else \
            {"type": "function", "function": {"name": choice}}
    for name in _OPTIONAL:
        if req.HasField(name):
            p[name] = getattr(req, name)
    for name in _FLAGS:
        if getattr(req, name):
            p[name] = True
    for name in _REPEATED:
        if getattr(req, name):
            p[name] = list(getattr(req, name))
    if req.logit_bias:
        p["logit_bias"] = {str(t): b for t, b in req.logit_bias.items()}
    if req.json_schema:
        p["guided_json"] = req.json_schema
    if req.json_object:
        p["response_format"] = {"type": "json_object"}
    if req.regex:
        p["guided_regex"] = req.regex
    if req.choice:
        p["guided_choice"] = list(req.choice)
    if req.grammar:
        p["guided_grammar"] = req.grammar
    lane = _lane(req.priority)
    if lane is not None:
        p["priority"] = lane
    return p


def _message(m: pb.ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def _tool(t: pb.Tool) -> dict[str, Any]:
    """A ``Tool`` as the OpenAI API's ``{"type": "function", "function": …}``, for the
    validator (which checks the name, the schema's shape and depth).

    Raises:
        ValidationError: ``parameters`` that is not JSON text.
    """
    fn: dict[str, Any] = {"name": t.name}
    if t.description:
        fn["description"] = t.description
    if t.parameters:
        try:
            fn["parameters"] = orjson.loads(t.parameters)
        except orjson.JSONDecodeError as exc:
            raise ValidationError(f"tool {t.name[:64]!r}: 'parameters' is not JSON text ({exc.msg})",
                                  code=ErrorCode.invalid_type, param="tools") from exc
    return {"type": "function", "function": fn}


def client_message(frame: pb.ClientFrame) -> dict[str, Any]:
    """The WebSocket frame of a ``ClientFrame``.

    Raises:
        ValidationError: no frame set, or a bad enum value.
    """
    cid = frame.id or None
    kind = frame.WhichOneof("frame")
    if kind == "generate":
        return generate_payload(frame.generate, cid)
    if kind == "cancel":
        return {"type": "cancel", "id": cid}
    if kind == "resume":
        r = frame.resume
        return {"type": "resume", "id": cid, "request_id": r.request_id, "from_index": r.from_index,
                "resume_token": r.resume_token or None}
    raise ValidationError("a ClientFrame needs one of generate, cancel or resume", code=ErrorCode.invalid_frame)


def _accepted(f: dict[str, Any]) -> pb.Accepted:
    return pb.Accepted(request_id=f["request_id"], queue_depth=f["queue_depth"],
                       resume_token=f.get("resume_token") or "", resumed_from=f.get("resumed_from"))


def _token(f: dict[str, Any]) -> pb.Token:
    lp = f.get("logprobs")
    if lp is None:
        return pb.Token(index=f["index"], text=f["text"])
    return pb.Token(index=f["index"], text=f["text"], logprob=pb.TokenLogprob(
        id=lp["id"], token=lp["token"], bytes=bytes(lp["bytes"]), logprob=lp["logprob"],
        top=[pb.TokenLogprob(id=t["id"], token=t["token"], bytes=bytes(t["bytes"]), logprob=t["logprob"])
             for t in lp["top"]]))


def _done(f: dict[str, Any]) -> pb.Done:
    return pb.Done(request_id=f["request_id"], finish_reason=f["finish_reason"], usage=pb.Usage(**f["usage"]),
                   timing=pb.Timing(**f["timing"]), model_version=f.get("model_version") or "",
                   tool_calls=[pb.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
                               for c in f.get("tool_calls", ())])


def _error(f: dict[str, Any]) -> pb.Error:
    return pb.Error(code=f["code"], status=f["status"], message=f["message"], param=f.get("param") or "",
                    retry_after_ms=f.get("retry_after_ms"))


def server_frame(f: dict[str, Any]) -> pb.ServerFrame:
    """The ``ServerFrame`` of a WebSocket frame (accepted, token, done or error)."""
    kind, cid = f["type"], f.get("id") or ""
    if kind == "token":
        return pb.ServerFrame(id=cid, token=_token(f))
    if kind == "accepted":
        return pb.ServerFrame(id=cid, accepted=_accepted(f))
    if kind == "done":
        return pb.ServerFrame(id=cid, done=_done(f))
    if kind == "error":
        return pb.ServerFrame(id=cid, error=_error(f))
    raise ValueError(f"no ServerFrame for a {kind!r} frame")


def generate_event(f: dict[str, Any]) -> pb.GenerateEvent:
    """The ``GenerateEvent`` of a WebSocket frame (accepted, token or done)."""
    kind = f["type"]
    if kind == "token":
        return pb.GenerateEvent(token=_token(f))
    if kind == "accepted":
        return pb.GenerateEvent(accepted=_accepted(f))
    if kind == "done":
        return pb.GenerateEvent(done=_done(f))
    raise ValueError(f"no GenerateEvent for a {kind!r} frame")


def _metadata(context: aio.ServicerContext) -> dict[str, str]:
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


def _within_deadline(draft: TextRequest, context: aio.ServicerContext) -> TextRequest:
    """The checked request with its queue deadline no later than the call's.

    Raises:
        GenerationError: ``timeout`` — the call's deadline has already passed.
    """
    remaining = context.time_remaining()
    if remaining is None or remaining >= draft.timeout_s:
        return draft
    if remaining <= 0.001:
        raise GenerationError("the call's deadline passed before the request was queued", code=ErrorCode.timeout)
    return replace(draft, timeout_s=remaining)


def _shutting_down() -> UnavailableError:
    return UnavailableError("this gateway is shutting down; call another", retry_after_ms=0,
                            code=ErrorCode.shutting_down)


class _StreamSession(Session):
    """One ``Stream`` call: a WebSocket connection's requests, over gRPC messages."""

    def __init__(self, hub: Hub) -> None:
        super().__init__(hub, "grpc")
        self.outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue(STREAM_OUTBOX)

    def send(self, frame: dict[str, Any]) -> None:
        self.outbox.put_nowait(frame)

    async def emit(self, frame: dict[str, Any]) -> None:
        await self.outbox.put(frame)

    async def read(self, frames: AsyncIterator[pb.ClientFrame]) -> None:
        """Read the client's frames until it half-closes the call."""
        async for frame in frames:
            try:
                msg = client_message(frame)
            except ValidationError as exc:
                await self.outbox.put(exc.to_frame(frame.id or None))
                continue
            outputs = self.proto.receive(msg)
            for out in outputs:
                frame_out = getattr(out, "frame", None)
                if frame_out is not None:  # a Send: wait for room rather than queue without end
                    await self.outbox.put(frame_out)
                else:
                    self.dispatch([out])


def voice_start_frame(start: pb.VoiceStart) -> dict[str, Any]:
    """The voice WebSocket's ``start`` frame of a ``VoiceStart``: set fields only, so an
    unset one takes the default an absent JSON field takes.

    Raises:
        ValidationError: a priority value this gateway does not know.
    """
    frame: dict[str, Any] = {"type": "start"}
    for name in ("id", "model", "sample_rate", "encoding", "language"):
        value = getattr(start, name)
        if value:
            frame[name] = value
    lane = _lane(start.priority)
    if lane is not None:
        frame["priority"] = lane
    return frame


#: the voice frames' fields a ``VoiceEvent`` carries as they are
_VOICE_FIELDS = ("text", "offset_ms", "start_ms", "end_ms", "finish_reason", "request_id", "utterances", "model",
                 "sample_rate", "encoding", "vad")


def voice_event(f: dict[str, Any]) -> pb.VoiceEvent:
    """A voice WebSocket frame (``gateway/services/voice.py``, ``gateway/protocols/audio_protocol.py``) as a
    ``VoiceEvent``: its type, id and utterance, the fields it has, an error's ``Error``."""
    ev = pb.VoiceEvent(type=f["type"], id=f.get("id") or "", utterance=f.get("utterance", -1))
    for name in _VOICE_FIELDS:
        if f.get(name) is not None:
            setattr(ev, name, f[name])
    if f["type"] == "error":
        ev.error.CopyFrom(_error(f))
    elif f["type"] == "warning":
        ev.code, ev.message = f.get("code", ""), f.get("message", "")
    return ev


class _ListenSession(Session):
    """One ``Listen`` call: a voice WebSocket's session, over gRPC messages; its frames are
    read by its ``VoiceConnection`` (gateway/services/voice.py), as a voice WebSocket's are."""

    def __init__(self, hub: Hub) -> None:
        super().__init__(hub, "voice")
        self.voice = VoiceConnection(self)
        self.outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue(STREAM_OUTBOX)

    def send(self, frame: dict[str, Any]) -> None:
        if frame.get("type") == "pong":  # a WebSocket ping's answer: gRPC has its own keepalive
            return
        self.outbox.put_nowait(frame)

    async def emit(self, frame: dict[str, Any]) -> None:
        await self.outbox.put(frame)

    async def read(self, frames: AsyncIterator[pb.VoiceClientFrame]) -> None:
        """Read the client's frames, in order, until it half-closes the call."""
        voice = self.voice
        async for frame in frames:
            kind = frame.WhichOneof("frame")
            if kind == "audio":
                await voice.receive_bytes(frame.audio)
            elif kind == "start":
                try:
                    start = voice_start_frame(frame.start)
                except ValidationError as exc:
                    await self.outbox.put(exc.to_frame(frame.start.id or None))
                    continue
                await voice.receive_text(orjson.dumps(start).decode())
            elif kind == "stop":
                await voice.receive_text('{"type":"stop"}')
            else:
                await self.outbox.put(ValidationError("a VoiceClientFrame needs one of start, audio or stop",
                                                      code=ErrorCode.invalid_frame).to_frame(None))


class InferenceService(pb_grpc.InferenceServicer):
    """``streamfleet.v1.Inference`` over one gateway's ``Hub``."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub

    async def _caller(self, md: dict[str, str]) -> Identity | None:
        """The caller of a call that would start work: refused while draining, else its
        API key's identity (None with auth off)."""
        if self.hub.draining:
            raise _shutting_down()
        return await self._identity(md)

    async def _identity(self, md: dict[str, str]) -> Identity | None:
        identity = await self.hub.admission.authenticate(md.get("authorization"))
        if identity is not None:  # every log line of this call names its key
            structlog.contextvars.bind_contextvars(key_id=identity.key_id)
        return identity

    async def _refuse(self, context: aio.ServicerContext, exc: StreamfleetError) -> NoReturn:
        metrics.refusals.labels("grpc", str(exc.code)).inc()
        await abort(context, exc)

    async def Generate(self, request: pb.GenerateRequest, context: aio.ServicerContext,
                       ) -> AsyncIterator[pb.GenerateEvent]:
        hub = self.hub
        md = _metadata(context)
        try:
            identity = await self._caller(md)
            draft = _within_deadline(hub.validator.check(generate_payload(request, "grpc")), context)
            # with auth off the tenant of its fair share is its connection (``ipv4:host:port``)
            req = hub.request("grpc", identity=identity, peer=context.peer() or "")
            depth = await req.submit(draft, trace_id=trace_id_from(md.get("traceparent")))
        except StreamfleetError as exc:
            await self._refuse(context, exc)
        first = accepted_frame("grpc", req.request_id, depth, req.resume_token)
        calls = CallReader(draft.tools, req) if draft.tools is not None else None
        async for event in self._events(req, context, first, calls):
            yield event

    async def Resume(self, request: pb.ResumeRequest, context: aio.ServicerContext,
                     ) -> AsyncIterator[pb.GenerateEvent]:
        md = _metadata(context)
        try:
            identity = await self._caller(md)
            rid, idx, token = resume_fields({"request_id": request.request_id, "from_index": request.from_index,
                                             "resume_token": request.resume_token or None})
            req = self.hub.request("grpc", identity=identity)
            await req.resume(rid, idx, token)
        except StreamfleetError as exc:
            await self._refuse(context, exc)
        first = accepted_frame("grpc", rid, 0)
        first["resumed_from"] = idx
        async for event in self._events(req, context, first):
            yield event

    async def _events(self, req: ClientRequest, context: aio.ServicerContext, first: dict[str, Any],
                      calls: CallReader | None = None) -> AsyncIterator[pb.GenerateEvent]:
        """A submitted or resumed request's events; a failure ends the call with its status
        (``calls``: a request that offered tools has its completion read for calls, which
        its ``Done`` carries). However the call ends, the request is given back
        (``ClientRequest.close``: one still running is cancelled)."""
        req.watch()  # a revoked key ends the stream
        events = req.events("grpc")
        try:
            yield generate_event(first)
            async for ev in events:
                if isinstance(ev, ErrorEvent):
                    req.delivered()
                    await abort(context, ev.error())
                if isinstance(ev, Tick):  # (a gRPC call's request has no keepalive ticks)
                    continue
                frame = render("grpc", req.request_id, ev)
                if calls is not None:
                    calls.read(ev, frame)
                yield generate_event(frame)
                if isinstance(ev, DoneEvent):
                    req.delivered()
        finally:
            with anyio.CancelScope(shield=True):
                await stop_events(None, events)
                await req.close(reason="grpc_call_ended")

    async def Stream(self, request_iterator: AsyncIterator[pb.ClientFrame], context: aio.ServicerContext,
                     ) -> AsyncIterator[pb.ServerFrame]:
        session = _StreamSession(self.hub)
        # idle: every request ended (the client may have half-closed the call before)
        async for message in self._serve(session, request_iterator, context, server_frame,
                                         lambda: not session.proto.in_flight):
            yield message

    async def _serve(self, session: _StreamSession | _ListenSession, request_iterator: AsyncIterator[Any],
                     context: aio.ServicerContext, convert: Callable[[dict[str, Any]], M],
                     idle: Callable[[], bool]) -> AsyncIterator[M]:
        """A call that is a session (``Stream``: a WebSocket's requests; ``Listen``: a voice
        WebSocket's): the caller admitted as a connection, the client's messages read by
        ``session.read``, the frames its outbox gets sent as ``convert`` makes them, until
        the client half-closed the call and the session is ``idle`` (status OK), its key is
        revoked, or the gateway drains."""
        hub = self.hub
        md = _metadata(context)
        try:
            session.identity = await self._caller(md)
            full = session.at_capacity()
            if full is not None:
                raise full
            await session.connect()
        except StreamfleetError as exc:
            await self._refuse(context, exc)
        session.trace_id = trace_id_from(md.get("traceparent"))
        reader: asyncio.Task[None] | None = None
        getter: asyncio.Future[dict[str, Any]] | None = None
        try:
            try:
                await session.channel.open()
            except StreamfleetError as exc:
                await self._refuse(context, exc)
            reader = asyncio.create_task(session.read(request_iterator))
            while True:
                if session.revoked.done():
                    await abort(context, revoked_error())
                quiet = idle() and session.outbox.empty()
                if hub.draining and (quiet or hub.drain_expired):
                    await abort(context, _shutting_down())
                if reader.done() and quiet:
                    failed = None if reader.cancelled() else reader.exception()
                    if failed is not None:
                        raise failed
                    return  # the client half-closed and the session's work is over: OK
                if getter is None:
                    getter = asyncio.ensure_future(session.outbox.get())
                wait: set[asyncio.Future[Any]] = {getter, session.revoked}
                if not reader.done():
                    wait.add(reader)
                done, _ = await asyncio.wait(wait, timeout=STREAM_CHECK_S, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    frame, getter = getter.result(), None
                    yield convert(frame)
        finally:
            with anyio.CancelScope(shield=True):
                if reader is not None:
                    reader.cancel()
                if getter is not None:
                    getter.cancel()
                await session.close_requests()
                session.cancel_tasks()
                await session.disconnect()

    async def Transcribe(self, request: pb.TranscribeRequest, context: aio.ServicerContext,
                         ) -> AsyncIterator[pb.TranscribeEvent]:
        """An audio file's transcript, a ``TranscriptSegment`` per utterance as each is
        known, then ``TranscribeDone``: the HTTP door's transcription
        (``gateway.services.transcription.open_transcription``: the same checks, admission, lanes
        and speech workers), its failure the call's status. A call that ends early
        cancels every utterance still running."""
        # the HTTP door's audio decoders, imported on first use
        from streamfleet.gateway.protocols.transcription_mapping import full_text
        from streamfleet.gateway.services.transcription import open_transcription

        hub = self.hub
        md = _metadata(context)
        job = None
        try:
            try:
                identity = await self._caller(md)
                hub.admission.spent(identity)  # a key known out of its rate limit: refused before decoding
                if not request.file:
                    raise ValidationError("'file' is empty: send the audio file's bytes", code=ErrorCode.missing_field,
                                          param="file")
                lane = _lane(request.priority) or "normal"
                job, audio, spec = await open_transcription(
                    hub, identity, request.file, model=request.model or None, language=request.language or None,
                    lane=lane, trace_id=trace_id_from(md.get("traceparent")),
                    log_fields={"door": "grpc"})
                await job.first_submitted
            except StreamfleetError as exc:
                metrics.refusals.labels("grpc", str(exc.code)).inc()
                await abort(context, exc)
            segments = []
            try:
                async for seg in job.segments():
                    segments.append(seg)
                    yield pb.TranscribeEvent(segment=pb.TranscriptSegment(
                        index=seg.id, start_ms=seg.start_ms, end_ms=seg.end_ms, text=seg.text))
            except StreamfleetError as exc:
                await abort(context, exc)
            yield pb.TranscribeEvent(done=pb.TranscribeDone(text=full_text(segments), duration_s=audio.duration_s,
                                                            language=spec.language))
        finally:
            if job is not None:
                with anyio.CancelScope(shield=True):
                    await job.close()

    async def Listen(self, request_iterator: AsyncIterator[pb.VoiceClientFrame], context: aio.ServicerContext,
                     ) -> AsyncIterator[pb.VoiceEvent]:
        """The voice WebSocket over one call (docs/grpc.md, "Calls"): the same session
        (``gateway.services.voice.VoiceConnection``), admission, limits and frames, as messages."""
        session = _ListenSession(self.hub)
        # idle: no task left (the utterances, and the ``stopped`` frame that waits for them)
        async for message in self._serve(session, request_iterator, context, voice_event, lambda: not session.tasks):
            yield message

    async def Embed(self, request: pb.EmbedRequest, context: aio.ServicerContext) -> pb.EmbedResponse:
        """An embedding model's vectors: the HTTP door's ``/v1/embeddings`` (its checks,
        limits, admission and lanes: ``gateway.services.embeddings``), its failure the call's status."""
        from streamfleet.gateway.services.embeddings import check_body, submit

        md = _metadata(context)
        try:
            identity = await self._caller(md)
            self.hub.admission.spent(identity)  # a key known out of its rate limit: refused first
            if request.texts and request.token_ids:
                raise ValidationError("send 'texts' or 'token_ids', not both", code=ErrorCode.invalid_request,
                                      param="input")
            body: dict[str, Any] = {"model": request.model or None,
                                    "input": list(request.texts) or [list(t.ids) for t in request.token_ids]
                                    or None}
            if request.timeout_s:
                body["timeout"] = request.timeout_s
            checked = check_body(self.hub, body)
            checked.lane = _lane(request.priority) or checked.lane
            call = await submit(self.hub, "grpc", identity, checked, trace_id_from(md.get("traceparent")))
        except StreamfleetError as exc:
            await self._refuse(context, exc)
        try:
            vectors, end = await call.result()
        except StreamfleetError as exc:
            await abort(context, exc)
        return pb.EmbedResponse(
            model=checked.spec.name,
            embeddings=[pb.Embedding(values=EmbeddingEvent(request_id="", index=i, vector=v).values().tolist())
                        for i, v in enumerate(vectors)],
            usage=pb.Usage(prompt_tokens=end.prompt_tokens))

    async def ListModels(self, request: pb.ListModelsRequest, context: aio.ServicerContext) -> pb.ListModelsResponse:
        try:
            await self._identity(_metadata(context))
            served = await self.hub.served_models()
        except StreamfleetError as exc:
            await self._refuse(context, exc)
        return pb.ListModelsResponse(models=[pb.Model(id=name, workers=n) for name, n in served])


class GrpcDoor:
    """The gRPC server of one gateway process: bound at construction (a taken port stops
    the gateway before it connects to anything), started once the gateway is, told when
    the drain begins, stopped at the end.

    Raises:
        GrpcListenError: the port cannot be bound.
    """

    def __init__(self, hub: Hub) -> None:
        s = hub.settings
        self.hub = hub
        max_message = s.max_frame_bytes
        options = [
            ("grpc.max_receive_message_length", max_message),
            ("grpc.max_send_message_length", max(max_message, 4 << 20)),
            ("grpc.max_concurrent_streams", s.grpc_max_concurrent_streams),
            ("grpc.keepalive_time_ms", int(s.grpc_keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(s.grpc_keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", int(MIN_CLIENT_PING_S * 1000)),
            ("grpc.http2.max_ping_strikes", 2),
            ("grpc.so_reuseport", 0),
            # calls past SF_GRPC_MAX_CONCURRENT_STREAMS wait in the client's queue, as HTTP/2's
            # SETTINGS_MAX_CONCURRENT_STREAMS asks. grpc's overload protection refuses a new
            # stream (RST_STREAM REFUSED_STREAM, the client's UNAVAILABLE) while it still counts
            # streams whose calls have ended but whose handlers are not yet freed: 300 calls on
            # one channel had ~40 reset. The handlers are bounded by ``maximum_concurrent_rpcs``
            # below instead (docs/grpc.md, "Connections and draining")
            ("grpc.http.overload_protection", 0),
            # the edge before auth (docs/security.md): the call's metadata, the connections
            # held, the time a connection may take to say its first HTTP/2 frames
            ("grpc.max_metadata_size", s.grpc_max_metadata_bytes),
            ("grpc.absolute_max_metadata_size", s.grpc_max_metadata_bytes),
        ]
        if s.grpc_max_connections > 0:
            options.append(("grpc.max_allowed_incoming_connections", s.grpc_max_connections))
        if s.header_timeout_s > 0:
            options.append(("grpc.server_handshake_timeout_ms", int(s.header_timeout_s * 1000)))
        if s.grpc_max_connection_idle_s > 0:
            options.append(("grpc.max_connection_idle_ms", int(s.grpc_max_connection_idle_s * 1000)))
        if s.grpc_max_connection_age_s > 0:
            options += [("grpc.max_connection_age_ms", int(s.grpc_max_connection_age_s * 1000)),
                        ("grpc.max_connection_age_grace_ms", int(s.grpc_max_connection_age_grace_s * 1000))]
        # every call holds an asyncio task: past this many, more are refused (RESOURCE_EXHAUSTED)
        self.server = aio.server(options=options, maximum_concurrent_rpcs=s.max_connections)
        # (grpcio-tools generates this function without annotations: streamfleet/v1/)
        pb_grpc.add_InferenceServicer_to_server(InferenceService(hub), self.server)  # type: ignore[no-untyped-call]
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        host = f"[{s.host}]" if ":" in s.host and not s.host.startswith("[") else s.host
        self.address = f"{host}:{s.grpc_port}"
        try:
            self.port = self.server.add_insecure_port(self.address)
        except RuntimeError as exc:
            raise GrpcListenError(f"cannot listen for gRPC on {self.address} ({exc}); set SF_GRPC_PORT to a "
                                  f"free port, or 0 for no gRPC") from exc
        if not self.port:
            raise GrpcListenError(f"cannot listen for gRPC on {self.address}; set SF_GRPC_PORT to a free port, "
                                  f"or 0 for no gRPC")
        self._health_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.server.start()
        self._health_task = asyncio.create_task(self._watch_health(), name="grpc-health")
        log.info("gateway gRPC listening", address=f"{self.address.rsplit(':', 1)[0]}:{self.port}")

    async def _watch_health(self) -> None:
        """SERVING while ``Hub.readiness`` says ready, for the whole server ("") and the
        service; ``drain`` ends it."""
        status = None
        while True:
            try:
                ready, _ = await self.hub.readiness()
            except Exception:
                ready = False
            new = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
            if new != status:
                status = new
                await self.health.set("", new)
                await self.health.set(SERVICE, new)
            await asyncio.sleep(HEALTH_PERIOD_S)

    async def drain(self) -> None:
        """The gateway drains: health says NOT_SERVING from now on; new calls are refused
        (UNAVAILABLE ``shutting_down``), calls in flight go on."""
        if self._health_task is not None:
            self._health_task.cancel()
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving: calls still open get ``grace_s``, then are cancelled."""
        if self._health_task is not None:
            self._health_task.cancel()
        await self.server.stop(grace_s)
