"""OpenAI-compatible HTTP adapter: ``/v1/completions``, ``/v1/chat/completions`` (streamed
as SSE or not) and ``/v1/models``, over the same validation and stream-event model as
the WebSocket.

An OpenAI body is mapped to the generate payload the WebSocket uses and goes through
``Validator.generate``; the same bad input gets the same error code on both. Errors use
the OpenAI body ``{"error": {"message", "type", "param", "code"}}``. Each HTTP request
is one ``gateway.requests.ClientRequest`` on a reply channel of its own.

Priority: the ``X-Priority: high|normal`` header, or ``"priority"`` in the body (with the
SDK: ``extra_body={"priority": "high"}``). Also accepted as extras: ``top_k``,
``ignore_eos``, ``timeout``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator

import anyio
import orjson
import structlog
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.requests import ClientDisconnect

from streamfleet.shared.errors import ErrorCode, StreamfleetError, UnavailableError, ValidationError
from streamfleet.shared.logging import get_logger

from streamfleet.shared.metrics import gateway as metrics

from streamfleet.gateway import edge
from streamfleet.gateway.httperror import openai_error_response
from streamfleet.gateway.observe import stop_events, trace_id_from
from streamfleet.gateway.requests import ClientRequest
from streamfleet.gateway.streams import TICK, End, Failed, Token
from streamfleet.gateway.validation import MAX_SEED, MAX_TOP_LOGPROBS, UNSUPPORTED
from streamfleet.gateway.tools import CallStream, Tools, parse_call
from streamfleet.shared.grammar import CONSTRAINTS

if TYPE_CHECKING:
    from streamfleet.gateway.hub import Hub

#: the sampling and log-probability parameters passed through to the validator as they are
PROCESSING = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p", "min_tokens",
              "stop_token_ids", "logprobs", "top_logprobs", *CONSTRAINTS, "tools", "tool_choice")

__all__ = ["router", "SSE_HEADERS"]

log = get_logger("gateway.openai")
router = APIRouter()

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: most choices (``n``, ``best_of``) one request may ask for
MAX_CHOICES = 16
#: with tool_choice "auto", streamed text that may be a tool call is held back up to this
#: many characters (a call is decided at the end); past it, it is text
_MAX_HELD_CALL = 16384
#: OpenAI has no "cancelled"; a cancelled HTTP request only happens when its client left
_FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}


def _payload(body: dict[str, Any], request: Request, chat: bool) -> dict[str, Any]:
    """Map an OpenAI body (already known to be an object) to the generate payload of the
    WebSocket protocol."""
    p: dict[str, Any] = {"id": "http"}
    # the parameters streamfleet does not implement go along, for the validator to refuse
    for name in ("model", "temperature", "top_p", "top_k", "stop", "seed", "ignore_eos", "timeout",
                 *PROCESSING, *UNSUPPORTED):
        if name in body:
            p[name] = body[name]
    if not chat and body.get("logprobs") is not None:
        # a completion's "logprobs": k is the chat API's logprobs + top_logprobs: k
        k = body["logprobs"]
        if isinstance(k, bool) or not isinstance(k, int):
            raise ValidationError("'logprobs' must be an integer (the number of alternatives per token)",
                                  code=ErrorCode.invalid_type, param="logprobs")
        p["logprobs"], p["top_logprobs"] = True, k
        if not 0 <= k <= MAX_TOP_LOGPROBS:
            raise ValidationError(f"'logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {k}",
                                  code=ErrorCode.out_of_range, param="logprobs")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        p["max_tokens"] = max_tokens
    priority = request.headers.get("x-priority") or body.get("priority")
    if priority is not None:
        p["priority"] = priority
    if chat:
        if "messages" not in body:
            raise ValidationError("'messages' is required", code=ErrorCode.missing_field, param="messages")
        p["messages"] = body["messages"]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                raise ValidationError("'prompt' must be a string or a list of exactly one string",
                                      code=ErrorCode.invalid_type, param="prompt")
            prompt = prompt[0]
        if prompt is None:
            raise ValidationError("'prompt' is required", code=ErrorCode.missing_field, param="prompt")
        p["prompt"] = prompt
    return p


def _counts(body: dict[str, Any], chat: bool, stream: bool) -> tuple[int, int]:
    """``(n, best_of)``: the choices returned, and the completions generated for them
    (``best_of`` >= ``n``, completions only: the ``n`` with the highest total log
    probability are returned)."""
    def count(name: str, default: int, lo: int) -> int:
        v = body.get(name)
        if v is None:
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValidationError(f"'{name}' must be an integer", code=ErrorCode.invalid_type, param=name)
        if not lo <= v <= MAX_CHOICES:
            raise ValidationError(f"'{name}' must be between {lo} and {MAX_CHOICES}, got {v}",
                                  code=ErrorCode.out_of_range, param=name)
        return v

    n = count("n", 1, 1)
    if chat and body.get("best_of") is not None:
        raise ValidationError("'best_of' is a parameter of /v1/completions", code=ErrorCode.invalid_request,
                              param="best_of")
    best_of = count("best_of", n, n)
    if best_of > n and stream:
        raise ValidationError("'best_of' greater than 'n' cannot be streamed (the best are known at the end)",
                              code=ErrorCode.invalid_request, param="best_of")
    return n, best_of


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ValidationError("'stream' must be a boolean", code=ErrorCode.invalid_type, param="stream")
    # only null means absent: a falsy non-object ([], 0, "") is as wrong as a truthy one
    opts = body.get("stream_options")
    if opts is None:
        opts = {}
    if not isinstance(opts, dict):
        raise ValidationError("'stream_options' must be an object", code=ErrorCode.invalid_type,
                              param="stream_options")
    include_usage = opts.get("include_usage")
    if include_usage is None:
        include_usage = False
    if not isinstance(include_usage, bool):
        raise ValidationError("'stream_options.include_usage' must be a boolean", code=ErrorCode.invalid_type,
                              param="stream_options")
    return stream, include_usage


def _usage(end: End) -> dict[str, int]:
    return {"prompt_tokens": end.prompt_tokens, "completion_tokens": end.completion_tokens,
            "total_tokens": end.prompt_tokens + end.completion_tokens}


def _top_chat(e: dict) -> dict:
    return {"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"]}


class _Shape:
    """The response shapes of one endpoint (completion vs chat)."""

    def __init__(self, chat: bool, request_id: str, model: str, tools: Tools | None = None) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())
        self.tools = tools
        self.call_id = f"call_{request_id[:24]}"

    def tool_chunk(self, kind: str, value: str, logprobs: list[tuple[int, dict]] | None = None,
                   usage_null: bool = False, index: int = 0) -> dict:
        """A streamed chunk of the call: its name (``kind == "name"``, with the call's id
        and type) or a piece of its arguments."""
        if kind == "name":
            call = {"index": 0, "id": self.call_id_of(index), "type": "function",
                    "function": {"name": value, "arguments": ""}}
        else:
            call = {"index": 0, "function": {"arguments": value}}
        out = self.chunk(None, None, usage_null=usage_null, logprobs=logprobs, index=index)
        out["choices"][0]["delta"] = {"tool_calls": [call]}
        return out

    def call(self, text: str) -> tuple[str, str] | None:
        """The tool call a finished completion holds, if any."""
        return parse_call(text, self.tools.names) if self.tools is not None else None

    def logprobs(self, tokens: list[tuple[int, dict]] | None) -> dict | None:
        """The ``logprobs`` of a choice: each token (``(text_offset, TokenEvent.logprobs)``)
        in the chat API's shape or the completions API's; None when none were asked for."""
        if not tokens:
            return None
        if self.chat:
            return {"content": [{**_top_chat(e), "top_logprobs": [_top_chat(t) for t in e["top"]]}
                                for _, e in tokens], "refusal": None}
        return {"tokens": [e["token"] for _, e in tokens], "token_logprobs": [e["logprob"] for _, e in tokens],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top"]} for _, e in tokens],
                "text_offset": [o for o, _ in tokens]}

    def call_id_of(self, index: int) -> str:
        return self.call_id if index == 0 else f"{self.call_id}_{index}"

    def chunk(self, text: str | None, finish: str | None, *, role: bool = False, usage_null: bool = False,
              logprobs: list[tuple[int, dict]] | None = None, index: int = 0) -> dict:
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
                delta["content"] = ""
            elif text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": self.logprobs(logprobs), "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text or "", "logprobs": self.logprobs(logprobs),
                      "finish_reason": finish}
            obj = "text_completion"
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}
        if usage_null:
            out["usage"] = None
        return out

    def usage_chunk(self, end: End) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [],
                "usage": _usage(end)}

    def full(self, text: str, end: End, logprobs: list[tuple[int, dict]] | None = None) -> dict:
        return self.full_many([self.choice_full(0, text, end, logprobs)], end)

    def full_many(self, choices: list[dict], end: End) -> dict:
        obj = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                "usage": _usage(end)}

    def choice_full(self, index: int, text: str, end: End, logprobs: list[tuple[int, dict]] | None = None) -> dict:
        """One choice of a response that is not streamed."""
        finish = _FINISH.get(end.finish_reason, end.finish_reason)
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            call = self.call(text)
            if call is not None:
                message = {"role": "assistant", "content": None, "tool_calls": [
                    {"id": self.call_id_of(index), "type": "function",
                     "function": {"name": call[0], "arguments": call[1]}}]}
                finish = "tool_calls"
            return {"index": index, "message": message, "logprobs": self.logprobs(logprobs), "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": self.logprobs(logprobs), "finish_reason": finish}


def _could_be_call(text: str) -> bool:
    """Whether streamed text so far may still turn out to be a tool call (``auto``)."""
    head = text.lstrip()
    return len(text) < _MAX_HELD_CALL and (head.startswith("{") or head.startswith("<tool_call>")
                                           or "<tool_call>".startswith(head))


def _sse(data: dict | str, event_id: str | None = None) -> bytes:
    head = f"id: {event_id}\n".encode() if event_id is not None else b""
    body = data.encode() if isinstance(data, str) else orjson.dumps(data)
    return head + b"data: " + body + b"\n\n"


def _event_id(request_id: str, resume_token: str | None, index: int) -> str:
    """An SSE ``id:``: ``<request_id>:<index>``, with auth off ``<request_id>:<resume_token>:<index>``
    (the token proves the reconnecting client is the one the stream was sent to)."""
    if resume_token:
        return f"{request_id}:{resume_token}:{index}"
    return f"{request_id}:{index}"


def _last_event_id(request: Request) -> tuple[str, str | None, int] | None:
    """``Last-Event-ID`` of a reconnecting SSE client, as ``_event_id`` wrote it."""
    raw = request.headers.get("last-event-id")
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


async def _generate(request: Request, chat: bool) -> Response:
    hub: Hub = request.app.state.hub
    admission = hub.admission
    identity = None
    try:
        if hub.draining:
            raise UnavailableError("this gateway is shutting down; retry", retry_after_ms=0,
                                   code=ErrorCode.shutting_down)
        # who is asking, before a byte of the body is read: an unauthenticated body costs nothing
        identity = await admission.authenticate(request.headers.get("authorization"))
        if identity is not None:  # every log line of this request names its key
            structlog.contextvars.bind_contextvars(key_id=identity.key_id)
            edge.authenticated(request.scope)  # off its address's count before auth (gateway/edge.py)
        admission.spent(identity)  # a key known out of its rate limit: 429 before reading the body
        raw = await _read_body(request, hub.settings.max_frame_bytes)
        if raw is None:
            # the client left before sending the whole body: nobody is there to answer, and
            # it is the client's doing, not the gateway's (no traceback, no error log)
            log.debug("client left mid-body", path=request.url.path)
            return Response(status_code=499)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ValidationError(f"the body is not valid JSON: {exc.msg}", code=ErrorCode.invalid_json) from exc
        # before anything reads a field (the stream flags, the resume path): valid JSON that
        # is not an object gets the code the WebSocket gives the same frame
        if not isinstance(body, dict):
            raise ValidationError("the request body must be a JSON object", code=ErrorCode.invalid_frame)
        stream_mode, include_usage = _stream_flags(body)
        n, best_of = _counts(body, chat, stream_mode)
        resume = _last_event_id(request)
        req = hub.request("http", identity=identity)
        tools = None
        if resume is not None:  # a reconnecting SSE client: continue that request
            if not stream_mode:
                raise ValidationError("Last-Event-ID needs \"stream\": true", code=ErrorCode.invalid_request,
                                      param="stream")
            if best_of > 1:
                raise ValidationError("a request of several choices cannot be resumed", param="n",
                                      code=ErrorCode.invalid_request)
            # the model is the recorded one, validated at submit: never the body's
            await req.resume(resume[0], resume[2] + 1, resume[1])
        else:
            draft = hub.validator.check(_payload(body, request, chat))
            tools = draft.tools
            trace = trace_id_from(request.headers.get("traceparent"))
            if best_of > 1:
                reqs = await _submit_choices(hub, identity, draft, best_of, scored=best_of > n, trace=trace)
            else:
                await req.submit(draft, trace_id=trace)
    except StreamfleetError as exc:
        metrics.refusals.labels("http", str(exc.code)).inc()
        return openai_error_response(exc)

    if best_of > 1:
        return await _many(request, hub, reqs, chat, n, stream_mode, include_usage, tools,
                           keep_logprobs=draft.params.logprobs is not None)

    req.watch()  # a revoked key ends the stream
    events = req.events("sse" if stream_mode else "http")
    shape = _Shape(chat, req.request_id, req.model, tools)
    if stream_mode:
        return StreamingResponse(_sse_events(hub, req, events, shape, include_usage),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        return await _collect(request, events, shape)
    finally:
        await req.close(reason="http_disconnect")


class _Gathered:
    """One choice's text and log probabilities as its tokens come (a response not
    streamed); each token's log probabilities with the text offset where it starts."""

    __slots__ = ("parts", "logprobs", "offset")

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.logprobs: list[tuple[int, dict]] = []
        self.offset = 0

    def add(self, ev: Token) -> None:
        if ev.logprobs is not None:
            self.logprobs.append((self.offset, ev.logprobs))
        self.parts.append(ev.text)
        self.offset += len(ev.text)

    @property
    def text(self) -> str:
        return "".join(self.parts)


async def _ticking(events: AsyncIterator, every_s: float) -> AsyncIterator[Any]:
    """``events``, with a None whenever ``every_s`` pass without one (an SSE keepalive is
    due); closing it stops the read under way and closes ``events``."""
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=every_s)
            if not done:
                yield None
                continue
            ev, pending = pending.result(), None
            yield ev
    finally:
        with anyio.CancelScope(shield=True):
            await stop_events(pending, events)


async def _submit_choices(hub: "Hub", identity, draft, k: int, *, scored: bool, trace: str | None) -> list[ClientRequest]:
    """Submit the ``k`` completions of one request: one task each (admitted, rate limited
    and run as any request), seeds ``seed``, ``seed + 1``, …, so that the choices differ
    and the same request gives the same choices again. They carry one group id: the
    worker that starts the first prefills the prompt once for those it starts after it
    (``WorkerCore._prefill``). ``scored``: ``best_of`` picks the best, which needs each
    token's log probability. A refusal takes back what was submitted."""
    params = draft.params
    await hub.admission.charge(identity, k, "best_of" if scored else "n")  # all or nothing: a refusal here takes nothing
    reqs = [hub.request("http", identity=identity) for _ in range(k)]
    group = uuid.uuid4().hex
    drafts = [dataclasses.replace(draft, group=group, group_size=k, params=dataclasses.replace(
        params, seed=(params.seed + i) % (MAX_SEED + 1),
        logprobs=0 if scored and params.logprobs is None else params.logprobs)) for i in range(k)]
    # admitted side by side, then enqueued in one loop turn (one pipeline of the gateway's
    # coalescer): a worker reads them together and prefills the prompt once
    gate = asyncio.Event()
    state = {"arrived": 0, "broken": False}

    async def together() -> None:
        state["arrived"] += 1
        if state["arrived"] == k:
            gate.set()
            await asyncio.sleep(0)  # resume in the loop turn the others resume in
        await gate.wait()
        if state["broken"]:
            raise asyncio.BrokenBarrierError

    async def one(req: ClientRequest, d) -> None:
        try:
            await req.submit(d, trace_id=trace, before_enqueue=together, charged=True)
        except BaseException:
            state["broken"] = True  # the others stop waiting (and are refused too)
            gate.set()
            raise

    results = await asyncio.gather(*(one(req, d) for req, d in zip(reqs, drafts)), return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        await hub.admission.refund(identity, k)
        for req, r in zip(reqs, results):
            if not isinstance(r, BaseException):
                await req.close(reason="refused")
        # the first refusal itself, not the broken barrier of the others
        raise next((r for r in failed if not isinstance(r, asyncio.BrokenBarrierError)), failed[0])
    return reqs


async def _merged(iterators: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """``(choice, event)`` of several streams as they come, until every one has ended."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, it: AsyncIterator) -> None:
        async for ev in it:
            await queue.put((i, ev))

    pumps = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(iterators)]
    left = len(iterators)
    try:
        while left:
            i, ev = await queue.get()
            if isinstance(ev, (End, Failed)):
                left -= 1
            yield i, ev
    finally:
        for task in pumps:
            task.cancel()
        with anyio.CancelScope(shield=True):
            for task, it in zip(pumps, iterators):
                await stop_events(task, it)


async def _many(request: Request, hub: "Hub", reqs: list[ClientRequest], chat: bool, n: int, stream: bool,
                include_usage: bool, tools: Tools | None, keep_logprobs: bool) -> Response:
    """The response of a request of several choices (``n``, ``best_of``): streamed, each
    chunk names its choice by ``index`` (no ``id:`` lines: such a stream is not
    resumable); not streamed, ``choices`` in order, or the ``n`` best of ``best_of``.
    Usage: the prompt once, the completion tokens of every choice. A failed choice fails
    the request, and the others are cancelled."""
    for req in reqs:
        req.watch()
    shape = _Shape(chat, reqs[0].request_id, reqs[0].model, tools)
    events = _merged([req.events("sse" if stream else "http") for req in reqs])

    async def close_all() -> None:
        with anyio.CancelScope(shield=True):
            await events.aclose()
            for req in reqs:
                await req.close(hub.settings.sse_resume_grace_s if stream else 0.0, "http_disconnect")

    if stream:
        async def chunks() -> AsyncIterator[bytes]:
            choices = [_ChoiceStream(shape, i, include_usage) for i in range(len(reqs))]
            ends: list[End] = []
            ticks = _ticking(events, hub.settings.sse_keepalive_s)
            try:
                if shape.chat:
                    for i in range(len(reqs)):
                        out = shape.chunk(None, None, role=True, usage_null=include_usage, index=i)
                        yield _sse(out)
                async for item in ticks:
                    if item is None:
                        yield b": keepalive\n\n"
                        continue
                    i, ev = item
                    if isinstance(ev, Token):
                        for chunk in choices[i].token(ev):
                            yield _sse(chunk)
                    elif isinstance(ev, End):
                        for chunk in choices[i].end(ev):
                            yield _sse(chunk)
                        reqs[i].delivered()
                        ends.append(ev)
                    elif isinstance(ev, Failed):
                        yield _sse(ev.error.to_openai())
                        yield _sse("[DONE]")
                        reqs[i].delivered()
                        return
                    if len(ends) == len(reqs):
                        break
                if include_usage:
                    yield _sse(shape.usage_chunk(_sum_usage(ends)))
                yield _sse("[DONE]")
            finally:
                with anyio.CancelScope(shield=True):
                    await ticks.aclose()
                await close_all()

        return StreamingResponse(chunks(), media_type="text/event-stream", headers=SSE_HEADERS)

    got = [_Gathered() for _ in reqs]
    ends: dict[int, End] = {}

    async def consume():
        async for i, ev in events:
            if isinstance(ev, Token):
                got[i].add(ev)
            elif isinstance(ev, End):
                ends[i] = ev
                reqs[i].delivered()
            elif isinstance(ev, Failed):
                reqs[i].delivered()
                return ev
        return None

    try:
        failed = await _until_disconnect(request, consume())
    finally:
        await close_all()
    if failed is _DISCONNECTED:
        return Response(status_code=499)
    if failed is not None:
        return openai_error_response(failed.error)
    order = list(range(len(reqs)))
    if len(reqs) > n:  # best_of: the n with the highest total log probability
        order = sorted(order, key=lambda i: -sum(e["logprob"] for _, e in got[i].logprobs))[:n]
    choices = [shape.choice_full(j, got[i].text, ends[i], got[i].logprobs if keep_logprobs else None)
               for j, i in enumerate(order)]
    return Response(orjson.dumps(shape.full_many(choices, _sum_usage(list(ends.values())))),
                    media_type="application/json")


def _sum_usage(ends: list[End]) -> End:
    """One ``End`` whose usage is the request's: the prompt once, every choice's completion."""
    first = ends[0]
    return End(first.finish_reason, first.prompt_tokens, sum(e.completion_tokens for e in ends))


_DISCONNECTED = object()


async def _until_disconnect(request: Request, work) -> Any:
    """``work``'s result, or ``_DISCONNECTED`` when the client leaves first (the work is
    cancelled)."""
    async def disconnected():
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return None

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            return _DISCONNECTED
        return task.result()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            try:
                await task
            except BaseException:
                pass


async def _read_body(request: Request, limit: int) -> bytes | None:
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


class _ChoiceStream:
    """The streamed chunks of one choice: its text as it comes (log probabilities of
    tokens whose text is held back ride with the next text), a forced tool call as
    ``tool_calls`` deltas, and with ``"auto"`` text that may be a call held until the end
    decides (docs/tools.md)."""

    def __init__(self, shape: _Shape, index: int, include_usage: bool) -> None:
        self.shape, self.index, self.usage_null = shape, index, include_usage
        self.held: list[tuple[int, dict]] = []
        self.offset = 0
        tools = shape.tools
        self.calls = CallStream() if tools is not None and tools.mode == "forced" else None
        self.maybe_call: list[str] | None = [] if tools is not None and tools.mode == "auto" else None

    def _text(self, text: str | None, finish: str | None = None) -> dict:
        out = self.shape.chunk(text, finish, usage_null=self.usage_null, logprobs=self.held, index=self.index)
        self.held = []
        return out

    def _call(self, kind: str, value: str) -> dict:
        out = self.shape.tool_chunk(kind, value, self.held, self.usage_null, index=self.index)
        self.held = []
        return out

    def token(self, ev: Token) -> list[dict]:
        if ev.logprobs is not None:
            self.held.append((self.offset, ev.logprobs))
        if not ev.text:
            return []
        self.offset += len(ev.text)
        if self.calls is not None:
            return [self._call(kind, value) for kind, value in self.calls.feed(ev.text)]
        text = ev.text
        if self.maybe_call is not None:
            self.maybe_call.append(text)
            text = "".join(self.maybe_call)
            if _could_be_call(text):
                return []
            self.maybe_call = None  # it is text after all: out it goes, and the rest as it comes
        return [self._text(text)]

    def end(self, ev: End) -> list[dict]:
        finish = _FINISH.get(ev.finish_reason, ev.finish_reason)
        out = []
        if self.calls is not None:
            out += [self._call(kind, value) for kind, value in self.calls.finish(ev.finish_reason == "stop")]
            if self.calls.name is not None and ev.finish_reason == "stop":
                finish = "tool_calls"
        elif self.maybe_call is not None:
            call = self.shape.call("".join(self.maybe_call))
            if call is not None:
                out += [self._call("name", call[0]), self._call("arguments", call[1])]
                finish = "tool_calls"
            elif self.maybe_call:
                out.append(self._text("".join(self.maybe_call)))
        out.append(self._text(None if self.shape.chat else "", finish))
        return out


async def _sse_events(hub: "Hub", req: ClientRequest, events: AsyncIterator, shape: _Shape,
                      include_usage: bool) -> AsyncIterator[bytes]:
    """The SSE body of one choice. Keepalives come from the stream itself
    (``RequestStream.tick_s``: no task or timer per token), and the end of the stream (the
    finish chunk, the usage chunk, ``[DONE]``) goes out as one write."""
    choice = _ChoiceStream(shape, 0, include_usage)
    req.stream.tick_s = hub.settings.sse_keepalive_s
    try:
        if shape.chat:
            yield _sse(shape.chunk(None, None, role=True, usage_null=include_usage))
        async for ev in events:
            if ev is TICK:
                yield b": keepalive\n\n"
            elif isinstance(ev, Token):
                chunks = choice.token(ev)
                if chunks:
                    eid = _event_id(req.request_id, req.resume_token, ev.index)
                    yield b"".join(_sse(chunk, eid) for chunk in chunks)
            elif isinstance(ev, End):
                tail = [_sse(chunk) for chunk in choice.end(ev)]
                if include_usage:
                    tail.append(_sse(shape.usage_chunk(ev)))
                tail.append(b"data: [DONE]\n\n")
                yield b"".join(tail)
                req.delivered()
                return
            elif isinstance(ev, Failed):
                yield _sse(ev.error.to_openai()) + b"data: [DONE]\n\n"
                req.delivered()
                return
    finally:
        with anyio.CancelScope(shield=True):
            await stop_events(None, events)
        # the slot goes back only if the request ended; one left running (the client left)
        # keeps it until the worker ends it (ClientRequest.release)
        await req.close(hub.settings.sse_resume_grace_s, "http_disconnect")


async def _collect(request: Request, events: AsyncIterator, shape: _Shape) -> Response:
    """Non-streamed: gather the whole completion, cancelling if the client leaves."""
    got = _Gathered()

    async def consume():
        async for ev in events:
            if isinstance(ev, Token):
                got.add(ev)
            else:
                return ev

    try:
        ev = await _until_disconnect(request, consume())
    finally:
        await stop_events(None, events)
    if ev is _DISCONNECTED:
        return Response(status_code=499)
    if isinstance(ev, Failed):
        return openai_error_response(ev.error)
    return Response(orjson.dumps(shape.full(got.text, ev, got.logprobs)), media_type="application/json")


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    """Models that have at least one live worker."""
    hub: Hub = request.app.state.hub
    try:
        await hub.admission.authenticate(request.headers.get("authorization"))
    except StreamfleetError as exc:
        return openai_error_response(exc)
    try:
        served = await hub.served_models()
    except StreamfleetError as exc:  # Redis down: say so in OpenAI's shape
        return openai_error_response(exc)
    # beyond OpenAI's fields: the live workers, what the model does ("text", or "asr":
    # speech recognition, served on /v1/audio/stream only), and where its chat template
    # comes from (a file of its folder, "engine.toml", "builtin"; null: no chat requests),
    # and whether a request that names no model gets it ("default")
    default = hub.validator.settings.default_model
    data = []
    for name, n in served:
        spec = hub.validator.spec(name)
        try:
            template = hub.validator.chat_template(spec)
        except StreamfleetError:  # an unreadable template file: chat requests say why
            template = None
        data.append({"id": name, "object": "model", "created": 0, "owned_by": "streamfleet", "workers": n,
                     "kind": spec.kind, "chat_template": template, "default": name == default})
    return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")
