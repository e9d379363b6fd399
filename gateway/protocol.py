"""Per-connection WebSocket protocol state, without I/O (STYLE habit 2).

The adapter in ``gateway/ws.py`` feeds it client frames and worker events and carries
out what it returns:

* ``Send(frame)``             write a JSON frame to the client
* ``Submit(request, rid)``    enqueue a validated request (then call ``submitted`` or
                              ``submit_failed``)
* ``CancelUpstream(rid)``     tell the workers to stop a request

It guarantees, per request: ``accepted`` before any token, token indices in order and
each exactly once (duplicates from a redelivered task are dropped), exactly one final
``done`` or ``error``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Union

import orjson

from shared.errors import ErrorCode, StreamfleetError, ValidationError, error_from_code
from shared.schema import DoneEvent, ErrorEvent, Event, TokenEvent

__all__ = ["Send", "Submit", "CancelUpstream", "Output", "RequestState", "ConnectionProtocol"]


@dataclass(slots=True)
class Send:
    frame: dict[str, Any]


@dataclass(slots=True)
class Submit:
    request: Any  # gateway.validation.ValidRequest
    request_id: str


@dataclass(slots=True)
class CancelUpstream:
    request_id: str


Output = Union[Send, Submit, CancelUpstream]


@dataclass(slots=True)
class RequestState:
    client_id: str
    request_id: str
    accepted: bool = False
    cancelled: bool = False
    next_index: int = 0
    prompt_tokens: int = 0
    #: events that arrived before ``accepted`` was sent
    early: list[Event] = field(default_factory=list)


class ConnectionProtocol:
    """State of one client connection.

    Args:
        validator: a ``gateway.validation.Validator``.
        max_inflight: most concurrent requests on this connection.
        max_frame_bytes: largest text frame accepted.
    """

    def __init__(self, validator: Any, *, max_inflight: int = 64, max_frame_bytes: int = 1 << 20) -> None:
        self.validator = validator
        self.max_inflight = max_inflight
        self.max_frame_bytes = max_frame_bytes
        self.by_client: dict[str, RequestState] = {}
        self.by_request: dict[str, RequestState] = {}
        #: indices dropped as duplicates (redelivery), for metrics and tests
        self.duplicates_dropped = 0
        self.gaps_seen = 0

    # -- client → server ----------------------------------------------------------
    def receive_bytes(self, data: bytes) -> list[Output]:
        return [Send(ValidationError("binary frames are not supported; send JSON text frames",
                                     code=ErrorCode.binary_frame).to_frame(None))]

    def receive_text(self, text: str) -> list[Output]:
        if len(text) > self.max_frame_bytes:
            return [Send(ValidationError(f"frame of {len(text)} bytes exceeds the limit of {self.max_frame_bytes}",
                                         code=ErrorCode.frame_too_large).to_frame(None))]
        try:
            msg = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            return [Send(ValidationError(f"frame is not valid JSON: {exc.msg}",
                                         code=ErrorCode.invalid_json).to_frame(None))]
        if not isinstance(msg, dict):
            return [Send(ValidationError("a frame must be a JSON object", code=ErrorCode.invalid_frame).to_frame(None))]
        kind = msg.get("type")
        cid = msg.get("id") if isinstance(msg.get("id"), str) else None
        if kind == "generate":
            return self._generate(msg, cid)
        if kind == "cancel":
            return self._cancel(msg, cid)
        if kind == "ping":
            return [Send({"type": "pong"})]
        if kind == "resume":
            return [Send(ValidationError("resume is not supported by this gateway yet",
                                         code=ErrorCode.unknown_type, param="type").to_frame(cid))]
        if not isinstance(kind, str):
            return [Send(ValidationError("field 'type' must be a string", code=ErrorCode.invalid_frame,
                                         param="type").to_frame(cid))]
        shown = kind if len(kind) <= 32 else kind[:32] + "…"
        return [Send(ValidationError(f"unknown frame type {shown!r}; expected generate, cancel, resume or ping",
                                     code=ErrorCode.unknown_type, param="type").to_frame(cid))]

    def _generate(self, msg: dict[str, Any], cid: str | None) -> list[Output]:
        if cid is not None and cid in self.by_client:
            return [Send(ValidationError(f"a request with id {cid!r} is already in flight on this connection",
                                         code=ErrorCode.duplicate_id, param="id").to_frame(cid))]
        if len(self.by_client) >= self.max_inflight:
            return [Send(ValidationError(f"at most {self.max_inflight} requests may be in flight per connection",
                                         code=ErrorCode.too_many_requests).to_frame(cid))]
        try:
            valid = self.validator.generate(msg)
        except StreamfleetError as exc:
            return [Send(exc.to_frame(cid))]
        rid = uuid.uuid4().hex
        st = RequestState(client_id=valid.client_id, request_id=rid, prompt_tokens=len(valid.prompt_ids))
        self.by_client[st.client_id] = st
        self.by_request[rid] = st
        return [Submit(valid, rid)]

    def _cancel(self, msg: dict[str, Any], cid: str | None) -> list[Output]:
        if cid is None:
            return [Send(ValidationError("cancel needs the string 'id' of a request", code=ErrorCode.missing_field,
                                         param="id").to_frame(None))]
        st = self.by_client.get(cid)
        if st is None:
            return [Send(ValidationError(f"no request with id {cid!r} is in flight", code=ErrorCode.unknown_id,
                                         param="id").to_frame(cid))]
        if st.cancelled:
            return []
        st.cancelled = True
        return [CancelUpstream(st.request_id)]

    # -- results of Submit ----------------------------------------------------------
    def submitted(self, request_id: str, queue_depth: int) -> list[Output]:
        st = self.by_request.get(request_id)
        if st is None:
            return []
        st.accepted = True
        out: list[Output] = [Send({"type": "accepted", "id": st.client_id, "request_id": request_id,
                                   "queue_depth": queue_depth})]
        early, st.early = st.early, []
        out.extend(self.receive_events(early))
        return out

    def submit_failed(self, request_id: str, error: StreamfleetError) -> list[Output]:
        st = self._forget(request_id)
        return [Send(error.to_frame(st.client_id))] if st else []

    def fail(self, request_id: str, error: StreamfleetError) -> list[Output]:
        """End an accepted request with an error the gateway decided on."""
        return self.submit_failed(request_id, error)

    # -- worker → client ------------------------------------------------------------
    def receive_events(self, events: list[Event]) -> list[Output]:
        out: list[Output] = []
        for ev in events:
            st = self.by_request.get(ev.request_id)
            if st is None:
                continue
            if not st.accepted:
                st.early.append(ev)
                continue
            if isinstance(ev, TokenEvent):
                if ev.index < st.next_index:
                    self.duplicates_dropped += 1
                    continue
                if ev.index > st.next_index:
                    self.gaps_seen += 1
                st.next_index = ev.index + 1
                out.append(Send({"type": "token", "id": st.client_id, "index": ev.index, "text": ev.text}))
            elif isinstance(ev, DoneEvent):
                self._forget(ev.request_id)
                out.append(Send({"type": "done", "id": st.client_id, "request_id": ev.request_id,
                                 "finish_reason": ev.finish_reason, "usage": ev.usage(), "timing": ev.timing()}))
            elif isinstance(ev, ErrorEvent):
                self._forget(ev.request_id)
                out.append(Send(error_from_code(ev.code, ev.message).to_frame(st.client_id)))
        return out

    def cancel_expired(self, request_id: str) -> list[Output]:
        """A cancel got no answer from any worker in time (for example the task is
        still queued with no live worker): end the request here."""
        st = self.by_request.get(request_id)
        if st is None or not st.cancelled:
            return []
        done = DoneEvent(request_id=request_id, finish_reason="cancelled", prompt_tokens=st.prompt_tokens,
                         completion_tokens=st.next_index)
        if not st.accepted:
            st.accepted = True
        return self.receive_events([done])

    # -- lifecycle --------------------------------------------------------------------
    def in_flight(self) -> list[str]:
        return list(self.by_request)

    def close(self) -> list[Output]:
        """The client went away: cancel whatever it still had running."""
        out: list[Output] = [CancelUpstream(rid) for rid, st in self.by_request.items() if not st.cancelled]
        self.by_client.clear()
        self.by_request.clear()
        return out

    def _forget(self, request_id: str) -> RequestState | None:
        st = self.by_request.pop(request_id, None)
        if st is not None:
            self.by_client.pop(st.client_id, None)
        return st
