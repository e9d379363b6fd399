"""The wire schema: every payload that crosses Redis, encoded in one place.

* ``Task``            gateway → worker, one entry (field ``task``) in a lane stream
* ``TokenEvent``,
  ``DoneEvent``,
  ``ErrorEvent``      worker → gateway, published on ``sf:reply:{connection_id}`` as a
                      JSON array (all events of one decode step for one connection)
* ``Cancel``          gateway → all workers, published on ``sf:cancel``
* ``Follow``          gateway → all workers, published on ``sf:follow``: a resumed
                      client follows a request on another reply channel
* ``Wake``            gateway → the model's workers, published on ``sf:wake:{model}``
                      by the enqueue script (``gateway/broker.py``) with the new entry's id
* ``RequestRecord``   gateway → gateways, ``sf:req:{request_id}``: who owns a request
                      and where it runs, written before the task is queued

All encodings are orjson; field names are spelled out so that ``redis-cli`` output
reads on its own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Union

import orjson

__all__ = [
    "FinishReason",
    "SamplingParams",
    "Task",
    "TokenEvent",
    "DoneEvent",
    "ErrorEvent",
    "Event",
    "Cancel",
    "Follow",
    "Wake",
    "RequestRecord",
    "encode_events",
    "decode_events",
    "event_from_dict",
    "live_workers",
]


class FinishReason(StrEnum):
    stop = "stop"
    length = "length"
    cancelled = "cancelled"


@dataclass(slots=True)
class SamplingParams:
    """How one request samples. ``temperature == 0`` means greedy.

    ``seed`` is always set by the time a task is enqueued (the gateway draws one when
    the client gave none), so a redelivered task regenerates the same tokens.
    """

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    seed: int = 0
    #: keep generating past EOS (fixed-length outputs for benchmarks and tests)
    ignore_eos: bool = False


@dataclass(slots=True)
class Task:
    """A validated inference request, as it sits in a lane stream."""

    request_id: str
    model: str
    lane: str
    reply_to: str  # connection id: events go to sf:reply:{reply_to}
    client_id: str  # the id the client chose (for logs only)
    prompt_ids: list[int]
    params: SamplingParams
    created_at: float  # unix seconds, set by the gateway
    deadline: float | None = None  # unix seconds; expired tasks are not run
    trace_id: str = ""
    #: the API key id whose stream slot (``sf:streams:{key_id}``) this request holds, ""
    #: for none: the worker gives the slot back when the request really ends
    slot: str = ""

    def encode(self) -> bytes:
        return orjson.dumps(self, option=orjson.OPT_SERIALIZE_DATACLASS)

    @classmethod
    def decode(cls, raw: bytes | str) -> "Task":
        """Parse a task; raises ``ValueError`` on anything malformed."""
        try:
            d = orjson.loads(raw)
            params = SamplingParams(**d.pop("params"))
            task = cls(params=params, **d)
        except (orjson.JSONDecodeError, TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"malformed task: {exc}") from exc
        return task


@dataclass(slots=True)
class TokenEvent:
    request_id: str
    index: int  # completion-token index, from 0
    text: str  # valid UTF-8; may be "" while a character or stop match is held back
    type: str = "token"


@dataclass(slots=True)
class DoneEvent:
    request_id: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    queue_ms: float = 0.0
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    model_version: str = ""
    type: str = "done"

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}

    def timing(self) -> dict[str, float]:
        return {
            "queue_ms": round(self.queue_ms, 3),
            "ttft_ms": round(self.ttft_ms, 3),
            "total_ms": round(self.total_ms, 3),
        }


@dataclass(slots=True)
class ErrorEvent:
    request_id: str
    code: str
    message: str
    type: str = "error"


Event = Union[TokenEvent, DoneEvent, ErrorEvent]

_EVENT_TYPES: dict[str, type] = {"token": TokenEvent, "done": DoneEvent, "error": ErrorEvent}


def event_from_dict(d: dict[str, Any]) -> Event:
    cls = _EVENT_TYPES[d["type"]]
    return cls(**d)


def encode_events(events: list[Event]) -> bytes:
    """One pub/sub message: the events of one step for one connection."""
    return orjson.dumps(events, option=orjson.OPT_SERIALIZE_DATACLASS)


def decode_events(raw: bytes | str) -> list[Event]:
    """Inverse of ``encode_events``; raises ``ValueError`` on malformed input."""
    try:
        items = orjson.loads(raw)
        if isinstance(items, dict):
            items = [items]
        return [event_from_dict(d) for d in items]
    except (orjson.JSONDecodeError, TypeError, KeyError) as exc:
        raise ValueError(f"malformed event message: {exc}") from exc


@dataclass(slots=True)
class Cancel:
    request_id: str
    reason: str = "client"

    def encode(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def decode(cls, raw: bytes | str) -> "Cancel":
        try:
            return cls(**orjson.loads(raw))
        except (orjson.JSONDecodeError, TypeError) as exc:
            raise ValueError(f"malformed cancel: {exc}") from exc


@dataclass(slots=True)
class Follow:
    """A client follows ``request_id`` on the reply channel of ``reply_to`` (a resume,
    possibly on another gateway): the worker running it publishes there too."""

    request_id: str
    reply_to: str

    def encode(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def decode(cls, raw: bytes | str) -> "Follow":
        try:
            d = orjson.loads(raw)
            out = cls(**d)
        except (orjson.JSONDecodeError, TypeError) as exc:
            raise ValueError(f"malformed follow message: {exc}") from exc
        if not isinstance(out.request_id, str) or not isinstance(out.reply_to, str):
            raise ValueError("malformed follow message: ids must be strings")
        return out


def stream_entry_id(entry: str) -> tuple[int, int]:
    """A stream entry id ``"<ms>-<seq>"`` as a comparable pair; ``ValueError`` if malformed."""
    ms, sep, seq = entry.partition("-")
    if not sep:
        raise ValueError(f"malformed stream entry id {entry!r}")
    return int(ms), int(seq)


@dataclass(frozen=True, slots=True)
class Wake:
    """A task was added to ``lane`` as stream entry ``entry_id``: ``b"<lane> <ms>-<seq>"``.
    Its producer is the enqueue script (``ENQUEUE_LUA``: ``ARGV[4] .. ' ' .. id``), which
    must write exactly what ``encode`` writes."""

    lane: str
    entry_id: tuple[int, int]

    def encode(self) -> bytes:
        return f"{self.lane} {self.entry_id[0]}-{self.entry_id[1]}".encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> "Wake":
        try:
            text = raw.decode() if isinstance(raw, bytes) else raw
            lane, entry = text.split(" ", 1)
            return cls(lane, stream_entry_id(entry))
        except (UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"malformed wake message {raw!r}: {exc}") from exc

    def is_new(self, last_read: dict[str, tuple[int, int]]) -> bool:
        """Whether the entry is newer than everything read from its lane so far."""
        return self.entry_id > last_read.get(self.lane, (0, 0))


@dataclass(slots=True)
class RequestRecord:
    """What a gateway knows of a request before any event exists (``sf:req:{request_id}``).

    ``owner`` is the tenant: the API key's id, or with auth off the identity of the
    connection that submitted it. ``deadline`` is the queue deadline (unix seconds).
    """

    request_id: str
    owner: str
    model: str
    reply_to: str
    created_at: float
    deadline: float
    prompt_tokens: int = 0

    def encode(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def decode(cls, raw: bytes | str) -> "RequestRecord":
        try:
            return cls(**orjson.loads(raw))
        except (orjson.JSONDecodeError, TypeError) as exc:
            raise ValueError(f"malformed request record: {exc}") from exc


def live_workers(raw: dict, ttl_s: float, now: float) -> list[dict[str, Any]]:
    """The fresh entries of a ``sf:workers:{model}`` hash (worker id -> heartbeat JSON),
    each with its ``worker_id``; unreadable or stale entries are left out.

    Args:
        raw: the hash as ``HGETALL`` returns it (bytes or str keys and values).
        ttl_s: a heartbeat older than this is dead.
        now: unix time, on the same clock the workers write.
    """
    out = []
    for wid, blob in raw.items():
        try:
            info = orjson.loads(blob)
            fresh = now - float(info.get("heartbeat", 0)) <= ttl_s
        except (orjson.JSONDecodeError, TypeError, ValueError, AttributeError):
            continue
        if fresh:
            info["worker_id"] = wid.decode() if isinstance(wid, bytes) else wid
            out.append(info)
    return out
