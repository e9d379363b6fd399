"""Server-sent events as the OpenAI door writes them: one ``data:`` line per event (a JSON
object, or OpenAI's closing ``[DONE]``), comment lines as keepalives, and the ``id:`` a
single-choice stream puts on each token's event so that a client that reconnects with
``Last-Event-ID`` continues where it left off.

Framing only: what goes in each event is ``gateway/protocols/openai_mapping.py``'s, when to send it
``gateway/doors/openai.py``'s.
"""

from __future__ import annotations

from typing import Any

import orjson

from streamfleet.shared.errors import ErrorCode, ValidationError

__all__ = ["SSE_HEADERS", "KEEPALIVE", "DONE", "sse_frame", "event_id", "parse_last_event_id"]

#: no caching, and no buffering by a proxy in between (nginx reads ``X-Accel-Buffering``)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: a comment line: keeps idle connections (and the proxies on the way) from timing out
KEEPALIVE = b": keepalive\n\n"
#: OpenAI's end of a stream
DONE = b"data: [DONE]\n\n"


def sse_frame(data: dict[str, Any] | str, event_id: str | None = None) -> bytes:
    """One event: ``data`` (a dict as compact JSON, a string as it is), with an ``id:``
    line when ``event_id`` is given."""
    head = f"id: {event_id}\n".encode() if event_id is not None else b""
    body = data.encode() if isinstance(data, str) else orjson.dumps(data)
    return head + b"data: " + body + b"\n\n"


def event_id(request_id: str, resume_token: str | None, index: int) -> str:
    """An SSE ``id:``: ``<request_id>:<index>``, with auth off ``<request_id>:<resume_token>:<index>``
    (the token proves the reconnecting client is the one the stream was sent to)."""
    if resume_token:
        return f"{request_id}:{resume_token}:{index}"
    return f"{request_id}:{index}"


def parse_last_event_id(raw: str | None) -> tuple[str, str | None, int] | None:
    """``(request_id, resume_token, index)`` of a reconnecting client's ``Last-Event-ID``
    header, as ``event_id`` wrote it; None when there is none.

    Raises:
        ValidationError: ``invalid_request``, naming ``Last-Event-ID``, for anything
            ``event_id`` does not write.
    """
    if not raw:
        return None
    parts = raw.strip().split(":")
    token = parts[1] if len(parts) == 3 else None
    rid, idx = parts[0], parts[-1]
    if len(parts) not in (2, 3) or not rid or not rid.isalnum() or len(rid) > 64 or not idx.isdigit() \
            or len(idx) > 9 or (token is not None and (not token.isalnum() or len(token) > 64)):
        raise ValidationError("Last-Event-ID must be the last 'id:' line the stream sent",
                              code=ErrorCode.invalid_request, param="Last-Event-ID")
    return rid, token, int(idx)
