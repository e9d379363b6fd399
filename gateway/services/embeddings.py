"""The embeddings request's path, whatever its door (docs/openai.md, "Embeddings"): the
HTTP door ``POST /v1/embeddings`` (``gateway/doors/embeddings.py``), gRPC's ``Embed`` call
(``gateway/doors/grpc_server.py``) and the WebSocket's ``embed`` frame
(``gateway/protocols/frames.py``, ``gateway/services/session.py``) all take it: ``check_body``,
``submit``, ``EmbedCall``.

A request is one ``EmbedTask`` on the embedding model's lanes, on the path every request
takes (docs/architecture.md, "A request's path"): the body checked cheaply first
(``check_body``: the model must be an embedding model; ``input`` a string, a list of
strings, a list of token ids or a list of lists of them, at most ``MAX_INPUTS``, none
empty; token ids in the vocabulary and within the model's ``max_context``;
``encoding_format``; ``dimensions`` only as the model's own), then admitted
(``gateway/admission/gate.py``: the key, its lane, its rate limit — one request, as a text
request is — and its stream slot), then its texts tokenized (``Validator.finish``: each
within ``max_context``, never truncated), its input tokens taken from the key's token
rate limit, then enqueued. The worker (``workers/embedcore.py``) answers with one
``EmbeddingEvent`` per input, over as many engine steps as its inputs take, and a
``DoneEvent`` whose ``prompt_tokens`` is the request's input tokens.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar, overload

from streamfleet.gateway.admission.kinds import EmbeddingsRequest
from streamfleet.gateway.admission.validation import check_lane
from streamfleet.gateway.requests.observe import stop_events
from streamfleet.shared.errors import ErrorCode, StreamfleetError, ValidationError
from streamfleet.shared.logging import get_logger
from streamfleet.shared.modelrepo import ModelSpec, kind_phrase
from streamfleet.shared.schema import DoneEvent, EmbeddingEvent, ErrorEvent

if TYPE_CHECKING:
    from streamfleet.gateway.admission.auth import Identity
    from streamfleet.gateway.hub import Hub
    from streamfleet.gateway.requests.lifecycle import ClientRequest

T = TypeVar("T")
#: how an embeddings request's events end (None: they stopped without an end)
End = DoneEvent | ErrorEvent | None
#: an embeddings request's inputs: texts, and token ids (``EmbeddingsRequest.inputs``)
Inputs = tuple[str | tuple[int, ...], ...]

__all__ = ["check_body", "submit", "EmbedCall", "MAX_INPUTS", "ENCODINGS", "EmbeddingsBody"]

log = get_logger("gateway.embeddings")

#: inputs one request may hold (OpenAI's limit)
MAX_INPUTS = 2048
ENCODINGS = ("float", "base64")
#: the body's parameters (``priority`` and ``timeout`` are streamfleet's, as on the text endpoints)
KNOWN = frozenset({"model", "input", "encoding_format", "dimensions", "user", "priority", "timeout"})


class EmbeddingsBody:
    """A body that passed ``check_body``: the model's spec, the inputs (texts, or token ids
    already checked against the vocabulary and the context), the encoding, the lane, the
    timeout."""

    __slots__ = ("spec", "inputs", "encoding", "lane", "timeout_s")

    def __init__(self, spec: ModelSpec, inputs: Inputs, encoding: str, lane: str, timeout_s: float) -> None:
        self.spec, self.inputs, self.encoding, self.lane, self.timeout_s = spec, inputs, encoding, lane, timeout_s


def _bad(message: str, param: str, code: ErrorCode = ErrorCode.invalid_request) -> ValidationError:
    return ValidationError(message, code=code, param=param)


def _is_int(v: object) -> bool:
    return type(v) is int


def _inputs(value: object, spec: ModelSpec, vocab: int, max_chars: int) -> Inputs:
    """``input`` as a tuple of texts and token-id tuples, each checked as far as it can be
    without tokenizing.

    Raises:
        ValidationError: naming the input and the limit it breaks.
    """
    if value is None:
        raise _bad("'input' is required", "input", ErrorCode.missing_field)
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list):
        if not value:
            raise _bad("'input' is empty: send a string, a list of strings or a list of token-id lists", "input")
        items = [value] if all(_is_int(t) for t in value) else value  # a list of ids is one input
    else:
        raise _bad("'input' must be a string, a list of strings, a list of token ids or a list of lists of "
                   "token ids", "input", ErrorCode.invalid_type)
    if len(items) > MAX_INPUTS:
        raise _bad(f"'input' holds {len(items)} inputs; the limit is {MAX_INPUTS}", "input")
    out: list[str | tuple[int, ...]] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise _bad(f"input {i} is an empty string", "input")
            if len(item) > max_chars:
                raise _bad(f"input {i} has {len(item)} characters; the limit is {max_chars}", "input",
                           ErrorCode.prompt_too_long)
            out.append(item)
        elif isinstance(item, list):
            if not item:
                raise _bad(f"input {i} is an empty list of token ids", "input")
            if len(item) > spec.max_context:  # first: what follows walks at most a context's worth
                raise _bad(f"input {i} has {len(item)} tokens, over the limit of model {spec.name!r} "
                           f"({spec.max_context} tokens, special tokens included); it is not truncated", "input",
                           ErrorCode.prompt_too_long)
            if not all(_is_int(t) for t in item):
                raise _bad(f"input {i} must be a list of token ids (integers)", "input", ErrorCode.invalid_type)
            bad = next((t for t in item if not 0 <= t < vocab), None)
            if bad is not None:
                raise _bad(f"input {i} holds token id {bad}, outside the vocabulary of model {spec.name!r} "
                           f"(ids 0 to {vocab - 1})", "input", ErrorCode.out_of_range)
            out.append(tuple(item))
        else:
            raise _bad(f"input {i} must be a string or a list of token ids", "input", ErrorCode.invalid_type)
    return tuple(out)


def check_body(hub: Hub, body: dict[str, Any], priority_header: str | None = None) -> EmbeddingsBody:
    """The cheap checks of an embeddings body, before admission (nothing is tokenized).

    Raises:
        ValidationError, NotFoundError: naming the parameter (and the input) at fault.
    """
    s = hub.settings
    unknown = sorted(k for k in body if k not in KNOWN)
    if unknown:
        if s.refuse_unsupported:
            raise _bad(f"unrecognized request argument{'s' if len(unknown) > 1 else ''} supplied: "
                       f"{', '.join(repr(k[:64]) for k in unknown[:5])} (docs/openai.md lists the parameters of "
                       f"/v1/embeddings)", unknown[0][:64])
        log.warning("unknown parameters ignored (SF_REFUSE_UNSUPPORTED=false)", params=[k[:64] for k in unknown[:20]])
    model = body.get("model")
    if model is None:
        raise _bad("'model' is required: name an embedding model", "model", ErrorCode.missing_field)
    if not isinstance(model, str):
        raise _bad("'model' must be a string", "model", ErrorCode.invalid_type)
    spec = hub.validator.spec(model)
    if spec.kind != "embedding":
        where = ("use /v1/completions or /v1/chat/completions for it" if spec.kind == "text" else
                 "use /v1/audio/transcriptions or /v1/audio/stream for it" if spec.kind == "asr" else "")
        raise _bad(f"model {spec.name!r} is {kind_phrase(spec.kind)}, not an embedding model" +
                   (f"; {where}" if where else ""), "model")
    encoding = body.get("encoding_format")
    if encoding is None:
        encoding = "float"
    if encoding not in ENCODINGS:
        raise _bad("'encoding_format' must be 'float' or 'base64'", "encoding_format",
                   ErrorCode.out_of_range if isinstance(encoding, str) else ErrorCode.invalid_type)
    dims = body.get("dimensions")
    if dims is not None and (not _is_int(dims) or dims != spec.dimensions):
        raise _bad(f"'dimensions' must be {spec.dimensions} for model {spec.name!r} (its vectors are not "
                   f"shortened), or left out", "dimensions")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("'user' must be a string", "user", ErrorCode.invalid_type)
    timeout = body.get("timeout")
    if timeout is None:
        timeout_s = s.request_timeout_s
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and math.isfinite(timeout) \
            and 0.001 <= timeout <= 3600.0:
        timeout_s = float(timeout)
    else:
        raise _bad("'timeout' must be a number of seconds from 0.001 to 3600", "timeout", ErrorCode.out_of_range)
    lane = check_lane(body.get("priority") or priority_header)
    vocab = len(hub.validator.tokenizer(spec))
    return EmbeddingsBody(spec, _inputs(body.get("input"), spec, vocab, s.max_prompt_chars), encoding, lane,
                          timeout_s)


async def submit(hub: Hub, door: str, identity: Identity | None, checked: EmbeddingsBody, trace_id: str | None,
                 req: ClientRequest | None = None) -> EmbedCall:
    """Admit and enqueue a checked body (tokenizing its texts after admission): the
    embedding request's path shared by the HTTP, gRPC and WebSocket doors. ``req``: the
    ``ClientRequest`` to submit it as (a connection's, under the client's id: the
    WebSocket's ``embed`` frame, ``gateway.services.session``); None for a request of its own.

    Raises:
        StreamfleetError: refused (admission, tokenizing, the lane's backpressure).
    """
    own = req is None
    if req is None:
        req = hub.request(door, identity=identity)
    request = EmbeddingsRequest(client_id="embeddings" if own else req.client_id, model=checked.spec.name,
                                lane=checked.lane, timeout_s=checked.timeout_s, inputs=checked.inputs)
    depth = await req.submit(request, trace_id=trace_id)
    return EmbedCall(req, door, len(checked.inputs), depth=depth, watch=own)


class EmbedCall:
    """A submitted embeddings request: ``result`` waits for its vectors and its end.
    ``depth``: the lane's depth at the enqueue (the WebSocket's ``accepted`` frame);
    ``watch``: ``result`` ends the request if the API key is revoked meanwhile (a
    connection's request is not watched: its connection is)."""

    def __init__(self, req: ClientRequest, door: str, n: int, *, depth: int = 0, watch: bool = True) -> None:
        self.req, self.door, self.n, self.depth, self.watch = req, door, n, depth, watch

    @overload
    async def result(self, guard: None = None, *, cancelled_ok: bool = False) -> tuple[list[str], DoneEvent]: ...

    @overload
    async def result(self, guard: Callable[[Awaitable[End]], Awaitable[End | T]], *,
                     cancelled_ok: bool = False) -> tuple[list[str], DoneEvent | T]: ...

    async def result(self, guard: Callable[[Awaitable[End]], Awaitable[End | T]] | None = None, *,
                     cancelled_ok: bool = False) -> tuple[list[str], DoneEvent | T]:
        """The vectors (base64 float32, in input order) and the ``DoneEvent``; ``guard``
        wraps the wait (the HTTP door's ``until_disconnect``: then the end may be
        ``DISCONNECTED``). The request is closed whatever happens (cancelled if it has
        not ended). ``cancelled_ok``: a request cancelled before all of its vectors came
        (the WebSocket's ``cancel`` frame) returns no vectors and its ``DoneEvent``
        (``finish_reason`` ``"cancelled"``) rather than failing.

        Raises:
            StreamfleetError: the request failed (the worker's error), or ended without
                all of its vectors (``internal``).
        """
        req = self.req
        if self.watch:
            req.watch()  # a revoked key ends the stream
        vectors: list[str | None] = [None] * self.n
        events = req.events(self.door)

        async def consume() -> End:
            async for ev in events:
                if isinstance(ev, EmbeddingEvent):
                    if 0 <= ev.index < self.n:
                        vectors[ev.index] = ev.vector
                elif isinstance(ev, (DoneEvent, ErrorEvent)):
                    req.delivered()
                    return ev
            return None

        try:
            try:
                end = await (guard(consume()) if guard is not None else consume())
            finally:
                await stop_events(None, events)
        finally:
            await req.close(reason=f"{self.door}_disconnect")
        if end is not None and not isinstance(end, (DoneEvent, ErrorEvent)):
            return [], end  # the guard's own end (the HTTP door's ``DISCONNECTED``)
        if isinstance(end, ErrorEvent):
            raise end.error()
        if cancelled_ok and isinstance(end, DoneEvent) and end.finish_reason == "cancelled":
            return [], end
        if not isinstance(end, DoneEvent) or end.finish_reason != "stop" or any(v is None for v in vectors):
            reason = end.finish_reason if isinstance(end, DoneEvent) else "no end"
            raise StreamfleetError(f"the embeddings request ended ({reason}) without all of its vectors",
                                   code=ErrorCode.internal)
        return [v for v in vectors if v is not None], end  # (every one, checked above)
