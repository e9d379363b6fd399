"""The wire schema: every payload that crosses Redis, encoded in one place.

* ``Task``            gateway → worker, one entry (field ``task``) in a lane stream
* ``EmbedTask``       gateway → worker, as ``Task``: an embedding model's inputs (token ids)
* ``StartedEvent``,
  ``TokenEvent``,
  ``PromptEvent``,
  ``EmbeddingEvent``,
  ``DoneEvent``,
  ``ErrorEvent``      worker → gateway, published on ``sf:reply:{connection_id}`` as a
                      JSON array (all events of one decode step for one connection)
* ``Cancel``          gateway → all workers, published on ``sf:cancel``
* ``Follow``          gateway → all workers, published on ``sf:follow``: a resumed
                      client follows a request on another reply channel
* ``Wake``            gateway → the model's workers, published on ``sf:wake:{model}``
                      by the enqueue script (``gateway/requests/broker.py``) with the new entry's id
* ``RequestRecord``   gateway → gateways, ``sf:req:{request_id}``: who owns a request
                      and where it runs, written before the task is queued
* ``StoredResponse``  gateway → gateways, ``sf:resp:{response_id}``: a finished response
                      of the Responses API, its owner and its conversation
* ``LogEntry``        worker → gateways and workers, one entry of ``sf:log:{request_id}``:
                      an event (``encode_event``) and, for a token, its id
* ``Attach``          gateway → workers, a member of ``sf:attach:{request_id}``: a
                      connection that resumed the request, scored by its expiry
* ``AudioChunk``      gateway → worker, one entry of ``sf:audio:{request_id}``: a piece
                      of an utterance's PCM, or its end marker
* ``Heartbeat``       worker → gateways, workers and ``streamfleet status``, the worker's
                      field of ``sf:workers:{model}``
* ``DeadLetter``      worker → operators, one entry of ``sf:{model}:dead``
* ``KeyRecord``       ``streamfleet keys`` → gateways, a field of ``sf:keys``
* plan records      engine builds → ``streamfleet engines list``, ``sf:plans:{model}``
                      (``encode_plan_record`` / ``decode_plan_record``)

Each has one encoder and one decoder, here; ``tests/integration/test_wire_formats.py``
feeds every real producer's output to its real consumer.

All encodings are orjson; field names are spelled out so that ``redis-cli`` output
reads on its own.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar, TypeGuard

import orjson

from streamfleet.shared.errors import RequestError, error_from_code

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import ArrayLike, NDArray
    from redis.typing import EncodableT, FieldT

__all__ = [
    "AudioInput",
    "AudioChunk",
    "FinishReason",
    "SamplingParams",
    "DEFAULT_TEMPERATURE",
    "Task",
    "SpeechTask",
    "EmbedTask",
    "AnyTask",
    "decode_task",
    "StartedEvent",
    "TokenEvent",
    "PromptEvent",
    "DoneEvent",
    "ErrorEvent",
    "TranscriptEvent",
    "EmbeddingEvent",
    "PROGRESS",
    "ENDS",
    "Event",
    "Cancel",
    "Follow",
    "Wake",
    "RequestRecord",
    "StoredResponse",
    "LogEntry",
    "Attach",
    "Heartbeat",
    "DeadLetter",
    "KeyRecord",
    "encode_event",
    "DEFAULT_MAX_TOKENS",
    "MAX_SEED",
    "MAX_TOP_LOGPROBS",
    "RANGES",
    "sampling_problem",
    "is_number",
    "encode_events",
    "decode_events",
    "event_from_dict",
    "live_workers",
    "stream_entry_id",
    "encode_plan_record",
    "decode_plan_record",
]


class FinishReason(StrEnum):
    stop = "stop"
    length = "length"
    cancelled = "cancelled"


#: the temperature of a request that names none, on every door: the WebSocket, the OpenAI
#: API and gRPC (OpenAI's default; docs/sampling.md)
DEFAULT_TEMPERATURE = 1.0
#: ``max_tokens`` of a request that names none, on every door (a tier's ceiling may lower
#: it; ``SF_DEFAULT_MAX_TOKENS`` sets a gateway's)
DEFAULT_MAX_TOKENS = 64


@dataclass(slots=True)
class SamplingParams:
    """How one request samples. ``temperature == 0`` means greedy.

    ``seed`` is always set by the time a task is enqueued (the gateway draws one when
    the client gave none), so a redelivered task regenerates the same tokens.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    seed: int = 0
    #: keep generating past EOS (fixed-length outputs for benchmarks and tests)
    ignore_eos: bool = False
    # -- logits processing, applied to the whole batch's logits each step (workers/logits.py)
    #: OpenAI's: subtracted once from the logit of every token generated so far
    presence_penalty: float = 0.0
    #: OpenAI's: subtracted per occurrence from the logit of every token generated so far
    frequency_penalty: float = 0.0
    #: CTRL's (as vLLM and transformers): the logit of every token of the prompt or the
    #: output so far is divided by it when positive, multiplied by it when negative
    repetition_penalty: float = 1.0
    #: ``[token_id, bias]`` pairs added to those tokens' logits (OpenAI's ``logit_bias``)
    logit_bias: list[list[float]] = field(default_factory=list)
    #: tokens below ``min_p`` times the most likely token's probability are never drawn
    min_p: float = 0.0
    #: tokens that end the sequence like EOS (not part of the output)
    stop_token_ids: list[int] = field(default_factory=list)
    #: EOS and ``stop_token_ids`` cannot be drawn before this many tokens
    min_tokens: int = 0
    #: None: no log probabilities; k >= 0: each token's, with the k most likely
    logprobs: int | None = None
    #: None: none; k >= 0: the log probability of each prompt token after the first, with
    #: the k most likely, computed as the prompt is fed (``PromptEvent``; vLLM's name: the
    #: OpenAI door's ``echo`` with ``logprobs``). Left off the wire when None
    prompt_logprobs: int | None = None
    #: an llguidance grammar the output must match ("" for none): structured outputs
    #: (shared/grammar.py); the sequence ends when the grammar is complete
    grammar: str = ""
    #: a stop string that ends the output stays at its end (vLLM's); off: cut before it.
    #: Left off the wire when off (docs/architecture.md, "Adding a field to a request")
    include_stop_str_in_output: bool = False

    @property
    def processed(self) -> bool:
        """Whether the logits go through a processor before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_p or self.min_tokens)


#: the largest seed a request may name
MAX_SEED = 2**63 - 1
#: most alternatives ``top_logprobs`` may ask for (OpenAI's limit)
MAX_TOP_LOGPROBS = 20
#: the inclusive range of each numeric sampling parameter (docs/sampling.md). The gateway
#: refuses a value outside it, naming the parameter; a worker re-checks every task it
#: takes against the same table (``sampling_problem``), never trusting the gateway's word
RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),  # (the gateway also refuses 0: nothing could be drawn)
    "top_k": (0, 1_000_000),
    "seed": (0, MAX_SEED),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "repetition_penalty": (0.01, 10.0),
    "min_p": (0.0, 1.0),
    "logit_bias": (-100.0, 100.0),  # each bias
    "logprobs": (0, MAX_TOP_LOGPROBS),  # the alternatives per token
}


def is_number(v: object) -> TypeGuard[int | float]:
    """A finite JSON number: an int or a float, not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _number(v: object, name: str) -> bool:
    lo, hi = RANGES[name]
    return is_number(v) and lo <= v <= hi


def _integer(v: object, name: str) -> bool:
    lo, hi = RANGES[name]
    return type(v) is int and lo <= v <= hi


def sampling_problem(p: SamplingParams, vocab_size: int) -> str | None:
    """What is wrong with ``p`` for a model of ``vocab_size`` tokens by the rules every
    request obeys (``RANGES``, token ids in the vocabulary), or None. A worker runs it
    on every task it takes; the gateway's validation refused all of it already, by name."""

    def token(t: object) -> bool:
        return type(t) is int and 0 <= t < vocab_size

    def in_range(name: str) -> str:
        lo, hi = RANGES[name]
        return f"{name} must be in [{lo:g}, {hi:g}]"

    if not (type(p.max_tokens) is int and p.max_tokens >= 0):
        return "max_tokens must be an integer >= 0"
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        if not _number(getattr(p, name), name):
            return in_range(name)
    for name in ("top_k", "seed"):
        if not _integer(getattr(p, name), name):
            return in_range(name)
    if not (isinstance(p.stop, list) and all(isinstance(s, str) for s in p.stop)):
        return "stop must be a list of strings"
    if not (type(p.min_tokens) is int and p.min_tokens >= 0):
        return "min_tokens must be an integer >= 0"
    if not (isinstance(p.logit_bias, list) and all(
            isinstance(e, list) and len(e) == 2 and token(e[0]) and _number(e[1], "logit_bias") for e in p.logit_bias)):
        lo, hi = RANGES["logit_bias"]
        return (f"logit_bias must map token ids (from 0 to {vocab_size - 1}: the vocabulary size is {vocab_size}) "
                f"to numbers from {lo:g} to {hi:g}")
    if not isinstance(p.grammar, str) or (p.grammar and p.ignore_eos):
        return "grammar must be a string, and cannot be combined with ignore_eos"
    if not (isinstance(p.stop_token_ids, list) and all(token(t) for t in p.stop_token_ids)):
        return f"stop_token_ids must be token ids from 0 to {vocab_size - 1} (the vocabulary size is {vocab_size})"
    if p.logprobs is not None and not _integer(p.logprobs, "logprobs"):
        return f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]"
    if p.prompt_logprobs is not None and not _integer(p.prompt_logprobs, "logprobs"):
        return f"prompt_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]"
    if type(p.include_stop_str_in_output) is not bool:
        return "include_stop_str_in_output must be true or false"
    return None


@dataclass(slots=True)
class AudioInput:
    """What a speech task transcribes: one utterance of a voice connection, whose audio
    the gateway appends to ``sf:audio:{request_id}`` (``AudioChunk`` entries) while the
    client speaks (docs/voice.md)."""

    sample_rate: int = 16000
    encoding: str = "pcm_s16le"
    language: str = ""
    #: the utterance's number on its connection, from 0
    utterance: int = 0
    #: where the utterance starts in the connection's audio, ms
    start_ms: int = 0


@dataclass(slots=True)
class Task:
    """A validated text-generation request, as it sits in a lane stream."""

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
    #: the choices of one request (``n``): the first choice's request id and how many
    #: there are; a worker prefills their prompt once (``WorkerCore._prefill``)
    group: str = ""
    group_size: int = 1
    #: the tenant whose fair share it counts against (shared/fairshare.py; "" for none) and
    #: what each generated token adds to that tenant's counter; left off the wire when unset
    tenant: str = ""
    token_cost: float = 0.0
    #: the API key whose token rate limit (its tier's ``tokens_per_minute``,
    #: shared/tokenbucket.py) the tokens it generates are charged to when it ends, with
    #: that bucket's refill (tokens a second) and capacity; left off the wire when unset
    token_limit: str = ""
    token_rate: float = 0.0
    token_burst: int = 0
    #: not on the wire: a lane entry without ``kind`` is text
    kind: ClassVar[str] = "text"

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    def encode(self) -> bytes:
        """The lane entry; ``params.prompt_logprobs`` is left out when None (most tasks:
        a task that does not ask for it reads the same to a worker that predates it)."""
        if self.params.prompt_logprobs is not None and self.params.include_stop_str_in_output:
            return orjson.dumps(self, option=orjson.OPT_SERIALIZE_DATACLASS)
        return orjson.dumps(self, default=_task_fields, option=orjson.OPT_PASSTHROUGH_DATACLASS)

    @classmethod
    def decode(cls, raw: bytes | str) -> Task:
        """Parse a text task; raises ``ValueError`` on anything malformed or not text."""
        task = decode_task(raw)
        if not isinstance(task, Task):
            raise ValueError(f"malformed task: a {task.kind} task where a text task was expected")
        return task


@dataclass(slots=True)
class SpeechTask:
    """A validated speech request, as it sits in a speech model's lane: one utterance of
    a voice connection, whose audio arrives in ``sf:audio:{request_id}`` while the client
    speaks (docs/voice.md). It has no prompt and no sampling parameters; its worker answers
    with partial hypotheses and a final transcript."""

    request_id: str
    model: str
    lane: str
    reply_to: str  # connection id: events go to sf:reply:{reply_to}
    client_id: str  # the id the client chose (for logs only)
    audio: AudioInput
    created_at: float  # unix seconds, set by the gateway
    deadline: float | None = None  # unix seconds; expired tasks are not run
    trace_id: str = ""
    #: the API key id whose stream slot this utterance holds ("" for none), as for text
    slot: str = ""
    kind: str = "speech"
    #: as a text task's: its tenant, and what one token of its audio (a second is
    #: ``shared.tiers.AUDIO_TOKENS_PER_S`` of them) adds to the tenant's counter, charged
    #: when it ends; the API key whose token rate limit its audio is charged to, with that
    #: bucket's refill and capacity
    tenant: str = ""
    token_cost: float = 0.0
    token_limit: str = ""
    token_rate: float = 0.0
    token_burst: int = 0

    @property
    def prompt_tokens(self) -> int:
        return 0

    def encode(self) -> bytes:
        return orjson.dumps(self, option=orjson.OPT_SERIALIZE_DATACLASS)


@dataclass(slots=True)
class EmbedTask:
    """A validated embeddings request (``POST /v1/embeddings``), as it sits in an embedding
    model's lane: its inputs as token ids (special tokens included; the gateway tokenized
    and checked them), embedded together by the worker's ``workers.embedcore.EmbeddingCore``,
    which answers with one ``EmbeddingEvent`` per input and a ``DoneEvent``. No sampling:
    a redelivered task is embedded again from its first input."""

    request_id: str
    model: str
    lane: str
    reply_to: str  # connection id: events go to sf:reply:{reply_to}
    client_id: str  # the id the client chose (for logs only)
    inputs: list[list[int]]
    created_at: float  # unix seconds, set by the gateway
    deadline: float | None = None  # unix seconds; expired tasks are not run
    trace_id: str = ""
    #: the API key id whose stream slot this request holds ("" for none), as for text
    slot: str = ""
    kind: str = "embed"

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.inputs)

    def encode(self) -> bytes:
        return orjson.dumps(self, option=orjson.OPT_SERIALIZE_DATACLASS)


#: what a lane holds: a text task, a speech model's utterance, or an embedding model's inputs
AnyTask = Task | SpeechTask | EmbedTask


def _task_fields(obj: object) -> dict[str, Any]:
    """A text task's dataclasses as ``Task.encode`` writes them (``default`` of
    ``orjson.dumps`` with ``OPT_PASSTHROUGH_DATACLASS``): every field, but a
    ``SamplingParams``'s ``prompt_logprobs`` when None."""
    if type(obj) is SamplingParams:
        d = {name: getattr(obj, name) for name in _PARAM_FIELDS}
        if obj.prompt_logprobs is None:
            del d["prompt_logprobs"]
        if not obj.include_stop_str_in_output:
            del d["include_stop_str_in_output"]
        return d
    if type(obj) is Task:
        d = {name: getattr(obj, name) for name in _TASK_FIELDS}
        if not obj.tenant:
            del d["tenant"], d["token_cost"]
        if not obj.token_limit:
            del d["token_limit"], d["token_rate"], d["token_burst"]
        return d
    raise TypeError(f"{type(obj).__name__} is not part of a task")


_PARAM_FIELDS = tuple(f.name for f in fields(SamplingParams))
_TASK_FIELDS = tuple(f.name for f in fields(Task))


def decode_task(raw: bytes | str) -> AnyTask:
    """Parse a lane entry's task by its ``kind`` (a task without one is text, or speech
    when it carries ``audio``, as gateways before the speech type wrote them); raises
    ``ValueError`` on anything malformed."""
    try:
        d = orjson.loads(raw)
        if not isinstance(d, dict):
            raise TypeError("not an object")
        kind = d.pop("kind", None) or ("speech" if d.get("audio") is not None else "text")
        if kind == "embed":
            inputs = d.get("inputs")
            if not isinstance(inputs, list) or not all(isinstance(i, list) for i in inputs):
                raise TypeError("an embed task's inputs must be lists of token ids")
            return EmbedTask(**d)
        if kind == "speech":
            for legacy in ("prompt_ids", "params", "group", "group_size"):
                d.pop(legacy, None)
            return SpeechTask(audio=AudioInput(**d.pop("audio")), **d)
        if kind != "text":
            raise ValueError(f"malformed task: unknown kind {kind!r}")
        if d.pop("audio", None) is not None:
            raise TypeError("a text task with audio")
        return Task(params=SamplingParams(**d.pop("params")), **d)
    except (orjson.JSONDecodeError, TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"malformed task: {exc}") from exc


@dataclass(slots=True)
class StartedEvent:
    """A worker took the request and is computing its prompt: sent when the step that
    started it did not give its first token (a prompt fed in chunks, or waiting for the
    same prompt's prefill), and again while the prompt is still being fed (every
    ``workers.core.ANNOUNCE_EVERY_S``). From it on the gateway runs the request under the
    rules of a running one, not its queue deadline (docs/admission.md, "Queue
    deadlines"). Never delivered to a client. ``prefilled`` of ``prompt_tokens`` prompt
    tokens are in the worker's cache (its prefix cache's included).

    A gateway older than this event drops the message that carries it (an unknown type),
    so a worker publishes it in a message of its own (``workers.publisher``)."""

    request_id: str
    prefilled: int = 0
    prompt_tokens: int = 0
    type: str = "started"


@dataclass(slots=True)
class TokenEvent:
    request_id: str
    index: int  # completion-token index, from 0
    text: str  # valid UTF-8; may be "" while a character or stop match is held back
    #: asked for (``SamplingParams.logprobs``): the token and its log probability, with the
    #: most likely alternatives (``workers.logits.TokenTable.entry``)
    logprobs: dict[str, Any] | None = None
    type: str = "token"


@dataclass(slots=True)
class PromptEvent:
    """The log probabilities of some of a prompt's tokens (``SamplingParams.prompt_logprobs``),
    sent as the worker feeds the prompt chunk by chunk, before the request's first
    ``TokenEvent``: ``logprobs[j]`` is prompt position ``start + j``'s entry, as a
    ``TokenEvent.logprobs`` without ``bytes`` (``workers.logits.TokenTable.prompt_entry``:
    ``id``, ``token``, ``logprob``, ``top``); position 0's has only ``id`` and ``token``
    (nothing predicts the first token). The gateway delivers each position once, in
    order, and every one before the first token (``gateway.requests.request_stream``)."""

    request_id: str
    start: int
    logprobs: list[dict[str, Any]]
    type: str = "prompt"


@dataclass(slots=True)
class TranscriptEvent:
    """A speech utterance's transcript so far: each one replaces the one before, and the
    ``final`` one, after the audio's end, is what the utterance said. Indexed from 0 like
    a text request's tokens, so the gateway delivers each once and in order; the
    utterance's ``DoneEvent`` counts them in ``completion_tokens``."""

    request_id: str
    index: int
    text: str
    final: bool = False
    type: str = "transcript"


@dataclass(slots=True)
class EmbeddingEvent:
    """One input's vector of an embeddings request: ``index`` is the input's (from 0, so
    the gateway delivers each once and in order, as tokens), ``vector`` its float32 values,
    little-endian, in base64 (a third of the bytes of JSON numbers, on pub/sub and in the
    request log, and exact). The task's ``DoneEvent`` follows the last one, in the same
    message (``workers.embedcore``)."""

    request_id: str
    index: int
    vector: str
    type: str = "embedding"

    @staticmethod
    def pack(values: ArrayLike) -> str:
        """A float32 vector (anything ``numpy.asarray`` takes) as ``vector`` holds it."""
        import numpy as np

        return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")

    def values(self) -> NDArray[np.float32]:
        """The vector as a numpy float32 array."""
        import numpy as np

        return np.frombuffer(base64.b64decode(self.vector), dtype="<f4")


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
    #: prompt tokens the worker's prefix cache had (not prefilled again); left off the
    #: wire when 0
    cached_tokens: int = 0
    #: seconds of audio an utterance's worker transcribed (what its tenant is charged);
    #: left off the wire when 0
    audio_s: float = 0.0

    def usage(self) -> dict[str, int]:
        """The WebSocket ``done`` frame's usage: ``cached_tokens`` only when some were."""
        u = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}
        if self.cached_tokens:
            u["cached_tokens"] = self.cached_tokens
        return u

    def timing(self) -> dict[str, float]:
        return {
            "queue_ms": round(self.queue_ms, 3),
            "ttft_ms": round(self.ttft_ms, 3),
            "total_ms": round(self.total_ms, 3),
        }

    @property
    def timed(self) -> bool:
        """Whether it carries timings: a worker's end does; one the gateway made itself
        (``RequestStream.end_cancelled``: a cancel no worker answered) has all three 0,
        and clients are sent an empty ``timing``."""
        return bool(self.queue_ms or self.ttft_ms or self.total_ms)


@dataclass(slots=True)
class ErrorEvent:
    request_id: str
    code: str
    message: str
    #: the retry hint and the request field at fault of the ``StreamfleetError`` it stands
    #: for (``error``): set on the failures the gateway decides itself
    #: (``RequestStream.fail``); left off the wire when unset, as every worker's are
    retry_after_ms: int | None = None
    param: str | None = None
    type: str = "error"

    def error(self) -> RequestError:
        """The typed error of its code (class, HTTP status; an unknown code is ``internal``)."""
        return error_from_code(self.code, self.message, retry_after_ms=self.retry_after_ms, param=self.param)


Event = StartedEvent | TokenEvent | PromptEvent | TranscriptEvent | EmbeddingEvent | DoneEvent | ErrorEvent
#: the events that carry a request's output, indexed from 0 (delivered once each, in order)
PROGRESS = (TokenEvent, TranscriptEvent, EmbeddingEvent)
#: the events that end a request: exactly one, last
ENDS = (DoneEvent, ErrorEvent)

_EVENT_TYPES: dict[str, Callable[..., Event]] = {"started": StartedEvent, "token": TokenEvent, "prompt": PromptEvent,
                                  "transcript": TranscriptEvent, "embedding": EmbeddingEvent, "done": DoneEvent,
                                  "error": ErrorEvent}


def event_from_dict(d: dict[str, Any]) -> Event:
    cls = _EVENT_TYPES[d["type"]]
    return cls(**d)


def _wire(ev: Event) -> Event | dict[str, Any]:
    """A token without log probabilities leaves the field out (most tokens: bytes saved on
    every publish and log entry), an error its unset retry hint and param, an end its
    ``cached_tokens`` and ``audio_s`` when 0."""
    if type(ev) is TokenEvent and ev.logprobs is None:
        return {"request_id": ev.request_id, "index": ev.index, "text": ev.text, "type": "token"}
    if type(ev) is ErrorEvent and ev.retry_after_ms is None and ev.param is None:
        return {"request_id": ev.request_id, "code": ev.code, "message": ev.message, "type": "error"}
    if type(ev) is DoneEvent and not ev.cached_tokens and not ev.audio_s:
        return {"request_id": ev.request_id, "finish_reason": ev.finish_reason, "prompt_tokens": ev.prompt_tokens,
                "completion_tokens": ev.completion_tokens, "queue_ms": ev.queue_ms, "ttft_ms": ev.ttft_ms,
                "total_ms": ev.total_ms, "model_version": ev.model_version, "type": "done"}
    return ev


def encode_events(events: list[Event]) -> bytes:
    """One pub/sub message: the events of one step for one connection."""
    return orjson.dumps([_wire(e) for e in events], option=orjson.OPT_SERIALIZE_DATACLASS)


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
        return orjson.dumps(self)

    @classmethod
    def decode(cls, raw: bytes | str) -> Cancel:
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
        return orjson.dumps(self)

    @classmethod
    def decode(cls, raw: bytes | str) -> Follow:
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
    Its producer is the enqueue script (``shared.fairshare.ENQUEUE_LUA``: ``ARGV[3] .. ' '
    .. id``, or the lane's name ``ARGV[10]`` for a task moved into the lane), which must
    write exactly what ``encode`` writes. A task sent to one worker's affinity
    stream (prefix-aware routing) names that worker: ``lane`` is then its source,
    ``"<lane>@<worker id>"`` (``shared.keys.affinity_source``)."""

    lane: str
    entry_id: tuple[int, int]

    @property
    def worker(self) -> str:
        """The worker the task was sent to; "" for a shared lane's."""
        return self.lane.partition("@")[2]

    def encode(self) -> bytes:
        return f"{self.lane} {self.entry_id[0]}-{self.entry_id[1]}".encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> Wake:
        try:
            text = raw.decode() if isinstance(raw, bytes) else raw
            lane, entry = text.rsplit(" ", 1)
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
        return orjson.dumps(self)  # a dataclass, written as asdict would (without its deep copy)

    @classmethod
    def decode(cls, raw: bytes | str) -> RequestRecord:
        try:
            return cls(**orjson.loads(raw))
        except (orjson.JSONDecodeError, TypeError) as exc:
            raise ValueError(f"malformed request record: {exc}") from exc


@dataclass(slots=True)
class StoredResponse:
    """A finished response of the Responses API (``sf:resp:{response_id}``, with a TTL),
    gateway → gateways: its ``owner`` (the tenant, as ``RequestRecord.owner``: the API
    key's; "" with auth off), the response object as ``GET /v1/responses/{id}`` returns
    it, and ``input``, the conversation's items before its output (without
    ``instructions``, which a continuation does not carry over), which
    ``previous_response_id`` continues from (``gateway/protocols/responses_mapping.py``)."""

    owner: str
    response: dict[str, Any]
    input: list[dict[str, Any]]

    def encode(self) -> bytes:
        return orjson.dumps(self)

    @classmethod
    def decode(cls, raw: bytes | str) -> StoredResponse:
        try:
            return cls(**orjson.loads(raw))
        except (orjson.JSONDecodeError, TypeError) as exc:
            raise ValueError(f"malformed stored response: {exc}") from exc


def encode_event(ev: Event) -> bytes:
    """One event alone: the body of its request-log entry (field ``e``)."""
    return orjson.dumps(_wire(ev), option=orjson.OPT_SERIALIZE_DATACLASS)


@dataclass(slots=True)
class LogEntry:
    """One entry of a request's log (``sf:log:{request_id}``, a stream): the event
    (field ``e``) and, for a token, its id (field ``t``), which a worker taking the
    request over replays instead of generating it again."""

    event: Event
    token_id: int | None = None

    def fields(self) -> list[bytes | int]:
        """Field/value pairs for ``XADD``, in order."""
        out: list[bytes | int] = [b"e", encode_event(self.event)]
        if self.token_id is not None:
            out += [b"t", self.token_id]
        return out

    @classmethod
    def decode(cls, fields: dict[bytes, bytes]) -> LogEntry:
        """From the field map ``XRANGE``/``XREAD`` return (bytes keys)."""
        try:
            events = decode_events(fields[b"e"])
            if len(events) != 1:
                raise ValueError("a log entry holds exactly one event")
            tid = fields.get(b"t")
            return cls(events[0], int(tid) if tid is not None else None)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed log entry: {exc!r}") from exc


@dataclass(frozen=True, slots=True)
class AudioChunk:
    """One entry of an utterance's audio stream ``sf:audio:{request_id}``: PCM (field
    ``pcm``, raw bytes as the task's ``AudioInput`` says), or the end marker (field
    ``end``: the utterance is over, nothing follows)."""

    pcm: bytes = b""
    end: bool = False

    def fields(self) -> dict[bytes, bytes]:
        """The field map for ``XADD``."""
        return {b"end": b"1"} if self.end else {b"pcm": self.pcm}

    @classmethod
    def decode(cls, fields: dict[bytes, bytes]) -> AudioChunk:
        """From the field map ``XREAD`` returns (bytes keys); raises ``ValueError``."""
        if fields.get(b"end") == b"1":
            return cls(end=True)
        pcm = fields.get(b"pcm")
        if not isinstance(pcm, bytes) or len(pcm) % 2:
            raise ValueError("malformed audio chunk: 'pcm' must be an even number of bytes")
        return cls(pcm=pcm)


@dataclass(frozen=True, slots=True)
class Attach:
    """A connection follows a request it resumed: one member of ``sf:attach:{request_id}``
    (a sorted set), the connection id scored by when the entry expires (unix ms)."""

    connection_id: str
    expires_ms: int

    def encode(self) -> dict[str, int]:
        """The member and score for ``ZADD``."""
        return {self.connection_id: self.expires_ms}

    @staticmethod
    def live_range(now_ms: int) -> tuple[int, str]:
        """``ZRANGEBYSCORE`` bounds of the entries that have not expired at ``now_ms``."""
        return now_ms, "+inf"

    @staticmethod
    def decode_members(members: Iterable[object]) -> set[str]:
        """The connection ids of ``ZRANGEBYSCORE``'s answer; members that are not ids of
        the form a gateway writes are left out."""
        out = set()
        for m in members:
            cid = m.decode(errors="replace") if isinstance(m, bytes) else str(m)
            if cid and len(cid) <= 64 and cid.isprintable() and " " not in cid:
                out.add(cid)
        return out


@dataclass(slots=True)
class Heartbeat:
    """A worker's entry in ``sf:workers:{model}`` (a hash; the field is the worker id),
    rewritten every ``SF_HEARTBEAT_INTERVAL_S``. ``heartbeat`` is the unix time it was
    written; ``worker_id`` comes from the hash field and is not part of the value."""

    heartbeat: float
    slots_used: int = 0
    max_batch: int = 0
    version: str = ""
    reloading: bool = False
    draining: bool = False
    tokens_per_s: float = 0.0
    pid: int = 0
    host: str = ""
    #: its prefix cache (workers/prefixcache.py): blocks held, their bytes, and the share
    #: of the prompt tokens looked up that it had (0 to 1); absent without a cache
    cache_blocks: int = 0
    cache_bytes: int = 0
    cache_hit_rate: float = 0.0
    #: the longest of its recent engine steps (ms; 0 before the first): how long a task
    #: routed to it may wait for its next read (workers/affinity.py)
    step_ms: float = 0.0
    #: of ``slots_used``, the tasks it took from the shared lanes (the rest came from its
    #: affinity streams, whose length a gateway reads fresh: routing's load); -1: not said
    shared_used: int = -1
    #: the execution mode its engine runs (a GGUF model's weights mode, chosen by measurement
    #: or pinned: shared/execution.py) and why, in a line; "" for models without one
    execution: str = ""
    execution_why: str = ""
    #: a text model's step target (``SF_STEP_TARGET_MS``; 0: none) and the step costs it
    #: learned (``workers.stepcost.StepCosts.describe``: ms an engine call, a prompt
    #: token, a prompt token per 1,000 positions before it, a sequence decoded, 1,000
    #: positions of cache read; the steps timed) with ``chunk``, the prompt tokens its
    #: last prefill step took; absent for other models
    step_target_ms: float = 0.0
    step_costs: dict[str, float] = field(default_factory=dict)
    worker_id: str = ""

    def encode(self) -> bytes:
        d = asdict(self)
        del d["worker_id"]
        if not self.execution:
            del d["execution"], d["execution_why"]
        if not self.step_costs:
            del d["step_target_ms"], d["step_costs"]
        if not self.cache_blocks and not self.cache_bytes and not self.cache_hit_rate:
            for name in ("cache_blocks", "cache_bytes", "cache_hit_rate"):
                del d[name]
        if not self.step_ms:
            del d["step_ms"]
        if self.shared_used < 0:
            del d["shared_used"]
        return orjson.dumps(d)

    @classmethod
    def decode(cls, raw: bytes | str, worker_id: bytes | str = "") -> Heartbeat:
        """Raises ``ValueError`` for anything but an object with a numeric ``heartbeat``."""
        try:
            d = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"malformed heartbeat: {exc}") from exc
        if not isinstance(d, dict) or not isinstance(d.get("heartbeat"), (int, float)) \
                or isinstance(d.get("heartbeat"), bool):
            raise ValueError("malformed heartbeat: not an object with a numeric heartbeat")
        wid = worker_id.decode(errors="replace") if isinstance(worker_id, bytes) else worker_id
        try:
            return cls(heartbeat=float(d["heartbeat"]), slots_used=int(d.get("slots_used", 0)),
                       max_batch=int(d.get("max_batch", 0)), version=str(d.get("version", "")),
                       reloading=bool(d.get("reloading", False)), draining=bool(d.get("draining", False)),
                       tokens_per_s=float(d.get("tokens_per_s", 0.0)), pid=int(d.get("pid", 0)),
                       host=str(d.get("host", "")), cache_blocks=int(d.get("cache_blocks", 0)),
                       cache_bytes=int(d.get("cache_bytes", 0)), cache_hit_rate=float(d.get("cache_hit_rate", 0.0)),
                       step_ms=float(d.get("step_ms", 0.0)), shared_used=int(d.get("shared_used", -1)),
                       execution=str(d.get("execution", ""))[:64], execution_why=str(d.get("execution_why", ""))[:1000],
                       step_target_ms=float(d.get("step_target_ms", 0.0)), step_costs=_costs(d.get("step_costs")),
                       worker_id=wid)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"malformed heartbeat: {exc}") from exc

    def age(self, now: float) -> float:
        return max(0.0, now - self.heartbeat)


def _costs(v: object) -> dict[str, float]:
    """A heartbeat's ``step_costs``: names to numbers (at most 16; anything else left out)."""
    if not isinstance(v, dict):
        return {}
    return {str(k)[:32]: float(x) for k, x in list(v.items())[:16] if is_number(x)}


def live_workers(raw: Mapping[bytes, bytes] | Mapping[str, str] | Mapping[bytes | str, bytes | str], ttl_s: float,
                 now: float) -> list[Heartbeat]:
    """The fresh entries of a ``sf:workers:{model}`` hash, as ``HGETALL`` returns it;
    unreadable or stale entries are left out.

    Args:
        raw: worker id -> heartbeat value (bytes or str).
        ttl_s: a heartbeat older than this is dead.
        now: unix time, on the same clock the workers write.
    """
    out = []
    for wid, blob in raw.items():
        try:
            hb = Heartbeat.decode(blob, wid)
        except ValueError:
            continue
        if now - hb.heartbeat <= ttl_s:
            out.append(hb)
    return out


@dataclass(slots=True)
class DeadLetter:
    """A task given up on (``sf:{model}:dead``, a stream): the task as it was read
    (possibly unreadable, which may be why it is here), why, from which lane, by which
    worker."""

    task: bytes
    reason: str
    lane: str = ""
    worker: str = ""

    def fields(self) -> dict[FieldT, EncodableT]:
        """The field map for ``XADD`` (redis-py's)."""
        return {"task": self.task, "reason": self.reason, "lane": self.lane, "worker": self.worker}

    @classmethod
    def decode(cls, fields: dict[bytes, bytes]) -> DeadLetter:
        """From the field map ``XRANGE`` returns; missing fields read as empty."""
        f = {(k.decode(errors="replace") if isinstance(k, bytes) else k): v for k, v in fields.items()}

        def text(name: str) -> str:
            v = f.get(name, b"")
            return v.decode(errors="replace") if isinstance(v, bytes) else str(v)

        task = f.get("task", b"")
        return cls(task=task if isinstance(task, bytes) else str(task).encode(), reason=text("reason"),
                   lane=text("lane"), worker=text("worker"))

    @property
    def request_id(self) -> str | None:
        """The request id of the task, when the task is readable enough to name it."""
        try:
            d = orjson.loads(self.task)
        except orjson.JSONDecodeError:
            return None
        rid = d.get("request_id") if isinstance(d, dict) else None
        return rid if isinstance(rid, str) else None


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """One stored API key (``sf:keys``, a hash; the field is the key id). ``hash`` is
    SHA-256 of the whole key, never the key. Written by ``streamfleet keys``, read by
    every gateway."""

    key_id: str
    name: str
    tier: str
    hash: str = field(repr=False)
    created_at: str
    revoked: bool = False

    def encode(self) -> bytes:
        return orjson.dumps(self)

    @classmethod
    def decode(cls, raw: bytes | str) -> KeyRecord:
        try:
            d = orjson.loads(raw)
            return cls(key_id=str(d["key_id"]), name=str(d["name"]), tier=str(d["tier"]), hash=str(d["hash"]),
                       created_at=str(d.get("created_at", "")), revoked=bool(d.get("revoked", False)))
        except (orjson.JSONDecodeError, TypeError, KeyError) as exc:
            raise ValueError(f"malformed key record: {exc!r}") from exc

    def public(self) -> dict[str, Any]:
        """The record for display: everything but the hash."""
        return {"key_id": self.key_id, "name": self.name, "tier": self.tier,
                "created_at": self.created_at, "revoked": self.revoked}


def encode_plan_record(record: dict[str, Any]) -> bytes:
    """A TensorRT plan's record (``{prefix}:plans:{model}``, a hash; the field is the plan's
    key): where and how it was built, written by the engine-build worker and by
    ``streamfleet engines build``, read by ``streamfleet engines list``."""
    return orjson.dumps(record)


def decode_plan_record(raw: bytes | str) -> dict[str, Any]:
    """Inverse of ``encode_plan_record``; ``ValueError`` unless it is a JSON object."""
    try:
        rec = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"malformed plan record: {exc}") from exc
    if not isinstance(rec, dict):
        raise ValueError("malformed plan record: not an object")
    return rec
