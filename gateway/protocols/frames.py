"""WebSocket protocol state of one connection, without I/O (tested in memory).

``ConnectionProtocol`` parses client frames and keeps the connection's bookkeeping
(which ids are in flight, the per-connection limit); it returns what to do:

* ``Send(frame)``        write a JSON frame to the client
* ``Submit(request)``    admit, tokenize and enqueue a checked request (a ``TextRequest``)
* ``Embed(client_id, body)``  admit, tokenize and enqueue an embeddings request (its
  body passed the HTTP door's cheap checks: ``gateway.services.embeddings.check_body``)
* ``Resume(...)``        follow a request started elsewhere
* ``Cancel(client_id)``  interrupt a request in flight

``render`` turns a request stream's events (``gateway.requests.request_stream``: the wire's
``TokenEvent``, ``DoneEvent``, ``ErrorEvent``) into the client's frames;
``embeddings_frame`` an embeddings request's vectors into its one answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from streamfleet.gateway.admission.kinds import TextRequest
from streamfleet.gateway.admission.validation import MAX_ID_CHARS, Validator
from streamfleet.shared.errors import ErrorCode, StreamfleetError, ValidationError
from streamfleet.shared.schema import DoneEvent, EmbeddingEvent, ErrorEvent, Event, TokenEvent

__all__ = ["Send", "Submit", "Embed", "Cancel", "Resume", "Output", "ConnectionProtocol", "render", "accepted_frame",
           "embeddings_frame", "resume_fields", "EMBED_FRAME_FIELDS"]

#: the fields of an ``embed`` frame that are the frame's own, not the embeddings body's
#: (the rest goes to ``gateway.services.embeddings.check_body`` as an HTTP body would)
EMBED_FRAME_FIELDS = ("type", "id")


@dataclass(slots=True)
class Send:
    frame: dict[str, Any]


@dataclass(slots=True)
class Submit:
    request: TextRequest  # checked (``Validator.check``), not yet admitted


@dataclass(slots=True)
class Embed:
    client_id: str
    #: what ``check_embed`` made of the frame (``gateway.services.embeddings.EmbeddingsBody``;
    #: opaque here: a protocol module imports no service)
    body: object


@dataclass(slots=True)
class Cancel:
    client_id: str


@dataclass(slots=True)
class Resume:
    client_id: str
    request_id: str
    from_index: int
    #: the ``resume_token`` of the request's ``accepted`` frame (with auth off it proves
    #: ownership; with auth on the API key does)
    token: str | None = None


Output = Send | Submit | Embed | Cancel | Resume


def accepted_frame(client_id: str, request_id: str | None, queue_depth: int, resume_token: str | None = None,
                   ) -> dict[str, Any]:
    frame = {"type": "accepted", "id": client_id, "request_id": request_id, "queue_depth": queue_depth}
    if resume_token:
        frame["resume_token"] = resume_token
    return frame


def render(client_id: str, request_id: str | None, ev: Event) -> dict[str, Any]:
    """The client's frame of one stream event. A ``done`` the gateway made itself (a
    cancel no worker answered: ``DoneEvent.timed`` false) has an empty ``timing``."""
    if isinstance(ev, TokenEvent):
        if ev.logprobs is not None:
            return {"type": "token", "id": client_id, "index": ev.index, "text": ev.text, "logprobs": ev.logprobs}
        return {"type": "token", "id": client_id, "index": ev.index, "text": ev.text}
    if isinstance(ev, DoneEvent):
        frame = {"type": "done", "id": client_id, "request_id": request_id, "finish_reason": ev.finish_reason,
                 "usage": ev.usage(), "timing": ev.timing() if ev.timed else {}}
        if ev.model_version:
            frame["model_version"] = ev.model_version
        return frame
    assert isinstance(ev, ErrorEvent)
    return ev.error().to_frame(client_id)


def embeddings_frame(client_id: str, request_id: str | None, model: str, vectors: list[str], done: DoneEvent,
                     encoding: str) -> dict[str, Any]:
    """An embeddings request's one answer (docs/websocket.md, "Embeddings"): the vectors
    (base64 float32, as the worker sent them) in input order, as lists of numbers or,
    with ``encoding`` ``"base64"``, as they are; the usage and timing of its ``done``."""
    if encoding == "base64":
        data = [{"index": i, "embedding": v} for i, v in enumerate(vectors)]
    else:  # each float32 as the shortest decimal that reads back as its double (as the HTTP door prints it)
        data = [{"index": i, "embedding": EmbeddingEvent(request_id or "", i, v).values().astype("float64").tolist()}
                for i, v in enumerate(vectors)]
    frame = {"type": "embeddings", "id": client_id, "request_id": request_id, "model": model, "data": data,
             "usage": {"prompt_tokens": done.prompt_tokens, "total_tokens": done.prompt_tokens},
             "timing": {"queue_ms": round(done.queue_ms, 3), "total_ms": round(done.total_ms, 3)}
             if done.timed else {}}
    if done.model_version:
        frame["model_version"] = done.model_version
    return frame


def resume_fields(msg: dict[str, Any]) -> tuple[str, int, str | None]:
    """``(request_id, from_index, resume_token)`` of a resume frame (or a gRPC
    ``ResumeRequest`` in the same shape).

    Raises:
        ValidationError: a field is missing or malformed (the code and param say which).
    """
    rid = msg.get("request_id")
    if not isinstance(rid, str) or not rid or len(rid) > 64 or not rid.isalnum():
        raise ValidationError("'request_id' must be the request_id that 'accepted' returned",
                              code=ErrorCode.invalid_type if not isinstance(rid, str) else ErrorCode.invalid_request,
                              param="request_id")
    idx = msg.get("from_index", 0)
    if isinstance(idx, float) and idx.is_integer():
        idx = int(idx)
    if not isinstance(idx, int) or isinstance(idx, bool):
        raise ValidationError("'from_index' must be an integer", code=ErrorCode.invalid_type, param="from_index")
    if not 0 <= idx <= 1_000_000:
        raise ValidationError("'from_index' must be between 0 and 1000000", code=ErrorCode.out_of_range,
                              param="from_index")
    token = msg.get("resume_token")
    if token is not None and (not isinstance(token, str) or len(token) > 128):
        raise ValidationError("'resume_token' must be the resume_token that 'accepted' returned",
                              code=ErrorCode.invalid_type, param="resume_token")
    return rid, idx, token


class ConnectionProtocol:
    """Frame parsing and in-flight bookkeeping of one client connection.

    Args:
        validator: a ``gateway.admission.validation.Validator``.
        max_inflight: most concurrent requests on this connection.
        max_frame_bytes: largest text frame accepted.
        check_embed: the cheap checks of an embeddings body
            (``gateway.services.embeddings.check_body`` with the process's hub), for ``embed``
            frames; None: they are refused (``unknown_type``).
    """

    def __init__(self, validator: Validator, *, max_inflight: int = 64, max_frame_bytes: int = 1 << 20,
                 check_embed: Callable[[dict[str, Any]], object] | None = None) -> None:
        self.validator = validator
        self.check_embed = check_embed
        self.max_inflight = max_inflight
        self.max_frame_bytes = max_frame_bytes
        #: client ids of the requests in flight (a dict as an ordered set: an empty set
        #: costs three times an empty dict, on every idle connection)
        self.in_flight: dict[str, None] = {}

    def receive_bytes(self, data: bytes) -> list[Output]:
        return [Send(ValidationError("binary frames are not supported; send JSON text frames",
                                     code=ErrorCode.binary_frame).to_frame(None))]

    def receive_text(self, text: str) -> list[Output]:
        # the limit is in bytes and a character takes 1 to 4 of them in UTF-8: the length in
        # characters decides most frames without encoding (more characters than the limit:
        # too large, and at least that many bytes; at most a quarter of it: fine)
        limit = self.max_frame_bytes
        size = None
        if len(text) > limit:
            size = f"at least {len(text)}"
        elif len(text) * 4 > limit:
            n = len(text.encode("utf-8", "surrogatepass"))
            if n > limit:
                size = str(n)
        if size is not None:
            return [Send(ValidationError(f"frame of {size} bytes exceeds the limit of {limit}",
                                         code=ErrorCode.frame_too_large).to_frame(None))]
        try:
            msg = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            return [Send(ValidationError(f"frame is not valid JSON: {exc.msg}",
                                         code=ErrorCode.invalid_json).to_frame(None))]
        if not isinstance(msg, dict):
            return [Send(ValidationError("a frame must be a JSON object", code=ErrorCode.invalid_frame).to_frame(None))]
        return self.receive(msg)

    def receive(self, msg: dict[str, Any]) -> list[Output]:
        """One decoded frame (a JSON object, or a gRPC ``ClientFrame`` in the same shape)."""
        kind = msg.get("type")
        cid = msg.get("id") if isinstance(msg.get("id"), str) else None
        if kind == "generate":
            return self._generate(msg, cid)
        if kind == "embed" and self.check_embed is not None:
            return self._embed(msg, cid)
        if kind == "cancel":
            return self._cancel(cid)
        if kind == "ping":
            return [Send({"type": "pong"})]
        if kind == "resume":
            return self._resume(msg, cid)
        if not isinstance(kind, str):
            return [Send(ValidationError("field 'type' must be a string", code=ErrorCode.invalid_frame,
                                         param="type").to_frame(cid))]
        shown = kind if len(kind) <= 32 else kind[:32] + "…"
        return [Send(ValidationError(f"unknown frame type {shown!r}; expected generate, "
                                     f"{'embed, ' if self.check_embed is not None else ''}cancel, resume or ping",
                                     code=ErrorCode.unknown_type, param="type").to_frame(cid))]

    def _admissible(self, cid: str | None) -> list[Output]:
        if cid is not None and cid in self.in_flight:
            return [Send(ValidationError(f"a request with id {cid!r} is already in flight on this connection",
                                         code=ErrorCode.duplicate_id, param="id").to_frame(cid))]
        if len(self.in_flight) >= self.max_inflight:
            return [Send(ValidationError(f"at most {self.max_inflight} requests may be in flight per connection",
                                         code=ErrorCode.too_many_requests).to_frame(cid))]
        return []

    def _resume(self, msg: dict[str, Any], cid: str | None) -> list[Output]:
        refused = self._admissible(cid)
        if refused:
            return refused
        if cid is None:
            return [Send(ValidationError("resume needs the string 'id' to answer under",
                                         code=ErrorCode.missing_field, param="id").to_frame(None))]
        try:
            rid, idx, token = resume_fields(msg)
        except ValidationError as exc:
            return [Send(exc.to_frame(cid))]
        self.in_flight[cid] = None
        return [Resume(cid, rid, idx, token)]

    def _generate(self, msg: dict[str, Any], cid: str | None) -> list[Output]:
        refused = self._admissible(cid)
        if refused:
            return refused
        try:
            valid = self.validator.check(msg)
        except StreamfleetError as exc:
            return [Send(exc.to_frame(cid))]
        self.in_flight[valid.client_id] = None
        return [Submit(valid)]

    def _embed(self, msg: dict[str, Any], cid: str | None) -> list[Output]:
        """An ``embed`` frame: the connection's limits as for ``generate``, its ``id`` as a
        generate frame's, the rest exactly an HTTP embeddings body (``check_embed``)."""
        assert self.check_embed is not None  # (``receive`` reads embed frames only with it)
        refused = self._admissible(cid)
        if refused:
            return refused
        try:
            client_id = msg.get("id")
            if client_id is None:
                raise ValidationError("field 'id' is required", code=ErrorCode.missing_field, param="id")
            if not isinstance(client_id, str) or not client_id or len(client_id) > MAX_ID_CHARS:
                raise ValidationError(f"'id' must be a non-empty string of at most {MAX_ID_CHARS} characters",
                                      code=ErrorCode.invalid_type, param="id")
            body = self.check_embed({k: v for k, v in msg.items() if k not in EMBED_FRAME_FIELDS})
        except StreamfleetError as exc:
            return [Send(exc.to_frame(cid))]
        self.in_flight[client_id] = None
        return [Embed(client_id, body)]

    def _cancel(self, cid: str | None) -> list[Output]:
        if cid is None:
            return [Send(ValidationError("cancel needs the string 'id' of a request", code=ErrorCode.missing_field,
                                         param="id").to_frame(None))]
        if cid not in self.in_flight:
            return [Send(ValidationError(f"no request with id {cid!r} is in flight", code=ErrorCode.unknown_id,
                                         param="id").to_frame(cid))]
        return [Cancel(cid)]

    def finished(self, client_id: str) -> None:
        """A request ended (its final frame was queued): its id may be reused."""
        self.in_flight.pop(client_id, None)
